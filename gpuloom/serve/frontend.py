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

Frame on the socket, both ways: ``!IQ`` (JSON length, payload length), the JSON, then the payload
(the tensors' raw little-endian bytes, back to back, in the order the JSON lists them). A worker's
first frame is a hello carrying its shared-memory arena (``gpuloom.serve.arena``) as a descriptor;
a request whose tensors it wrote there says ``"arena": offset`` and has an empty payload. With
rings (``gpuloom.serve.ring``, the default where supported) the hello also carries the rings'
block and an eventfd; the runtime answers it with a frame saying whether it mapped them, and from
then on requests and successful replies travel through the rings as compact records (below), error
replies as frames, and the socket takes only what does not fit.

Compact ring records: ``RING_MAGIC`` where a frame's JSON length would be, a small struct with what
changes from request to request (id, arena offset, deadline; id, service time), then JSON that
repeats (model, tensors' names, types and shapes), which each side parses once per distinct text
(``_Templates``). On the build VM, in four interleaved pairs of runs against the code before, the
runtime thread's intake went from 121-171 to 122-137 us per HTTP request and its replies from 98-145
to 84-97 (twenty-fifth session, ``serve_e2e.py --loop-cpu``).

    python -m gpuloom.serve.frontend --socket PATH --host H --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ..runtime.gcpause import RareFullCollections, freeze_loaded
from .client_timeout import DEFAULT_CLIENT_TIMEOUT_S, ClientTimeouts
from .protocol import ProtocolError, numpy_dtype, v2_dtype

log = logging.getLogger(__name__)

FRAME = struct.Struct("!IQ")
RING_MAGIC = b"\xff\xff\xff\xff"  # no frame's JSON is 4 GiB long: a compact ring record follows
RING_REQ = struct.Struct("<4sIQQdd")  # magic, JSON bytes, request id, arena offset, deadline ms (NaN: none),
#                                      ms the request had been in the worker (from its handler) when passed on
RING_OK = struct.Struct("<4sIQQd")  # magic, JSON bytes, payload bytes, request id, service ms
_TEMPLATES_MAX = 1024  # distinct JSON texts a side remembers (then it starts over)
_TEMPLATE_BYTES_MAX = 4096  # longer texts (client-chosen names can be long) are parsed each time, not kept
_READ_BUF = 1 << 16  # bytes the bridge's reader asks the socket for per call
_JOIN_MAX = 1 << 16  # reply parts smaller than this are joined into one send; bigger go as they are
DRAIN_ON = ("loop", "thread")  # InferBridge(drain_on=...)
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
_SAFETY_S = 0.02  # how often a drain thread looks at a ring the runtime's loop drains
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes, C order, little-endian, as a byte view (a copy only where they are not)."""
    if not (a.flags.c_contiguous and a.dtype.byteorder != ">"):
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return memoryview(a).cast("B")


def _describe(names: list[str], arrays: list[np.ndarray]) -> tuple[list[dict], list[memoryview]]:
    """The tensors' JSON descriptions (name, datatype, shape, nbytes) and their bytes."""
    bufs = [_raw(a) for a in arrays]
    return [{"name": n, "datatype": _v2_name(a.dtype), "shape": list(a.shape), "nbytes": b.nbytes}
            for n, a, b in zip(names, arrays, bufs)], bufs


def _copy_into(into: memoryview, bufs: list[memoryview]) -> None:
    off = 0
    for b in bufs:
        into[off:off + b.nbytes] = b
        off += b.nbytes


def pack(meta: dict, arrays: list[np.ndarray], into: memoryview | None = None) -> list[Any]:
    """A frame as a list of buffers (header, JSON, each tensor's bytes) for ``writelines``/``sendall``.

    ``into``: a block of the shared arena (``meta["arena"]`` says where) that takes the tensors'
    bytes instead; the frame then has an empty payload."""
    tensors, bufs = _describe(meta.pop("names"), arrays)
    js = json.dumps(dict(meta, tensors=tensors)).encode()
    if into is not None:
        _copy_into(into, bufs)
        return [FRAME.pack(len(js), 0), js]
    return [FRAME.pack(len(js), sum(b.nbytes for b in bufs)), js, *bufs]


class _Templates:
    """JSON texts that repeat across records, parsed once each: ``get(text)`` is ``make(json.loads(
    text))``, remembered (up to ``_TEMPLATES_MAX`` texts of at most ``_TEMPLATE_BYTES_MAX`` bytes,
    then forgotten all at once: a few MiB at most, whatever clients send). What ``make`` raises is
    raised again, and nothing is remembered. Any thread may call it (dict get and set)."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make, self._known = make, {}

    def get(self, text: bytes) -> Any:
        made = self._known.get(text)
        if made is None:
            made = self._make(json.loads(text))
            if len(text) <= _TEMPLATE_BYTES_MAX:
                if len(self._known) >= _TEMPLATES_MAX:
                    self._known = {}
                self._known[text] = made
        return made


class _Layout:
    """Where a record's tensors lie in its payload, from their JSON descriptions (``tensors``: name,
    datatype, shape, nbytes), checked: per tensor its name, little-endian dtype, shape and byte span,
    back to back; ``nbytes`` in all."""

    __slots__ = ("spans", "nbytes")

    def __init__(self, tensors: Any) -> None:
        if not isinstance(tensors, list):
            raise ValueError(f"a frame's tensors must be a list of descriptions, got {type(tensors).__name__}")
        spans, off = [], 0
        for t in tensors:
            n, shape, name = t["nbytes"], t["shape"], t["name"]
            if not (_is_int(n) and n >= 0 and isinstance(shape, list) and all(_is_int(d) for d in shape)
                    and isinstance(name, str)):
                raise ValueError(f"a tensor of a frame needs a name, integer nbytes and an integer shape; got {t!r}")
            spans.append((name, numpy_dtype(t["datatype"]).newbyteorder("<"), tuple(shape), off, off + n))
            off += n
        self.spans, self.nbytes = tuple(spans), off

    def arrays(self, payload: memoryview) -> dict[str, np.ndarray]:
        """The tensors as arrays viewing ``payload`` (no copy); ValueError where a shape and its bytes disagree."""
        return {name: np.frombuffer(payload[a:b], dtype=dt).reshape(shape) for name, dt, shape, a, b in self.spans}


class _RequestTemplate:
    """What a compact request's JSON says, checked once: the model, the outputs asked for, and where
    its inputs lie in the request's arena block. ``checked_for``: the model config its inputs last
    matched exactly (``ServeCore.submit``); every request of this text has the same names, dtypes and
    shapes, so while the model keeps that config they are not checked again."""

    __slots__ = ("model", "version", "outputs", "layout", "checked_for")

    def __init__(self, js: Any) -> None:
        if not isinstance(js, dict) or not isinstance(js.get("model"), str) or not isinstance(js.get("tensors"), list):
            raise ValueError("a compact ring request's JSON must be an object with a model name and its tensors")
        self.model, self.version, self.outputs = js["model"], js.get("version"), js.get("outputs")
        self.layout = _Layout(js["tensors"])
        self.checked_for = None


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float


def ring_request(rid: int, meta: dict, tensors: list[dict], arena_offset: int, deadline_ms: float | None,
                 waited_ms: float = 0.0) -> list[Any]:
    """A worker's compact request record (its tensors already in the arena at ``arena_offset``)."""
    js = json.dumps({"model": meta["model"], "version": meta.get("version"), "outputs": meta.get("outputs"),
                     "tensors": tensors}).encode()
    return [RING_REQ.pack(RING_MAGIC, len(js), rid, arena_offset,
                          math.nan if deadline_ms is None else float(deadline_ms), float(waited_ms)), js]


def _reply_key(names: list[str], arrays: list[np.ndarray]) -> tuple:
    return tuple((n, a.dtype.str, a.shape) for n, a in zip(names, arrays))


class _ReplyEncoder:
    """Successful replies as compact records: the outputs' JSON description is made once per set of
    names, dtypes and shapes (a model's batch of n rows always gives the same)."""

    def __init__(self) -> None:
        self._known: dict[tuple, bytes] = {}

    def record(self, rid: int, names: list[str], arrays: list[np.ndarray], service_ms: float) -> list[Any]:
        key = _reply_key(names, arrays)
        js = self._known.get(key)
        if js is None:
            tensors, bufs = _describe(names, arrays)
            js = json.dumps({"status": 200, "names": names, "tensors": tensors}).encode()
            if len(self._known) >= _TEMPLATES_MAX:
                self._known = {}
            self._known[key] = js
        else:
            bufs = [_raw(a) for a in arrays]
        return [RING_OK.pack(RING_MAGIC, len(js), sum(b.nbytes for b in bufs), rid, service_ms), js, *bufs]


def read_ring_reply(record: memoryview, templates: "_Templates") -> tuple[dict, memoryview]:
    """A reply from the reply ring as ``(meta, payload)``, whether a compact record or a frame; the
    payload is copied out, since the ring reuses its bytes. ``templates``: ``_Templates(dict)``."""
    if record[:4] == RING_MAGIC:
        _, jlen, plen, rid, service_ms = RING_OK.unpack_from(record)
        start = RING_OK.size
        meta = dict(templates.get(bytes(record[start:start + jlen])), id=rid, service_ms=service_ms)
        return meta, memoryview(bytes(record[start + jlen:start + jlen + plen]))
    jlen, plen = FRAME.unpack_from(record)
    meta = json.loads(bytes(record[FRAME.size:FRAME.size + jlen]))
    return meta, memoryview(bytes(record[FRAME.size + jlen:FRAME.size + jlen + plen]))


_V2_NAMES: dict[str, str] = {}  # numpy dtype name -> v2 name, as found


def _v2_name(dtype: np.dtype) -> str:
    """``v2_dtype(dtype.name)``, remembered: ``np.dtype(name)`` from a string takes ~3.5 us, per
    tensor of every frame (replies are packed on the runtime's thread)."""
    name = _V2_NAMES.get(dtype.name)
    if name is None:
        name = _V2_NAMES[dtype.name] = v2_dtype(dtype.name)  # ValueError for no v2 name: not remembered
    return name


def payload_bytes(meta: dict) -> int:
    return _Layout(meta["tensors"]).nbytes


def unpack_tensors(meta: dict, payload: memoryview) -> dict[str, np.ndarray]:
    """The frame's tensors as arrays viewing ``payload`` (no copy)."""
    return _Layout(meta["tensors"]).arrays(payload)


# -- the runtime's process ----------------------------------------------------------------------
class InferBridge:
    """Runtime-process end: a Unix socket where workers send parsed infer requests.

    A worker with shared rings (``gpuloom.serve.ring``: the default) writes each request into its
    request ring and posts the runtime loop's semaphore. The loop's thread takes every queued request
    each time it wakes (``InferenceService.add_intake``) and submits it through ``core``; a drain
    thread per worker takes what the loop leaves waiting (no loop runs), or is the ring's consumer
    with ``drain_on="thread"``. The future's callback (on the runtime's thread) books the outcome and
    writes the reply into the reply ring, waking the worker through an eventfd: no thread hand-off.
    What does not fit in a ring goes over the socket: one thread per worker connection reads frames
    there (``recv_into`` releases the GIL), and a writer thread sends replies, so socket writes,
    which block while the worker is slow to read, never hold up the runtime.
    """

    def __init__(self, core: Any, path: str, *, drain_on: str = "loop") -> None:
        """``drain_on``: who takes requests from the workers' rings: the runtime's ``"loop"`` thread
        (``InferenceService.add_intake``; a drain thread per worker where the service has no such
        loop) or a drain ``"thread"`` per worker."""
        if drain_on not in DRAIN_ON:
            raise ValueError(f"drain_on must be one of {DRAIN_ON}, got {drain_on!r}")
        self.core, self.path, self.drain_on = core, path, drain_on
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []  # one per worker connection
        self._closed = False
        self.arena_requests = 0  # requests whose tensors came through a worker's shared memory
        self.inline_requests = 0  # ... and over the socket
        self.ring_requests = 0  # requests taken from a worker's request ring (their tensors in its arena)
        self.loop_requests = 0  # ... of which the runtime's loop took (the rest: drain threads)
        self.ring_replies = 0  # replies written into a worker's reply ring (the rest went over the socket)
        self.pinned_arenas = 0  # worker arenas page-locked now (launched from in place)
        self._request_templates = _Templates(_RequestTemplate)  # compact ring requests' JSON, checked once
        self._intake = _LoopIntake(self)  # the runtime loop's one poller over every worker's request ring
        threading.Thread(target=self._accept, name="gpuloom-bridge-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="gpuloom-bridge", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        out: queue.SimpleQueue = queue.SimpleQueue()  # reply frames for the socket; None stops the writer
        pinned = rings = drain = take = None
        on_loop = False  # the runtime's loop takes this worker's requests (self._intake)
        in_arena = _Outstanding()  # requests whose rows the device may still read from the arena
        writer = threading.Thread(target=self._write, args=(conn, out), name="gpuloom-bridge-write", daemon=True)
        writer.start()
        try:
            hello = _recv_hello(conn)
            if hello is False:
                return
            shared, rings, offered = hello  # the worker's arena (a memoryview) or None; its rings or None
            send = out.put if rings is None else (lambda frame: self._reply(rings, out, frame))
            ok = self._ok_socket(out) if rings is None else self._ok_ring(rings, out)
            if rings is None and shared is not None:  # before any request is read
                pinned = self._pin(shared)
            wake_fd = None
            if rings is not None:
                take = self._ring_taker(rings, send, ok, shared, in_arena)
                service = getattr(self.core, "service", None)
                if self.drain_on == "loop" and getattr(service, "add_intake", None) is not None:
                    wake_fd = self._intake.attach(rings.requests, take, service)
                    on_loop = wake_fd is not None  # None: this service's loop cannot be woken from the worker
                drain = threading.Thread(target=self._drain, args=(rings, take, on_loop),
                                         name="gpuloom-bridge-ring", daemon=True)
                drain.start()
            if offered:  # the worker waits for this before it writes into its rings
                _send_ack(conn, rings is not None, wake_fd)
            if rings is not None and shared is not None:
                # after the ack: page-locking waits while a model loads (the device is exclusive),
                # longer than a worker should wait to start; requests taken meanwhile are copied
                pinned = self._pin(shared)
            frames = _FrameReader(conn)
            while True:
                frame = frames.next()
                if frame is None:  # the worker went away (between frames or mid-frame)
                    return
                js, payload = frame
                self._take(send, ok, json.loads(js), payload, shared, in_arena)
        except OSError:
            return
        finally:
            if on_loop:
                self._intake.detach(take, self.core.service)
            if take is not None:
                take.close()  # waits for a take under way (on the loop's thread, say): then no more
            if rings is not None:
                rings.close()  # no more replies into the ring; the drain thread ends
                if drain is not None:
                    drain.join(5.0)
            out.put(None)  # the writer sends what is queued, then closes the connection
            if pinned is not None:
                self._unpin(pinned, in_arena)

    def _take(self, send: Callable[[list], None], ok: Callable[..., None], meta: dict, payload: memoryview,
              shared: memoryview | None, in_arena: "_Outstanding") -> None:
        """Submit one request frame: its tensors inline in ``payload``, or in the arena."""
        rid, off = meta["id"], meta.get("arena")
        try:
            layout = _Layout(meta.get("tensors"))
            if off is None:
                self.inline_requests += 1
                in_arena = None
            else:
                self.arena_requests += 1
                n = layout.nbytes
                if shared is None or not (isinstance(off, int) and 0 <= off and off + n <= len(shared)):
                    raise ValueError(f"bad arena block {off!r} (+{n} bytes)")
                payload = shared[off:off + n]  # the tensors in place: no copy here
            inputs = layout.arrays(payload)
        except Exception as e:  # noqa: BLE001 - a malformed frame: answered, never a dead worker
            send(_failure_frame(rid, e))
            return
        waited = meta.get("waited_ms", 0.0)
        self._submit(send, ok, rid, meta["model"], meta.get("version"), meta.get("outputs"), meta.get("deadline_ms"),
                     inputs, in_arena, waited if isinstance(waited, (int, float)) else 0.0)

    def _take_compact(self, send: Callable[[list], None], ok: Callable[..., None], record: memoryview,
                      shared: memoryview | None, in_arena: "_Outstanding") -> None:
        """Submit one compact ring request (``RING_REQ``): its JSON parsed and checked once per text."""
        try:
            _, jlen, rid, off, deadline, waited = RING_REQ.unpack_from(record)
        except struct.error:  # no id to answer: the worker's request times out
            log.error("a truncated compact record (%d bytes) in a worker's request ring", len(record))
            return
        self.ring_requests += 1
        try:
            t = self._request_templates.get(bytes(record[RING_REQ.size:RING_REQ.size + jlen]))
            self.arena_requests += 1
            n = t.layout.nbytes
            if shared is None or off + n > len(shared):
                raise ValueError(f"bad arena block {off!r} (+{n} bytes)")
            inputs = t.layout.arrays(shared[off:off + n])
        except Exception as e:  # noqa: BLE001 - answered, and the drain goes on
            send(_failure_frame(rid, e))
            return
        self._submit(send, ok, rid, t.model, t.version, t.outputs, None if math.isnan(deadline) else deadline,
                     inputs, in_arena, waited, t)

    def _ring_taker(self, rings: Any, send: Callable[[list], None], ok: Callable[..., None],
                    shared: memoryview | None, in_arena: "_Outstanding") -> "_RingTaker":
        """What submits the requests queued in a worker's request ring (see :class:`_RingTaker`)."""

        def one(record: memoryview) -> None:
            if record[:4] == RING_MAGIC:  # what workers write
                self._take_compact(send, ok, record, shared, in_arena)
                return
            try:  # a frame (the tests write some)
                jlen, plen = FRAME.unpack_from(record)
                meta = json.loads(bytes(record[FRAME.size:FRAME.size + jlen]))
                if not isinstance(meta, dict):
                    raise ValueError(f"a request frame's JSON must be an object, got {type(meta).__name__}")
            except Exception:  # noqa: BLE001 - no id to answer: the worker's request times out
                log.exception("a malformed frame in a worker's request ring")
                return
            self.ring_requests += 1
            try:
                if plen:
                    raise ValueError("a request in the ring must carry its tensors in the arena")
                self._take(send, ok, meta, memoryview(b""), shared, in_arena)
            except Exception as e:  # noqa: BLE001 - answered, and the drain goes on
                send(_internal_error_frame(meta.get("id"), e))

        return _RingTaker(rings, one)

    @staticmethod
    def _drain(rings: Any, take: "_RingTaker", loop_drains: bool) -> None:
        """A worker's request ring, from a thread of its own, until the connection closes: woken
        through the ring's semaphore when this thread is the ring's consumer, or every ``_SAFETY_S``
        when the runtime's loop drains it. A request is then taken here only when it was already
        waiting at the last look: the loop is not running (no model loaded, a shutdown) or has
        stalled that long."""
        waiting_at = None  # where the ring's oldest request stood at the last look (loop_drains)
        while rings.open:
            rings.wake.wait(_SAFETY_S if loop_drains else 0.5)
            try:
                if not loop_drains:
                    take(True)
                    continue
                head = rings.requests.head
                if head == waiting_at and rings.requests.pending():  # untaken since the last look
                    take(False)
                waiting_at = head if rings.requests.pending() else None
            except Exception:  # noqa: BLE001 - the thread must go on, or the ring's requests wait forever
                log.exception("taking requests from a worker's ring failed")

    def _reply(self, rings: Any, out: queue.SimpleQueue, frame: list) -> None:
        """Into the worker's reply ring; over the socket when it does not fit there."""
        if rings.reply(frame):
            self.ring_replies += 1
        else:
            out.put(frame)

    @staticmethod
    def _ok_frame(rid: int, names: list[str], arrays: list[np.ndarray], service_ms: float) -> list[Any]:
        return pack({"id": rid, "status": 200, "names": names, "service_ms": service_ms}, arrays)

    def _ok_socket(self, out: queue.SimpleQueue) -> Callable[..., None]:
        """How a successful reply goes back over the socket: a frame."""
        def ok(rid: int, names: list[str], arrays: list[np.ndarray], service_ms: float) -> None:
            out.put(self._ok_frame(rid, names, arrays, service_ms))

        return ok

    def _ok_ring(self, rings: Any, out: queue.SimpleQueue) -> Callable[..., None]:
        """How a successful reply goes back through the reply ring: a compact record (a frame over the
        socket when it does not fit)."""
        encoder = _ReplyEncoder()

        def ok(rid: int, names: list[str], arrays: list[np.ndarray], service_ms: float) -> None:
            if rings.reply(encoder.record(rid, names, arrays, service_ms)):
                self.ring_replies += 1
            else:
                out.put(self._ok_frame(rid, names, arrays, service_ms))

        return ok

    def _pin(self, shared: memoryview) -> int | None:
        """Page-lock the worker's arena where the device can (CUDA): its requests' rows are then
        launched from the arena itself, with no staging copy on this thread (``service.submit``).
        Returns the arena's address, or None."""
        device = getattr(self.core.service, "device", None)
        if device is None or not getattr(device, "stages", False):  # nothing to save: rows are not staged
            return None
        addr = np.frombuffer(shared, np.uint8).__array_interface__["data"][0]
        try:
            ok = device.register_host(addr, len(shared))
        except Exception:  # noqa: BLE001 - the arena still works, with copies
            log.exception("page-locking a worker's arena failed")
            ok = False
        if ok:
            self.pinned_arenas += 1
        return addr if ok else None

    def _unpin(self, addr: int, in_arena: "_Outstanding") -> None:
        """Unlock an arena once the device can no longer read a request's rows from it."""
        if not in_arena.wait_none(timeout_s=60):
            log.error("requests from a closed worker's arena still unanswered after 60 s; unlocking it anyway")
        self.core.service.device.unregister_host(addr)
        self.pinned_arenas -= 1

    @staticmethod
    def _write(conn: socket.socket, out: queue.SimpleQueue) -> None:
        """Send the queued reply frames: every frame already queued goes out with this one, their small
        parts joined into one ``sendall`` (one GIL release, not one per part and frame); parts of
        ``_JOIN_MAX`` bytes or more are sent as they are (no copy)."""
        try:
            stop = False
            while not stop:
                frame = out.get()
                parts: list[Any] = []
                size = 0
                while True:
                    if frame is None:  # the reader is done: send what is gathered, then close
                        stop = True
                        break
                    for b in frame:  # bytes, or memoryviews cast to "B": len() is the byte count
                        if len(b) >= _JOIN_MAX:
                            if parts:
                                conn.sendall(b"".join(parts))
                                parts, size = [], 0
                            conn.sendall(b)
                        else:
                            parts.append(b)
                            size += len(b)
                    if size >= _JOIN_MAX or out.empty():  # this thread alone takes from ``out``
                        break
                    frame = out.get_nowait()
                if parts:
                    conn.sendall(b"".join(parts))
        except OSError:  # the worker is gone; its client's connection went with it
            pass
        finally:
            conn.close()

    def _submit(self, send: Callable[[list], None], ok: Callable[..., None], rid: int, name: str,
                version: str | None, outputs: Any, deadline_ms: float | None, inputs: dict[str, np.ndarray],
                in_arena: "_Outstanding | None" = None, waited_ms: float = 0.0,
                template: "_RequestTemplate | None" = None) -> None:
        """Submit one request's checked ``inputs``; its answer goes back through ``ok`` (served) or as
        a frame through ``send`` (an error), from the thread that answers the future. ``waited_ms``: how
        long the worker had held it (its deadline counts from the worker's handler). ``template``: the
        compact record's, which remembers the config its inputs matched exactly."""
        t0 = time.perf_counter()
        try:
            first = next(iter(inputs.values()), None)  # rows for the books; a scalar is refused by submit
            rows = first.shape[0] if first is not None and first.ndim else 0  # (never fails after submit)
            self.core.check_outputs(name, version, outputs)
            checked = template.checked_for if template is not None else None
            fut, checked = self.core.submit(name, version, inputs, deadline_ms, waited_ms, checked_for=checked)
            if template is not None:
                template.checked_for = checked
        except Exception as e:  # noqa: BLE001 - a malformed frame: answered, never a dead worker
            send(_failure_frame(rid, e))
            return

        def done(f: Any) -> None:
            if in_arena is not None:  # the device has read the request's rows from the arena
                in_arena.remove()
            try:
                outs = self.core.outcome(name, f, t0, rows)
                names = list(outs)
                ok(rid, names, [np.asarray(outs[k]) for k in names], (time.perf_counter() - t0) * 1e3)
            except Exception as e:  # noqa: BLE001 - e.g. outputs that cannot be framed: still answered
                send(_failure_frame(rid, e))

        if in_arena is not None:
            in_arena.add()
        fut.add_done_callback(done)

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *self._conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        deadline = time.monotonic() + 10.0  # let each connection unlock its arena (bounded)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _send_ack(conn: socket.socket, ring_ok: bool, wake_fd: int | None) -> None:
    """Answer a hello that offered rings: whether they are mapped, and (with ``wake_fd``: then closed
    here) the runtime loop's semaphore the worker posts per request instead of its ring's own."""
    js = json.dumps({"hello": 1, "ring": ring_ok, "wake": "loop" if wake_fd is not None else "ring",
                     "tensors": []}).encode()
    try:
        socket.send_fds(conn, [FRAME.pack(len(js), 0) + js], [wake_fd] if wake_fd is not None else [])
    finally:
        if wake_fd is not None:
            os.close(wake_fd)


class _LoopIntake:
    """The runtime loop's one poller (``InferenceService.add_intake``) over every worker's request
    ring: at each wake it reads each ring's two index cells and calls into a ring only when a request
    waits there. One poller per ring cost a Python call chain per ring per wake, most of them for
    nothing: with 8 workers on the H200 the loop polled 33,250 times a second for 3,378 requests
    (run 84). Rings come and go with their workers' connections; the poller is registered while any
    is attached. What a take raises is logged: the loop must go on."""

    def __init__(self, bridge: "InferBridge") -> None:
        self._bridge = bridge
        self._rings: tuple[tuple[Any, Any, "_RingTaker"], ...] = ()  # (head cell, tail cell, take); replaced whole
        self._lock = threading.Lock()  # attach / detach, and the poller's registration with them
        self._poll = self.poll  # one bound method: the loop removes a poller by identity

    def attach(self, ring: Any, take: "_RingTaker", service: Any) -> int | None:
        """Poll ``ring`` (a worker's request ring) from the loop of ``service``, through ``take``.
        Returns the descriptor of the loop's semaphore for the worker (the caller passes it on and
        closes it), or None when that loop cannot be woken from another process: not attached."""
        head, tail = ring.cells()
        with self._lock:
            fd = service.add_intake(self._poll)  # registered once; each call hands out a descriptor
            if fd is not None:
                self._rings = (*self._rings, (head, tail, take))
            return fd

    def detach(self, take: "_RingTaker", service: Any) -> None:
        with self._lock:
            self._rings = tuple(r for r in self._rings if r[2] is not take)
            if not self._rings:
                service.remove_intake(self._poll)

    def poll(self) -> float:
        taken = 0
        for head, tail, take in self._rings:
            if head.value != tail.value:  # RequestRing.pending(), without a call per ring
                try:
                    taken += take(True)
                except Exception:  # noqa: BLE001
                    log.exception("taking requests from a worker's ring on the runtime's loop failed")
        if taken:
            self._bridge.loop_requests += taken
        return math.inf


class _RingTaker:
    """``take(wait)``: hand every request published in a worker's request ring to ``one``; returns
    how many. The runtime's loop and the drain thread may both call it: a lock keeps one at a time
    (``wait=False``: return at once while the other holds it, as it takes what is there).
    :meth:`close` waits for a take under way and refuses later ones, so once it returns no request
    of this worker can be submitted (its arena may then be unlocked)."""

    def __init__(self, rings: Any, one: Callable[[memoryview], None]) -> None:
        self._rings, self._one = rings, one
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, wait: bool) -> int:
        if not self._rings.requests.pending() or not self._lock.acquire(blocking=wait):
            return 0
        try:
            return 0 if self._closed else self._rings.requests.take(self._one)
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True


class _Outstanding:
    """A count of requests in flight, and a wait for it to reach zero."""

    def __init__(self) -> None:
        self._n = 0
        self._cv = threading.Condition()

    def add(self) -> None:
        with self._cv:
            self._n += 1

    def remove(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n == 0:
                self._cv.notify_all()

    def wait_none(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._n == 0, timeout=timeout_s)


def _error_frame(rid: int, e: ProtocolError) -> list[Any]:
    return pack({"id": rid, "status": e.status, "error": str(e), "retry_after_s": e.retry_after_s, "names": []}, [])


def _internal_error_frame(rid: int, e: Exception) -> list[Any]:
    """A 500 for what the bridge did not expect: the worker's client is still answered."""
    return _error_frame(rid, ProtocolError(f"internal error: {type(e).__name__}: {e}", 500))


def _failure_frame(rid: int, e: Exception) -> list[Any]:
    """The answer to a request that failed with ``e``: its own status for a ProtocolError, else a 500."""
    return _error_frame(rid, e) if isinstance(e, ProtocolError) else _internal_error_frame(rid, e)


def _recv_control(conn: socket.socket, max_fds: int) -> tuple[dict | None, list[int]]:
    """A control frame (a worker's hello, the runtime's answer to it): its JSON object and the
    descriptors that came with it. None for the object when the connection closed first or the frame
    is not one (it has a payload, or its JSON is no object); the caller owns the descriptors either way."""
    data, fds, _, _ = socket.recv_fds(conn, FRAME.size, max_fds)
    if not data:
        return None, fds
    if len(data) < FRAME.size:
        rest = _recv_exact(conn, FRAME.size - len(data))
        if rest is None:
            return None, fds
        data += bytes(rest)
    jlen, plen = FRAME.unpack(data)
    js = _recv_exact(conn, jlen)
    if js is None or plen:
        return None, fds
    obj = json.loads(bytes(js))
    return (obj if isinstance(obj, dict) else None), fds


def _recv_hello(conn: socket.socket) -> tuple[memoryview | None, Any, bool] | bool:
    """A worker's first frame: its arena (mapped here, as a memoryview, or None), its rings
    (``ring.RuntimeRings``, or None), and whether it offered rings; False when the connection closed
    or the frame is not a hello. Descriptors: the arena's, then the rings' block and eventfd."""
    from . import arena, ring

    hello, fds = _recv_control(conn, 3)
    try:
        if hello is None:
            return False
        size, ring_size = int(hello.get("arena_bytes", 0)), int(hello.get("ring_bytes", 0))
        if "hello" not in hello or len(fds) != bool(size) + 2 * bool(ring_size):
            return False
        shared = rings = None
        if size:
            fd, fds = fds[0], fds[1:]
            shared = memoryview(arena.attach(fd, size))
        if ring_size:
            (fd, efd), fds = fds, []
            if ring.supported():
                try:
                    rings = ring.RuntimeRings(fd, efd, ring_size)  # closes both descriptors, even when it fails
                except (OSError, ValueError):
                    log.exception("a worker's rings could not be mapped; its requests go over the socket")
            else:
                os.close(fd)
                os.close(efd)
        return shared, rings, bool(ring_size)
    finally:
        for fd in fds:
            os.close(fd)


class _FrameReader:
    """Frames off a worker's connection through one buffer: each ``recv_into`` asks for up to
    ``_READ_BUF`` bytes, so a frame usually takes one call (not one each for its header, JSON and
    payload) and frames already queued on the socket are parsed with no further call."""

    def __init__(self, conn: socket.socket, size: int = _READ_BUF) -> None:
        self.conn = conn
        self.buf = bytearray(size)
        self.start = self.end = 0  # the unread bytes are buf[start:end]

    def _fill(self, need: int) -> bool:
        """At least ``need`` unread bytes in the buffer (moved to its front, or into a bigger one,
        when they would not fit after ``start``); False when the connection closes first."""
        if self.end - self.start >= need:
            return True
        if self.start + need > len(self.buf):
            rest = self.buf[self.start:self.end]
            if need > len(self.buf):  # a frame head (header and JSON) bigger than the buffer
                self.buf = bytearray(need)
            self.buf[:len(rest)] = rest
            self.start, self.end = 0, len(rest)
        view = memoryview(self.buf)
        while self.end - self.start < need:
            k = self.conn.recv_into(view[self.end:])
            if k == 0:
                return False
            self.end += k
        return True

    def next(self) -> tuple[bytearray, memoryview] | None:
        """The next frame's JSON (bytes to decode) and payload (its own memory: the request's
        arrays view it while the runtime works), or None when the connection closed, even mid-frame."""
        if self.start == self.end:
            self.start = self.end = 0
        if not self._fill(FRAME.size):
            return None
        jlen, plen = FRAME.unpack_from(self.buf, self.start)
        if not self._fill(FRAME.size + jlen):
            return None
        a = self.start + FRAME.size
        js = self.buf[a:a + jlen]
        self.start = a + jlen
        if not plen:
            return js, memoryview(b"")
        payload = bytearray(plen)
        have = min(plen, self.end - self.start)
        payload[:have] = memoryview(self.buf)[self.start:self.start + have]
        self.start += have
        if have < plen and not _recv_into(self.conn, memoryview(payload)[have:]):
            return None  # the rest goes straight into the payload's memory: no copy through the buffer
        return js, memoryview(payload)


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when the connection closes first."""
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def _recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    return buf if _recv_into(conn, memoryview(buf)) else None


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (without listening) ``host:port`` with SO_REUSEPORT so the workers can share it; port 0
    picks a free one. Raises OSError when another program holds the port: a first bind without
    SO_REUSEPORT fails when anything listens there, even another gpuloom's workers (which a
    SO_REUSEPORT bind alone would silently join)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


# -- a worker process ---------------------------------------------------------------------------
def build_worker_app(sock_path: str, upstream: str, max_body_bytes: int, arena_bytes: int = 0, ring_bytes: int = 0):
    """The worker's aiohttp app: infer over the bridge, everything else forwarded to ``upstream``.
    ``arena_bytes``: size of the shared memory the tensors go through (0: inline on the socket).
    ``ring_bytes``: size of the shared rings request and reply frames go through (``ring.py``; only
    with an arena; 0: over the socket)."""
    import aiohttp
    from aiohttp import web

    from . import arena as arena_mod
    from . import ring as ring_mod
    from .http_server import CORE_KEY, DEADLINE_HEADER, HEADER_LEN, _error, _errors, infer_response
    from .protocol import deadline_ms_from_parameters, parse_infer_body

    state: dict[str, Any] = {"pending": {}, "next": 0, "blocks": {}, "arena": None, "rings": None, "up": True}

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
        state["session"] = aiohttp.ClientSession(auto_decompress=False)
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

    async def infer(request: web.Request):
        t_in = time.perf_counter()  # headers read; the body may still be arriving
        name, version = request.match_info["model"], request.match_info.get("version")
        body = await request.read()
        try:
            req = parse_infer_body(body, request.headers.get(HEADER_LEN))
        except ProtocolError:
            await _unknown_model_first(name, version)
            raise
        deadline = deadline_ms_from_parameters(req.parameters, request.headers.get(DEADLINE_HEADER))
        if not state["up"]:
            raise ProtocolError("the runtime process is not reachable (its connection closed)", 503, retry_after_s=1.0)
        state["next"] += 1
        rid = state["next"]
        fut = asyncio.get_running_loop().create_future()
        state["pending"][rid] = fut
        # the deadline (given, or the model's SLO) counts from this handler, not from the runtime's
        # intake: a worker that falls behind hands on requests with less time left (run 81: 55 ms at p50)
        waited = (time.perf_counter() - t_in) * 1e3
        meta = {"id": rid, "model": name, "version": version, "deadline_ms": deadline, "waited_ms": waited,
                "outputs": list(req.outputs) if req.outputs is not None else None}
        arrays = list(req.inputs.values())
        nbytes = sum(a.nbytes for a in arrays)
        shared, rings = state["arena"], state["rings"]
        block = shared.alloc(nbytes) if shared is not None else None
        if block is None:  # no arena, or full: inline on the socket
            frame = pack(dict(meta, names=list(req.inputs)), arrays)
        else:
            state["blocks"][rid] = block  # freed when the reply comes back (deliver)
            tensors, bufs = _describe(list(req.inputs), arrays)
            _copy_into(shared.view(block, nbytes), bufs)
            frame = None
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
            return _error(meta["error"], meta["status"], meta.get("retry_after_s"))
        outputs = unpack_tensors(meta, payload)
        t_out = time.perf_counter()
        timing = {"service": float(meta.get("service_ms", 0.0)), "bridge": (t_out - t_bridge) * 1e3,
                  "worker": (t_out - t_in) * 1e3}
        return infer_response(name, outputs, req, timing)

    async def forward(request: web.Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read()
        async with state["session"].request(request.method, upstream + request.path_qs, headers=headers,
                                            data=data) as r:
            body = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
            return web.Response(status=r.status, body=body, headers=out)

    app = web.Application(middlewares=[_errors], client_max_size=max_body_bytes)
    app[CORE_KEY] = _Limits(max_body_bytes)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
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
        app = build_worker_app(args.socket, args.upstream, args.max_body, args.arena_mb << 20, args.ring_kb << 10)
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
        await runner.cleanup()  # stops accepting; in-flight requests finish within the drain timeout

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
