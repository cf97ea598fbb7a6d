"""The runtime process's end of the HTTP front-end workers (``--http-workers``, ``frontend.py``):
:class:`InferBridge`, the Unix socket and rings the workers' parsed requests arrive through, and
:func:`reserve_port`, the public port they share. What travels is in ``wire.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from .protocol import ProtocolError
from .ring import WAKEUPS, batch_replies, each_reply
from .wire import (FRAME, RING_MAGIC, RING_REQ, _failure_frame, _internal_error_frame, _Layout, _recv_control,
                   _recv_into, _ReplyEncoder, _RequestTemplate, _Templates, pack)

log = logging.getLogger(__name__)

_READ_BUF = 1 << 16  # bytes the bridge's reader asks the socket for per call
_JOIN_MAX = 1 << 16  # reply parts smaller than this are joined into one send; bigger go as they are
DRAIN_ON = ("loop", "thread")  # InferBridge(drain_on=...)
_SAFETY_S = 0.02  # how often a drain thread looks at a ring the runtime's loop drains
WORKER_EXITED = "worker_exited"  # the drop reason of a request served after its worker's connection closed
INTAKE_WINDOW_MAX_MS = 10.0  # InferBridge(intake_window_ms=...): longer would eat the tightest SLOs


def check_intake_window(ms: float) -> float:
    """``ms`` unchanged, or ValueError unless it is a number in [0, ``INTAKE_WINDOW_MAX_MS``]."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0.0 <= ms <= INTAKE_WINDOW_MAX_MS:
        raise ValueError(f"the intake window must be a number of ms in [0, {INTAKE_WINDOW_MAX_MS:g}] (0: off), "
                         f"got {ms!r}")
    return ms


