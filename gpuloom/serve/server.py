"""Run the HTTP and gRPC front ends over one ``InferenceService`` in one asyncio loop.

:class:`Server` can run in the foreground (``serve_forever``, SIGTERM/SIGINT drain and stop: the
``gpuloom serve`` command) or on a background thread (``start``/``stop``: tests, notebooks).

Shutdown order (graceful): stop accepting new requests (503 + Retry-After), close the runtime with
``drain=True`` so every queued request is served or answered with a reason (or, with
``close_service=False``, let the runtime go on and serve them), let the transports send those
answers, then close the listeners.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from . import (AUTO_HOST_MAX_BATCH_MS, DEFAULT_CLIENT_TIMEOUT_S, RUNTIME_ON, allowance, bridge, check_client_timeout,
               frontend)
from .client_timeout import ClientTimeouts
from .core import ServeCore

log = logging.getLogger("gpuloom.serve")

__all__ = ["AUTO_HOST_MAX_BATCH_MS", "Server", "ServeError", "ServerAddress", "RUNTIME_ON", "check_ports_free"]


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (lower per-request overhead, as KServe and uvicorn use), else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class ServeError(RuntimeError):
    """The server could not start (port taken, bad address); the message says what to change."""


@dataclass(frozen=True)
class ServerAddress:
    host: str
    http_port: int
    grpc_port: int | None

    @property
    def http_url(self) -> str:
        return f"{_bracketed(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str | None:
        return None if self.grpc_port is None else f"{_bracketed(self.host)}:{self.grpc_port}"


def _bracketed(host: str) -> str:
    """An IPv6 address as a URL writes it (``[::1]``); any other host as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Server:
    """HTTP (+ optional gRPC) over ``core``. Ports 0 pick free ports (see :attr:`address` after start).

    The defaults are the plainest server: HTTP parsed in this process (``http_workers=0``) and the
    runtime's loop on its own thread (``runtime_on="thread"``). ``gpuloom serve`` chooses both per host
    instead (``commands.serve.default_http_workers``, ``--runtime-on auto``): pass those to serve as it
    does."""

    def __init__(self, core: ServeCore, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int | None = 8001,
                 drain_timeout_s: float = 30.0, listen_backlog: int = 2048, http_workers: int = 0,
                 worker_arena_mb: int | None = None, worker_ring_kb: int | None = None,
                 worker_cpus: set[int] | None = None, ring_drain_on: str = "loop", worker_wakeups: str = "batch",
                 runtime_on: str = "thread", close_service: bool = True, worker_nice: int = frontend.WORKER_NICE,
                 client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S, return_allowance: str = allowance.DEFAULT_MODE,
                 intake_window_ms: float = 0.0):
        self.core = core
        # a connection whose client sends nothing this long while the server waits on it (its first
        # request, a body, the next request) is closed (client_timeout.ClientTimeouts: why)
        self.client_timeout_s = check_client_timeout(client_timeout_s)
        self._client_timeouts: ClientTimeouts | None = None
        # stopping closes the runtime (drained) as well; False leaves it running with its models
        # loaded, for the next server on it (a benchmark's front ends taking turns on one service),
        # which needs a ServeCore of its own: this one's stays closing (503) once stopped
        self.close_service = close_service
        if runtime_on not in RUNTIME_ON:
            raise ValueError(f"runtime_on: expected one of {RUNTIME_ON}, got {runtime_on!r}")
        if runtime_on == "http" and http_workers:
            raise ValueError("runtime_on='http' runs the runtime's loop on this process's HTTP event loop: it needs "
                             "http_workers=0 (front-end workers wake the runtime's own thread)")
        # where the runtime's loop runs: its own thread, or this server's event loop (the CPU device:
        # no thread hand-off per request; InferenceService.host_loop_on); "auto": the event loop where
        # the service can be hosted (the CPU device, no front-end workers) and its batches are short
        self.runtime_on = runtime_on
        # the CPUs the front-end workers run on (None: those of this process when it starts them)
        self.worker_cpus = worker_cpus
        if not isinstance(worker_nice, int) or isinstance(worker_nice, bool) or not 0 <= worker_nice <= 19:
            raise ValueError(f"worker_nice: expected an int from 0 to 19 (how much lower the front-end workers' CPU "
                             f"priority is than this process's), got {worker_nice!r}")
        # how much lower the workers' CPU priority is than this process's (frontend.WORKER_NICE: why)
        self.worker_nice = worker_nice
        if not isinstance(http_workers, int) or http_workers < 0:
            raise ValueError(f"http_workers: expected a non-negative int, got {http_workers!r}")
        _check_size("worker_arena_mb", worker_arena_mb, "MiB; 0 = no arena")
        # shared memory each worker passes request tensors through (frontend.py, arena.py); None:
        # the worker's default (GPULOOM_WORKER_ARENA_MB, else 256)
        self.worker_arena_mb = worker_arena_mb
        _check_size("worker_ring_kb", worker_ring_kb, "KiB; 0 = over the socket")
        # shared rings each worker's request and reply frames go through (ring.py); None: the
        # worker's default (GPULOOM_WORKER_RING_KB, else 8 MiB)
        self.worker_ring_kb = worker_ring_kb
        if ring_drain_on not in bridge.DRAIN_ON:
            raise ValueError(f"ring_drain_on: expected one of {bridge.DRAIN_ON}, got {ring_drain_on!r}")
        # who takes the requests from the workers' rings: the runtime's loop thread, or a thread per worker
        self.ring_drain_on = ring_drain_on
        if worker_wakeups not in bridge.WAKEUPS:
            raise ValueError(f"worker_wakeups: expected one of {bridge.WAKEUPS}, got {worker_wakeups!r}")
        # a worker's replies in its ring wake it once per batch (of ring.COALESCE_FROM_ROWS rows or more) or per reply
        self.worker_wakeups = worker_wakeups
        # the runtime's loop takes the workers' requests from their rings at most once per this many ms
        # (0: at every wake), so they come in bursts (bridge._LoopIntake: why, and what it costs)
        self.intake_window_ms = bridge.check_intake_window(intake_window_ms)
        # "auto": each worker adds its estimate of a request's time in the server after it is handed
        # on and outside the service to the time the request has waited (allowance.py: why)
        self.return_allowance = allowance.check_mode(return_allowance)
        # 0: this process serves HTTP. N > 0: N front-end processes parse HTTP on the public port and
        # pass tensors over a Unix socket (frontend.py); this process serves HTTP on a loopback port
        # for the routes they forward.
        self.http_workers = http_workers
        self._workers: list = []
        self.workers_restarted = 0  # front-end workers started again after they exited
        self._bridge = None
        self._reserved = None
        self._sockdir: str | None = None  # holds the bridge's Unix socket while workers run
        self._watch_stop = threading.Event()  # set: the worker watcher stops
        # Connections waiting to be accepted. aiohttp's default (128) overflowed under bursts of large
        # requests: the kernel dropped the handshake and the client's sends were reset (ECONNRESET
        # on 238-311 of 4,000 requests at 1,000 req/s of 600 KB tensors on CPU,
        # docs/results/serve/http_big_tensor_cpu.json). The kernel caps it at net.core.somaxconn.
        self.listen_backlog = listen_backlog
        self.host = host
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.drain_timeout_s = drain_timeout_s
        self.address: ServerAddress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._stopped = threading.Event()
        self._runner = None
        self._grpc = None

    # -- lifecycle inside the loop -----------------------------------------------------------------
    async def _start(self) -> None:
        from aiohttp import web

        from .http_server import build_app

        self._stop_event = asyncio.Event()
        app = build_app(self.core)
        self._client_timeouts = ClientTimeouts(self.client_timeout_s)
        self._runner = await self._client_timeouts.runner(app, access_log=None, shutdown_timeout=self.drain_timeout_s)
        if self.http_workers:
            try:
                self._reserved = bridge.reserve_port(self.host, self.http_port)
            except OSError as e:
                await self._runner.cleanup()
                raise _bind_error("HTTP", self.host, self.http_port, "--http-port", e) from None
            site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=self.listen_backlog)
        else:
            site = web.TCPSite(self._runner, self.host, self.http_port, reuse_address=True, backlog=self.listen_backlog)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise _bind_error("HTTP", self.host, self.http_port, "--http-port", e) from None
        http_port = site._server.sockets[0].getsockname()[1]
        if self.runtime_on == "http":
            why = self.core.service.host_loop_refusal()
            if why is not None:
                await self._runner.cleanup()
                raise ServeError(f"--runtime-on http: {why}")
        if self.http_workers:
            internal, http_port = http_port, self._reserved.getsockname()[1]
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._start_workers, http_port, internal)
            except BaseException:
                self._stop_workers()
                await self._runner.cleanup()
                raise
        grpc_port = None
        if self.grpc_port is not None:
            import grpc

            from .grpc_server import add_servicer

            self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", self.core.max_body_bytes),
                                                  ("grpc.so_reuseport", 0)])
            add_servicer(self._grpc, self.core)
            try:
                grpc_port = self._grpc.add_insecure_port(_grpc_address(self.host, self.grpc_port))
            except RuntimeError as e:  # (gRPC says why only in its text: a taken port, or a host it cannot use)
                await self._runner.cleanup()
                raise _bind_error("gRPC", self.host, self.grpc_port, "--grpc-port", OSError(None, str(e))) from None
            if not grpc_port:
                await self._runner.cleanup()
                raise _bind_error("gRPC", self.host, self.grpc_port, "--grpc-port", OSError(errno.EADDRINUSE, "bind failed"))
            await self._grpc.start()
        if self.runtime_on == "http":  # last: nothing can fail after it and leave the runtime on a dead loop
            self.core.service.host_loop_on(asyncio.get_running_loop())
        elif self.runtime_on == "auto" and not self.http_workers and self.core.service.host_loop_refusal() is None:
            self.core.service.host_loop_on(asyncio.get_running_loop(), longest_batch_ms=AUTO_HOST_MAX_BATCH_MS)
        self.address = ServerAddress(self.host, http_port, grpc_port)

    def _start_workers(self, port: int, internal: int) -> None:
        """Start the front-end workers on ``port``; wait until each listens (ServeError if one fails)."""
        import subprocess
        import sys
        import tempfile

        self._sockdir = tempfile.mkdtemp(prefix="gpuloom-")
        path = os.path.join(self._sockdir, "bridge.sock")
        self._bridge = bridge.InferBridge(self.core, path, drain_on=self.ring_drain_on, wakeups=self.worker_wakeups,
                                          intake_window_ms=self.intake_window_ms)
        cmd = [sys.executable, "-m", "gpuloom.serve.frontend", "--socket", path, "--host", self.host,
               "--port", str(port), "--upstream", f"http://127.0.0.1:{internal}",
               "--max-body", str(int(self.core.max_body_bytes)), "--backlog", str(self.listen_backlog),
               "--max-bodies", str(int(self.core.max_bodies_bytes)),
               # a worker waits for its requests' answers as long as this process may drain, and a little longer
               "--drain-timeout", str(self.drain_timeout_s + _WORKER_EXIT_MARGIN_S),
               "--client-timeout", str(self.client_timeout_s)]
        if self.worker_arena_mb is not None:
            cmd += ["--arena-mb", str(self.worker_arena_mb)]
        if self.worker_ring_kb is not None:
            cmd += ["--ring-kb", str(self.worker_ring_kb)]
        if self.worker_cpus:
            cmd += ["--cpus", ",".join(str(c) for c in sorted(self.worker_cpus))]
        if self.worker_nice:
            cmd += ["--nice", str(self.worker_nice)]
        cmd += ["--return-allowance", self.return_allowance]
        self._worker_cmd = cmd
        started = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(self.http_workers)]
        self._workers.extend(started)  # all start together; _stop_workers reaps them if one fails
        for w in started:
            _wait_ready(w)
        threading.Thread(target=self._watch_workers, name="gpuloom-workers", daemon=True).start()

    def _spawn_worker(self):
        """One more front-end worker, listening when this returns (ServeError, and no process left, if not)."""
        import subprocess

        w = subprocess.Popen(self._worker_cmd, stdout=subprocess.PIPE, text=True)
        try:
            _wait_ready(w)
        except BaseException:
            w.kill()
            w.wait()
            raise
        return w

    def worker_pids(self) -> list[int]:
        """The process ids of the HTTP front-end workers running now (``http_workers``; empty without)."""
        return [w.pid for w in list(self._workers) if w.poll() is None]

    def _watch_workers(self, period_s: float = 0.5) -> None:
        """Restart a worker that exits while the server runs (the others keep the port meanwhile)."""
        while not self._watch_stop.wait(period_s):
            for i, w in enumerate(list(self._workers)):
                if w.poll() is None or self._watch_stop.is_set():
                    continue
                log.error("HTTP front-end worker %d exited with status %s; starting another", w.pid, w.returncode)
                try:
                    self._workers[i] = self._spawn_worker()
                except Exception as e:  # noqa: BLE001 - keep watching; the other workers still serve
                    log.error("could not restart the worker: %s", e)
                    continue
                self.workers_restarted += 1

    def _stop_workers(self) -> None:
        """SIGTERM every worker, wait for them, then close (:meth:`_signal_workers`, :meth:`_reap_workers`)."""
        self._signal_workers()
        self._reap_workers()

    def _signal_workers(self) -> None:
        """SIGTERM every worker: each stops taking connections, answers what its open ones still send
        (``frontend.GracefulStop``) and exits once every request it passed on here is answered."""
        self._watch_stop.set()  # (before the signal: a stopping worker is not restarted)
        for w in self._workers:
            if w.poll() is None:
                w.terminate()

    def _reap_workers(self) -> None:
        """Wait for the signalled workers to exit (killed if stuck: never hang a stop), then close the
        bridge. Called once the runtime has answered every request (its drain): a worker's handlers
        then have their answers, and nothing it passed on is cut off."""
        for w in self._workers:
            try:
                w.wait(self.drain_timeout_s + _WORKER_EXIT_MARGIN_S)
            except Exception:  # noqa: BLE001 - stuck: kill, never hang shutdown
                w.kill()
                try:
                    w.wait(5)
                except Exception:  # noqa: BLE001
                    pass
        self._workers = []
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._sockdir is not None:
            import shutil

            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = None

    async def _shutdown(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        if self.runtime_on != "thread":  # the drain runs on the runtime's own thread: HTTP stays free to answer
            core.service.unhost_loop()
        workers = bool(self._workers)
        if workers:  # told first: they stop taking connections now, and wait for this process's answers
            self._signal_workers()
        core.closing = True
        core.abandon_waits()  # loads or unloads under way answer 503 now (a load of minutes held the stop)
        if self.close_service:
            # drain: the runtime serves or answers every queued request; handlers awaiting them then reply
            await loop.run_in_executor(None, lambda: core.service.close(drain=True, timeout_s=self.drain_timeout_s))
        # what is still in flight is answered by the runtime (closed: at once; left running: when served)
        deadline = loop.time() + (5.0 if self.close_service else self.drain_timeout_s)
        while core.books.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if workers:  # every answer is on its way to them through the bridge: they finish and exit
            # (stopped before the drain, they cut off what waited for it: a review, sixty-eighth session)
            await loop.run_in_executor(None, self._reap_workers)
        await self._answer_backlog(loop.time() + 2.0)
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._client_timeouts is not None:
            self._client_timeouts.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _answer_backlog(self, deadline: float) -> None:
        """Take and answer (503: stopping) the connections still waiting in the listener's backlog
        before it closes, which would reset them: clients that connected while this loop was busy
        (running batches, with ``runtime_on="http"``) are told to retry, not cut off. Done once the
        backlog has stayed empty and nothing was in flight for three looks 10 ms apart."""
        import select

        loop = asyncio.get_running_loop()
        listening = select.poll()  # (select.select refuses descriptors past 1023)
        for site in (self._runner.sites if self._runner is not None else ()):
            for sock in getattr(getattr(site, "_server", None), "sockets", None) or ():
                listening.register(sock.fileno(), select.POLLIN)
        quiet = 0
        while quiet < 3 and loop.time() < deadline:
            waiting = bool(listening.poll(0))
            quiet = 0 if waiting or self.core.books.in_flight() else quiet + 1
            await asyncio.sleep(0.01)

    async def _main(self, started: threading.Event | None, box: list) -> None:
        try:
            await self._start()
        except BaseException as e:
            box.append(e)
            if started:
                started.set()
            return
        if started:
            started.set()
        await self._stop_event.wait()
        await self._shutdown()

    # -- foreground ----------------------------------------------------------------------------------
    def serve_forever(self, on_started=None) -> None:
        """Run until SIGTERM/SIGINT, then drain and stop. Raises ServeError if a port cannot be bound."""

        async def main():
            self._loop = asyncio.get_running_loop()
            await self._start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._loop.add_signal_handler(sig, self._stop_event.set)
                except (NotImplementedError, RuntimeError, ValueError):  # off the main thread (uvloop: ValueError)
                    pass
            if on_started:
                on_started(self.address)
            await self._stop_event.wait()
            log.info("stopping: draining queued requests")
            await self._shutdown()

        try:
            with asyncio.Runner(loop_factory=_new_loop) as runner:
                runner.run(main())
        finally:
            self._stopped.set()

    # -- background thread -----------------------------------------------------------------------------
    def start(self) -> ServerAddress:
        """Start on a daemon thread; returns the bound address. Raises ServeError (e.g. port taken)."""
        started = threading.Event()
        box: list = []

        def run():
            loop = _new_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._main(started, box))
            finally:
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="gpuloom-serve", daemon=True)
        self._thread.start()
        started.wait()
        if box:
            self._thread.join()
            raise box[0]
        return self.address

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and stop (from another thread); returns when the listeners are closed."""
        if self._loop is not None and self._stop_event is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self._stopped.wait(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)


#: how much longer than the runtime's drain a stopping worker may take to exit: its grace
#: (``frontend.GracefulStop``, at most 2 s) and the answers' way back through the bridge
_WORKER_EXIT_MARGIN_S = 5.0


def _check_size(name: str, value: Any, unit: str) -> None:
    """None (the worker's default) or a non-negative int; ValueError naming ``name`` otherwise."""
    if value is not None and (not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}: expected a non-negative int ({unit}), got {value!r}")


def _wait_ready(worker) -> None:
    """Block until a front-end worker prints READY (it listens); ServeError if it exits first."""
    line = worker.stdout.readline()  # "" if it died
    if line.strip() != "READY":
        raise ServeError(f"an HTTP front-end worker did not start (exit status {worker.poll()}); see its error above")


def check_ports_free(host: str, http_port: int, grpc_port: int | None) -> None:
    """Raise ``ServeError`` (as ``Server.start`` would) if ``host`` cannot listen on these ports now.

    A preflight for ``gpuloom serve``: loading models can take minutes, and a taken port or a wrong
    ``--host`` found only after them wastes that time. Port 0 (any free port) checks the host alone; a
    port taken in the moment between this check and the listen is still reported then."""
    if http_port and http_port == grpc_port:
        raise ServeError(f"--http-port and --grpc-port are both {http_port}: give them different ports")
    for what, port, flag in (("HTTP", http_port, "--http-port"), ("gRPC", grpc_port, "--grpc-port")):
        if port is None:
            continue
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do: TIME_WAIT is free
                sock.bind(addr)
        except OSError as e:  # socket.gaierror too: a --host that names no address
            raise _bind_error(what, host, port, flag, e) from None


def _grpc_address(host: str, port: int) -> str:
    """gRPC's ``host:port``: an IPv6 address in brackets (``[::1]:8001``), every interface for ''."""
    return f"{_bracketed(host or '::')}:{port}"


def _bind_error(what: str, host: str, port: int, flag: str, e: OSError) -> ServeError:
    if e.errno == errno.EADDRINUSE or "in use" in str(e).lower():
        return ServeError(f"{what} port {port} on {host} is already in use: stop the other server or pick another port with {flag}")
    return ServeError(f"cannot listen for {what} on {host}:{port}: {e} (check --host)")

