"""HTTP front-end worker processes: parse requests outside the runtime's process (``--http-workers``).

Why: on the H200 the one event loop of the runtime's process read, parsed and answered every request
while sharing the interpreter with the runtime's threads; with mix6's 600 KB image tensors HTTP kept
about 1% of the in-process goodput, and on CPU that loop spent about 1 ms per such request
(``docs/reports/serving.md``). With ``N`` workers, each worker process binds the public port
(``SO_REUSEPORT``: the kernel spreads connections over them), parses the KServe v2 HTTP request
itself, and passes only the tensors to the runtime's process over a Unix socket; the runtime's
process books the request (the same ``ServeCore.submit``/``outcome`` as in-process HTTP and gRPC, so
metrics and statistics are unchanged) and sends the outputs back. Every other route (health,
metadata, repository, statistics, metrics) is forwarded unchanged to the runtime process's own HTTP
server on an internal loopback port.

The worker's end is here; the runtime process's end is ``bridge.py`` (``InferBridge``), and the
frames and compact ring records between them are ``wire.py``.

    python -m gpuloom.serve.frontend --socket PATH --host H --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any, Callable

from ..runtime.gcpause import RareFullCollections, freeze_loaded
from .allowance import DEFAULT_MODE, MODES, ReturnAllowance, check_mode
from .client_timeout import DEFAULT_CLIENT_TIMEOUT_S, ClientTimeouts
from .protocol import ProtocolError
from .wire import (FRAME, _copy_into, _describe, _recv_control, _Templates, pack, read_ring_reply, ring_request,
                   unpack_tensors)

log = logging.getLogger(__name__)

#: how much lower the workers' CPU priority is than the runtime's process (``os.nice`` increment;
#: ``gpuloom serve --http-worker-nice``). Why one would: when a reply's eventfd wakes a sleeping
#: worker on a busy host, the kernel may preempt the runtime's thread for it, and that thread holds
#: the GIL through the write (ring.py), so the whole runtime process stops. On the 2-core build VM
#: (4 workers, mix6 --tiny x0.15) nice 10 cut the loop thread's time off the CPU per completion from
#: 167-240 us to 34-59 and per decision from 136-271 to 37-141, in 5 of 5 pairs. End to end it was
#: mixed: the HTTP / in-process ratio rose in 2 of 3 pairs across processes and fell in both rounds
#: within one process, where the starved workers made the requests wait in them instead
#: (``docs/reports/serving.md``, twenty-ninth session). So 0 (the same priority) until the H200 says.
WORKER_NICE = 0
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
_DROPPED = (503, 504)  # the runtime dropped the request (or its deadline passed): what an allowance can cause


class GracefulStop:
    """How a worker told to stop (SIGTERM: ``Server.stop`` signals the workers, drains the runtime,
    then waits for them to exit) ends: it stops taking connections, answers what arrives on the ones already open, each
    answer saying ``Connection: close``, and closes them once no request is being handled and none
    has been answered for ``QUIET_S`` (at most ``GRACE_S`` after the stop). Why: aiohttp's own stop
    drops, unread, whatever arrives after it began, so a client that sent its next request on a
    kept-alive connection just then saw it reset (the sixty-fifth session's SIGTERM runs,
    ``docs/reports/serving.md``). An idle connection is closed after the quiet time: a request sent
    on it later still finds it gone (HTTP/1.1's own race, which a client retries, RFC 9112 9.3.1). A
    request whose body is still arriving when the grace ends has its connection cut then: aiohttp's
    cleanup would drop the rest of the body and leave its handler waiting for it until the drain
    timeout (30 s), holding the whole stop up (a review, sixty-eighth session)."""

    QUIET_S = 0.25
    GRACE_S = 2.0  # GPULOOM_WORKER_STOP_GRACE_S overrides it (0: close at once, as before)

    def __init__(self, grace_s: float | None = None) -> None:
        if grace_s is None:
            text = os.environ.get("GPULOOM_WORKER_STOP_GRACE_S")
            try:
                grace_s = self.GRACE_S if text is None else float(text)
                if not 0.0 <= grace_s <= 60.0:  # (NaN too)
                    raise ValueError
            except ValueError:
                log.warning("GPULOOM_WORKER_STOP_GRACE_S=%r is not a number of seconds in [0, 60]: %g s", text,
                            self.GRACE_S)
                grace_s = self.GRACE_S
        self.grace_s = grace_s
        self.stopping = False
        self.last_answer = -math.inf  # monotonic s of the last answer prepared
        self.in_flight: dict[int, Any] = {}  # id -> each request whose handler runs now (middleware; unhashable)

    def middleware(self) -> Callable[..., Any]:
        """The app's first middleware: keeps :attr:`in_flight`."""
        from aiohttp import web

        @web.middleware
        async def track(request: Any, handler: Callable[..., Any]) -> Any:
            key = id(request)
            self.in_flight[key] = request
            try:
                return await handler(request)
            finally:
                del self.in_flight[key]

        return track

    def hook(self) -> Callable[..., Any]:
        """The app's ``on_response_prepare``: notes each answer, and closes its connection once stopping."""
        from .http_server import close_when  # (aiohttp: imported where the app is built, as the rest)

        close = close_when(lambda: self.stopping)

        async def prepare(request: Any, response: Any) -> None:
            self.last_answer = time.monotonic()
            await close(request, response)

        return prepare

    async def stop(self, runner: Any, site: Any) -> None:
        """Stop listening, then wait out the grace before ``runner.cleanup()`` closes every connection."""
        if self.grace_s <= 0:
            return
        self.stopping = True
        await site.stop()
        began = time.monotonic()
        while True:
            now = time.monotonic()
            server = runner.server
            if server is None or not server.connections or now - began >= self.grace_s:
                break
            if not self.in_flight and now - max(self.last_answer, began) >= self.QUIET_S:
                break
            await asyncio.sleep(0.02)
        for request in list(self.in_flight.values()):  # answers coming go on; a body still arriving is cut
            transport = request.transport
            if not request.content.is_eof() and transport is not None:
                transport.close()


def build_worker_app(sock_path: str, upstream: str, max_body_bytes: int, arena_bytes: int = 0, ring_bytes: int = 0,
                     return_allowance: str = DEFAULT_MODE, graceful: GracefulStop | None = None,
                     max_bodies_bytes: int = 1 << 30):
    """The worker's aiohttp app: infer over the bridge, everything else forwarded to ``upstream``.
    ``arena_bytes``: size of the shared memory the tensors go through (0: inline on the socket).
    ``ring_bytes``: size of the shared rings request and reply frames go through (``ring.py``; only
    with an arena; 0: over the socket). ``return_allowance``: "auto" adds this worker's estimate of
    a request's time outside the service after it is handed on to its ``waited_ms`` (``allowance.py``).
    ``graceful``: how it answers while it stops (:class:`GracefulStop`). ``max_bodies_bytes``: the
    infer request bodies it receives or handles at once (``http_server.bodies_bounded``)."""
    import aiohttp
    from aiohttp import web

    from . import arena as arena_mod
    from . import ring as ring_mod
    from .http_server import (CORE_KEY, DEADLINE_HEADER, HEADER_LEN, _error, _errors, bodies_bounded, infer_response,
                              refusals_booked)
    from .protocol import deadline_ms_from_parameters, parse_infer_body

    state: dict[str, Any] = {"pending": {}, "next": 0, "blocks": {}, "arena": None, "rings": None, "up": True}
    allowance = ReturnAllowance() if check_mode(return_allowance) == "auto" else None

    async def on_startup(app):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sock_path)
        shared = arena_mod.Arena(arena_bytes) if arena_bytes > 0 and arena_mod.supported() else None
        rings = ring_mod.WorkerRings(ring_bytes) if shared and ring_bytes > 0 and ring_mod.supported() else None
        js = json.dumps({"hello": 1, "arena_bytes": shared.size if shared else 0,
                         "ring_bytes": rings.size if rings else 0}).encode()
        socket.send_fds(sock, [FRAME.pack(len(js), 0) + js], ([shared.fd] if shared else []) + (rings.fds if rings else []))
        if rings is not None:
            ok, wake_fd = _recv_ack(sock)
            if not ok:  # the runtime could not map them: the socket it is
                rings.close()
                rings = None
            elif wake_fd is not None:  # the runtime's loop takes the requests: wake it, not a drain thread
                from ..runtime.waker import SemaphoreWaker

                rings.runtime_wake = SemaphoreWaker.attach(wake_fd)
        state["arena"], state["rings"] = shared, rings
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        state["writer"], state["lock"] = writer, asyncio.Lock()
        state["reader_task"] = asyncio.create_task(read_replies(reader))
        # no total timeout: a repository load forwarded upstream lasts as long as its compile and profile
        # (minutes on a GPU), and aiohttp's default 300 s answered it an error while it carried on
        state["session"] = aiohttp.ClientSession(auto_decompress=False,
                                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        if rings is not None:
            asyncio.get_running_loop().add_reader(rings.event_fd, rings.take_replies, ring_reply)

    async def on_cleanup(app):
        state["reader_task"].cancel()
        state["writer"].close()
        await state["session"].close()
        if state["rings"] is not None:
            asyncio.get_running_loop().remove_reader(state["rings"].event_fd)
            state["rings"].close()
        if state["arena"] is not None:
            state["arena"].close()

    def deliver(meta: dict, payload: memoryview) -> None:
        block = state["blocks"].pop(meta["id"], None)
        if block is not None:  # the runtime is done with the request's inputs
            state["arena"].free(block)
        fut = state["pending"].pop(meta["id"], None)
        if fut is not None and not fut.done():
            fut.set_result((meta, payload))

    reply_templates = _Templates(dict)

    def ring_reply(record: memoryview) -> None:
        """A reply from the reply ring (a compact record or a frame)."""
        deliver(*read_ring_reply(record, reply_templates))

    async def read_replies(reader):
        try:
            while True:
                jlen, plen = FRAME.unpack(await reader.readexactly(FRAME.size))
                body = await reader.readexactly(jlen + plen)  # JSON and payload in one read
                deliver(json.loads(body[:jlen]), memoryview(body)[jlen:])
        except (asyncio.IncompleteReadError, ConnectionError):
            state["up"] = False  # nothing more goes into the rings either: nobody would answer
            if state["rings"] is not None:  # replies the runtime wrote before it went still count
                state["rings"].take_replies(ring_reply)
            for fut in state["pending"].values():
                if not fut.done():
                    fut.set_exception(ProtocolError("the runtime process closed the connection", 503, retry_after_s=1.0))

    async def _unknown_model_first(name: str, version: str | None) -> None:
        """A body that does not parse, sent to a model (or version) that does not exist: the 404 goes
        first, as the runtime's process answers it (this worker keeps no list of models, so it asks,
        on this error path only)."""
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "")
        try:
            async with state["session"].get(upstream + path) as r:
                if r.status != 404:
                    return
                why = (await r.json()).get("error")
        except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
            return  # the runtime's process did not say: the body's own error stands
        raise ProtocolError(why or f"unknown model {name!r}", 404)

    def tell_refused(name: str, version: str | None, status: int) -> None:
        """Tell the runtime's process of a request this worker refused while reading or parsing it,
        for its books (``gpuloom_request_rejected``; ``InferBridge`` calls ``ServeCore.refused``). One
        small frame, no answer awaited; lost only where that process is gone already."""
        writer = state.get("writer")
        if not state["up"] or writer is None or writer.is_closing():
            return
        js = json.dumps({"refused": {"model": name, "version": version, "status": status}}).encode()
        writer.write(FRAME.pack(len(js), 0) + js)  # (one write: whole between other writers' frames)

    async def infer(request: web.Request):
        t_in = time.perf_counter()  # headers read; the body may still be arriving
        name, version = request.match_info["model"], request.match_info.get("version")
        with refusals_booked(functools.partial(tell_refused, name, version)):
            body = await request.read()
            try:
                req = parse_infer_body(body, request.headers.get(HEADER_LEN))
                deadline = deadline_ms_from_parameters(req.parameters, request.headers.get(DEADLINE_HEADER))
            except ProtocolError:
                await _unknown_model_first(name, version)
                raise
        if not state["up"]:
            raise ProtocolError("the runtime process is not reachable (its connection closed)", 503, retry_after_s=1.0)
        state["next"] += 1
        rid = state["next"]
        # the deadline (given, or the model's SLO) counts from this handler, not from the runtime's
        # intake: a worker that falls behind hands on requests with less time left (run 81: 55 ms at p50)
        t_handed = time.perf_counter()
        waited = (t_handed - t_in) * 1e3
        if allowance is not None:  # and as if the time it will spend outside the service had passed too
            waited += allowance.ms
        meta = {"id": rid, "model": name, "version": version, "deadline_ms": deadline, "waited_ms": waited,
                "outputs": list(req.outputs) if req.outputs is not None else None}
        arrays = list(req.inputs.values())
        nbytes = sum(a.nbytes for a in arrays)
        shared, rings = state["arena"], state["rings"]
        block = shared.alloc(nbytes) if shared is not None else None
        try:
            if block is None:  # no arena, or full: inline on the socket
                frame = pack(dict(meta, names=list(req.inputs)), arrays)
            else:
                tensors, bufs = _describe(list(req.inputs), arrays)
                _copy_into(shared.view(block, nbytes), bufs)
                frame = None
        except Exception:  # nothing was handed on: the block goes back, no reply is awaited
            if block is not None:
                shared.free(block)
            raise
        fut = asyncio.get_running_loop().create_future()
        state["pending"][rid] = fut
        if block is not None:
            state["blocks"][rid] = block  # freed when the reply comes back (deliver)
        t_bridge = time.perf_counter()
        if block is None or rings is None or not rings.send(ring_request(rid, meta, tensors, block, deadline, waited)):
            if frame is None:  # the ring is full: the socket, its tensors still in the arena
                js = json.dumps(dict(meta, arena=block, tensors=tensors)).encode()
                frame = [FRAME.pack(len(js), 0), js]
            try:
                async with state["lock"]:
                    state["writer"].writelines(frame)
                    await state["writer"].drain()
            except (ConnectionError, RuntimeError) as e:  # the runtime's process is gone or stopping
                state["pending"].pop(rid, None)
                if state["blocks"].pop(rid, None) is not None:
                    shared.free(block)
                raise ProtocolError(f"the runtime process is not reachable: {e}", 503, retry_after_s=1.0) from None
        meta, payload = await fut
        if meta["status"] != 200:
            if allowance is not None and meta["status"] in _DROPPED:
                allowance.miss()
            return _error(meta["error"], meta["status"], meta.get("retry_after_s"))
        outputs = unpack_tensors(meta, payload)
        t_out = time.perf_counter()
        timing = {"service": float(meta.get("service_ms", 0.0)), "bridge": (t_out - t_bridge) * 1e3,
                  "worker": (t_out - t_in) * 1e3}
        response = infer_response(name, outputs, req, timing)
        if allowance is not None:  # from the moment waited_ms was taken: the time the runtime did not count
            allowance.add((time.perf_counter() - t_handed) * 1e3 - timing["service"])
        return response

    async def forward(request: web.Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read()
        async with state["session"].request(request.method, upstream + request.path_qs, headers=headers,
                                            data=data) as r:
            body = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
            return web.Response(status=r.status, body=body, headers=out)

    bounded = bodies_bounded(max_bodies_bytes, max_body_bytes, tell_refused)
    app = web.Application(middlewares=([graceful.middleware()] if graceful is not None else []) + [_errors, bounded],
                          client_max_size=max_body_bytes)
    app[CORE_KEY] = _Limits(max_body_bytes)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    if graceful is not None:
        app.on_response_prepare.append(graceful.hook())
    return app


class _Limits:
    """What the shared error middleware reads from the app (the body limit, for 413 messages)."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes


def _recv_ack(sock: socket.socket, timeout_s: float = 30.0) -> tuple[bool, int | None]:
    """The runtime's answer to a hello that offered rings: whether it mapped them, and the
    descriptor of its loop's semaphore when the loop takes the requests (else None)."""
    sock.settimeout(timeout_s)
    fds: list[int] = []
    try:
        ack, fds = _recv_control(sock, 1)
        if ack is None:
            raise ConnectionError("the runtime process closed the connection during the hello")
        wake = fds.pop(0) if ack.get("wake") == "loop" and fds else None
        return bool(ack.get("ring")), wake
    finally:
        for fd in fds:
            os.close(fd)
        sock.settimeout(None)


def ring_kb_default() -> int:
    """``GPULOOM_WORKER_RING_KB`` (0: requests and replies over the socket), else 8 MiB per worker."""
    from .ring import DEFAULT_KB

    return int(os.environ.get("GPULOOM_WORKER_RING_KB", str(DEFAULT_KB)))


def arena_mb_default() -> int:
    """``GPULOOM_WORKER_ARENA_MB`` (0 turns the arena off), else 256 MiB per worker: memory is
    taken only as requests touch it, and a request that does not fit goes inline."""
    return int(os.environ.get("GPULOOM_WORKER_ARENA_MB", "256"))


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    ap = argparse.ArgumentParser(description="gpuloom HTTP front-end worker (started by gpuloom serve --http-workers)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--max-body", type=int, required=True)
    ap.add_argument("--max-bodies", type=int, required=True,
                    help="bytes of infer request bodies received or handled at once (past it: 429)")
    ap.add_argument("--backlog", type=int, default=2048)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                    help="close connections whose client keeps this worker waiting this long, s (client_timeout.py)")
    ap.add_argument("--arena-mb", type=int, default=arena_mb_default(),
                    help="shared memory for request tensors, MiB (0: send them over the socket)")
    ap.add_argument("--ring-kb", type=int, default=ring_kb_default(),
                    help="shared rings for request and reply frames, KiB (0: over the socket; needs the arena)")
    ap.add_argument("--cpus", default=None, help="run on these CPUs (a taskset -c list; default: as started)")
    ap.add_argument("--nice", type=int, default=0,
                    help="lower this process's CPU priority by this much (os.nice; default 0: as started)")
    ap.add_argument("--return-allowance", choices=MODES, default=DEFAULT_MODE,
                    help="auto: add this worker's estimate of a request's time outside the service after it is "
                         f"handed on to the time it has waited (allowance.py; default {DEFAULT_MODE})")
    args = ap.parse_args(argv)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError as e:  # (a container may refuse it): the worker serves at the priority it has
            log.warning("could not lower the worker's priority by %d: %s", args.nice, e)
    if args.cpus:  # not the runtime's: gpuloom serve --cpus pins the runtime's process, which started this one
        from gpuloom.runtime.affinity import parse_cpus, pin_process

        pin_process(parse_cpus(args.cpus))

    async def run() -> None:
        graceful = GracefulStop()
        app = build_worker_app(args.socket, args.upstream, args.max_body, args.arena_mb << 20, args.ring_kb << 10,
                               args.return_allowance, graceful, args.max_bodies)
        guard = ClientTimeouts(args.client_timeout)
        runner = await guard.runner(app, access_log=None, shutdown_timeout=args.drain_timeout)
        site = web.TCPSite(runner, args.host, args.port, reuse_port=True, backlog=args.backlog)
        # the worker allocates per request too: keep its start-up heap out of collections and its
        # full collections rare (gpuloom.runtime.gcpause; 53-75 ms pauses measured in the runtime),
        # collecting once before it takes connections
        freeze_loaded()
        RareFullCollections.enter()
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print("READY", flush=True)
        await stop.wait()
        guard.stop()
        await graceful.stop(runner, site)  # no new connections; the open ones answered and told to close
        await runner.cleanup()  # closes them; in-flight requests finish within the drain timeout

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