class InferBridge:
    """Runtime-process end: a Unix socket where workers send parsed infer requests.

    A worker with shared rings (``gpuloom.serve.ring``: the default) writes each request into its
    request ring and posts the runtime loop's semaphore. The loop's thread takes every queued request
    each time it wakes (``InferenceService.add_intake``) and submits it through ``core``; a drain
    thread per worker takes what the loop leaves waiting (no loop runs), or is the ring's consumer
    with ``drain_on="thread"``. The service's ``on_done`` (on the runtime's thread) books the outcome and
    writes the reply into the reply ring, waking the worker through an eventfd: no thread hand-off.
    What does not fit in a ring goes over the socket: one thread per worker connection reads frames
    there (``recv_into`` releases the GIL), and a writer thread sends replies, so socket writes,
    which block while the worker is slow to read, never hold up the runtime.
    """

    def __init__(self, core: Any, path: str, *, drain_on: str = "loop", wakeups: str = "batch",
                 intake_window_ms: float = 0.0) -> None:
        """``drain_on``: who takes requests from the workers' rings: the runtime's ``"loop"`` thread
        (``InferenceService.add_intake``; a drain thread per worker where the service has no such
        loop) or a drain ``"thread"`` per worker. ``wakeups``: a worker's replies in its ring wake it
        once per ``"batch"`` (of ``ring.COALESCE_FROM_ROWS`` rows or more; ``ring.batch_replies``) or
        once per ``"reply"``. ``intake_window_ms``: with ``drain_on="loop"``, the loop takes the
        rings' requests at most once per this many ms (see :class:`_LoopIntake`); 0: at every wake."""
        if drain_on not in DRAIN_ON:
            raise ValueError(f"drain_on must be one of {DRAIN_ON}, got {drain_on!r}")
        if wakeups not in WAKEUPS:
            raise ValueError(f"wakeups must be one of {WAKEUPS}, got {wakeups!r}")
        check_intake_window(intake_window_ms)
        self.core, self.path, self.drain_on, self.wakeups = core, path, drain_on, wakeups
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        # the worker connections open now, and their reader threads (each leaves both as it ends: workers
        # restarted for weeks leave nothing behind)
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.arena_requests = 0  # requests whose tensors came through a worker's shared memory
        self.inline_requests = 0  # ... and over the socket
        self.ring_requests = 0  # requests taken from a worker's request ring (their tensors in its arena)
        self.loop_requests = 0  # ... of which the runtime's loop took (the rest: drain threads)
        self.loop_takes = 0  # the loop's polls that took requests (loop_requests / loop_takes: a take's burst)
        self.loop_deferred = 0  # ... that found requests and left them for the intake window's end
        self.ring_replies = 0  # replies written into a worker's reply ring (the rest went over the socket)
        self.pinned_arenas = 0  # worker arenas page-locked now (launched from in place)
        self._request_templates = _Templates(_RequestTemplate)  # compact ring requests' JSON, checked once
        self._intake = _LoopIntake(self, intake_window_ms)  # the runtime loop's one poller over every worker's ring
        # what the service did around a batch's answers before this bridge set its own (given back at close)
        self._scope_before = getattr(getattr(core, "service", None), "answer_scope", None)
        threading.Thread(target=self._accept, name="gpuloom-bridge-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="gpuloom-bridge", daemon=True)
            self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        out: queue.SimpleQueue = queue.SimpleQueue()  # reply frames for the socket; None stops the writer
        pinned = rings = drain = take = None
        on_loop = False  # the runtime's loop takes this worker's requests (self._intake)
        held = _Outstanding()  # the worker's requests the runtime holds (their rows may lie in the arena)
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
                take = self._ring_taker(rings, send, ok, shared, held)
                service = getattr(self.core, "service", None)
                if service is not None and hasattr(service, "answer_scope"):
                    service.answer_scope = batch_replies if self.wakeups == "batch" else each_reply
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
                meta = json.loads(js)
                if "refused" in meta:  # a request the worker refused while parsing it: booked, not answered
                    self._refused(meta["refused"])
                    continue
                self._take(send, ok, meta, payload, shared, held)
        except OSError:
            return
        finally:
            held.gone = True
            if held.count:
                log.warning("an HTTP front-end worker's connection closed with %d of its requests unanswered; "
                            "their clients' connections went with it (booked dropped %r)", held.count, WORKER_EXITED)
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
                self._unpin(pinned, held)
            self._conns.discard(conn)
            self._threads.discard(threading.current_thread())

    def _refused(self, notice: Any) -> None:
        """Book a request a worker refused while reading or parsing it (``frontend.tell_refused``)."""
        try:
            name, version, status = notice["model"], notice.get("version"), notice["status"]
            if not (isinstance(name, str) and (version is None or isinstance(version, str))
                    and isinstance(status, int) and 400 <= status < 500):
                raise ValueError(f"expected a model name, a version or null and a 4xx status, got {notice!r}")
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            log.error("a malformed refusal notice from a worker (not booked): %s", e)
            return
        self.core.refused(name, version, status)

    def _take(self, send: Callable[[list], None], ok: Callable[..., None], meta: dict, payload: memoryview,
              shared: memoryview | None, held: "_Outstanding") -> None:
        """Submit one request frame: its tensors inline in ``payload``, or in the arena."""
        rid, off = meta["id"], meta.get("arena")
        try:
            layout = _Layout(meta.get("tensors"))
            if off is None:
                self.inline_requests += 1
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
                     inputs, held, waited if isinstance(waited, (int, float)) else 0.0)

    def _take_compact(self, send: Callable[[list], None], ok: Callable[..., None], record: memoryview,
                      shared: memoryview | None, held: "_Outstanding") -> None:
        """Submit one compact ring request (``RING_REQ``): its JSON parsed and checked once per text."""
        try:
            _, jlen, rid, off, deadline, waited, handed = RING_REQ.unpack_from(record)
        except struct.error:  # no id to answer: the worker's request times out
            log.error("a truncated compact record (%d bytes) in a worker's request ring", len(record))
            return
        in_ring = time.monotonic() * 1e3 - handed  # ms since the worker passed it on (the clock is the host's)
        in_ring = in_ring if 0.0 < in_ring < 60_000.0 else 0.0  # (NaN: no hand-off time; beyond: not this clock)
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
                     inputs, held, waited + in_ring, t, in_ring)

    def _ring_taker(self, rings: Any, send: Callable[[list], None], ok: Callable[..., None],
                    shared: memoryview | None, held: "_Outstanding") -> "_RingTaker":
        """What submits the requests queued in a worker's request ring (see :class:`_RingTaker`)."""

        def one(record: memoryview) -> None:
            if record[:4] == RING_MAGIC:  # what workers write
                self._take_compact(send, ok, record, shared, held)
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
                self._take(send, ok, meta, memoryview(b""), shared, held)
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

    def _unpin(self, addr: int, held: "_Outstanding") -> None:
        """Unlock an arena once the device can no longer read a request's rows from it."""
        if not held.wait_none(timeout_s=60):
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
                held: "_Outstanding", waited_ms: float = 0.0,
                template: "_RequestTemplate | None" = None, in_ring_ms: float = 0.0) -> None:
        """Submit one request's checked ``inputs``; its answer goes back through ``ok`` (served) or as
        a frame through ``send`` (an error), from the thread that answers it. ``held``: the worker's
        requests in flight, counted until answered (the device may read their rows from its arena
        till then); once its connection has closed (``held.gone``) a request served is booked
        dropped "worker_exited", not served: its client's connection went with the worker. ``waited_ms``: how
        long it has waited since the worker's handler (its deadline counts from there). ``template``: the
        compact record's, which remembers the config its inputs matched exactly. ``in_ring_ms``: of
        that, how long it waited in the worker's request ring: this process's time, counted in the
        service time its reply reports (and the books' latency)."""
        t0 = time.perf_counter() - in_ring_ms / 1e3

        def done(outputs: Any, error: BaseException | None) -> None:  # the service's on_done
            held.remove()  # the device has read the request's rows from the arena
            if held.gone and error is None:  # served, for no one: the worker (and its client) gone
                self.core.lost(name, WORKER_EXITED)
                return
            try:
                outs = self.core.settle(name, outputs, error, t0, rows)
                names = list(outs)
                ok(rid, names, [np.asarray(outs[k]) for k in names], (time.perf_counter() - t0) * 1e3)
            except Exception as e:  # noqa: BLE001 - e.g. outputs that cannot be framed: still answered
                send(_failure_frame(rid, e))

        try:
            first = next(iter(inputs.values()), None)  # rows for the books; a scalar is refused by submit
            rows = first.shape[0] if first is not None and first.ndim else 0  # (never fails after submit)
            try:
                self.core.check_outputs(name, version, outputs)
            except ProtocolError as e:  # refused before submit, as in process: booked here
                self.core.refused(name, version, e.status)
                raise
            checked = template.checked_for if template is not None else None
            held.add()  # before submit: an answer may come before it returns
            try:
                _, checked = self.core.submit(name, version, inputs, deadline_ms, waited_ms, checked_for=checked,
                                              on_done=done)
            except BaseException:
                held.remove()
                raise
            if template is not None:
                template.checked_for = checked
        except Exception as e:  # noqa: BLE001 - a malformed frame: answered, never a dead worker
            send(_failure_frame(rid, e))

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *list(self._conns)]:
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
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        # the service outlives this bridge (a benchmark's servers take turns on one): what it did
        # around a batch's answers before, unless someone set another since
        service = getattr(self.core, "service", None)
        if getattr(service, "answer_scope", None) in (batch_replies, each_reply):
            service.answer_scope = self._scope_before


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
    is attached. What a take raises is logged: the loop must go on.

    ``window_ms`` > 0: requests are taken at most once per window. A request that finds the last take
    a window ago or more is taken at once; the ones that come sooner wait for the window's end (the
    poll asks the loop to call it then) and go in together. Why: under load the loop took 0.7
    requests a wake (run 213), and a request taken alone costs the loop's thread about twice what
    each of a few taken together does (build VM: 83 us alone, 47 in twos, 39 in fours), its code
    run cold after the loop's other work. What it costs: up to a window of latency, counted against
    the request's deadline (the ring's hand-off time)."""

    def __init__(self, bridge: "InferBridge", window_ms: float = 0.0) -> None:
        self._bridge = bridge
        self._window_s = window_ms / 1000.0
        self._last_take = -math.inf  # monotonic s of the last poll that took requests (window_ms > 0)
        self._quiet_until = -math.inf  # the last time the workers were told they need not wake the loop before
        self._service: Any = None  # whose loop polls (the one attach was given)
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
            self._service = service
            if fd is not None:
                self._rings = (*self._rings, (head, tail, take))
            return fd

    def detach(self, take: "_RingTaker", service: Any) -> None:
        with self._lock:
            self._rings = tuple(r for r in self._rings if r[2] is not take)
            if not self._rings:
                service.remove_intake(self._poll)

    def poll(self) -> float:
        """The loop's poller: take what waits in the rings, or (within a window) say when to."""
        window = self._window_s
        if window:
            now = time.monotonic()
            end = self._last_take + window
            left = end - now
            if left > 0.0:
                for head, tail, _ in self._rings:
                    if head.value != tail.value:
                        self._bridge.loop_deferred += 1
                        if end != self._quiet_until:  # the loop calls again then: the workers need not wake it
                            self._quiet_until = end
                            hold = getattr(self._service, "hold_intake_posts", None)
                            if hold is not None:
                                hold(end)
                        return left * 1000.0
                # nothing waits, but the workers may still skip their wake-ups (a ring whose request
                # made the promise may have gone since): keep the call then
                return (self._quiet_until - now) * 1000.0 if self._quiet_until > now else math.inf
        taken = 0
        for head, tail, take in self._rings:
            if head.value != tail.value:  # RequestRing.pending(), without a call per ring
                try:
                    taken += take(True)
                except Exception:  # noqa: BLE001
                    log.exception("taking requests from a worker's ring on the runtime's loop failed")
        if taken:
            self._bridge.loop_requests += taken
            self._bridge.loop_takes += 1
            if window:
                self._last_take = now
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
    """A count of a worker's requests in flight, a wait for it to reach zero, and whether the
    worker's connection has closed (``gone``: set once, by its reader)."""

    def __init__(self) -> None:
        self._n = 0
        self._cv = threading.Condition()
        self.gone = False

    @property
    def count(self) -> int:
        return self._n

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
