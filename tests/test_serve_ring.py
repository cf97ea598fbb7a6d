"""The shared rings between an HTTP front-end worker and the runtime's process (``gpuloom.serve.ring``),
and the bridge's use of them over a raw Unix socket. CPU only, no worker process."""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_serve_bridge import _arena_frame, _recv_exact, bridge  # noqa: E402,F401 - the bridge fixture

from gpuloom.serve import arena, ring  # noqa: E402
from gpuloom.serve.bridge import InferBridge  # noqa: E402
from gpuloom.serve.wire import FRAME, _Templates, pack, read_ring_reply, unpack_tensors  # noqa: E402

pytestmark = pytest.mark.skipif(not ring.supported(), reason="shared rings need x86-64 Linux (memfd, eventfd)")


def _pair(total: int = 64 << 10) -> tuple[ring.WorkerRings, ring.RuntimeRings]:
    w = ring.WorkerRings(total)
    return w, ring.RuntimeRings(os.dup(w.fd), os.dup(w.event_fd), w.size)


def test_records_come_out_in_order_and_whole_through_many_wrap_arounds_and_full_rings():
    w, r = _pair(4096 * 8)  # a request ring of 4 KiB
    rng = np.random.default_rng(0)
    pending: collections.deque[bytes] = collections.deque()  # put, not yet taken
    taken = refused = 0

    def take(v: memoryview) -> None:
        nonlocal taken
        assert bytes(v) == pending.popleft()  # the oldest record, whole
        taken += 1

    try:
        for _ in range(5000):
            if rng.random() < 0.55:  # a little more put than take: the ring fills now and then
                rec = rng.bytes(int(rng.integers(0, 700)))
                if w.requests.put([rec[:10], rec[10:]]):  # a record of two parts, written back to back
                    pending.append(rec)
                else:  # refused only when full: never with room for twice the record (a wrap wastes less)
                    refused += 1
                    used = r.requests._tail.value - r.requests._head.value
                    assert used + 2 * (len(rec) + 16) > r.requests.size
            else:
                r.requests.take(take)
        r.requests.take(take)
        assert not pending and taken > 1000 and refused > 10
        assert r.requests._tail.value > 10 * r.requests.size  # wrapped around many times
    finally:
        r.close()
        w.close()


def test_a_record_bigger_than_the_ring_is_refused_and_leaves_the_ring_as_it_was():
    w, r = _pair()
    try:
        tail = r.replies._tail.value
        assert not r.replies.put([b"x" * (r.replies.size + 1)])
        assert r.replies._tail.value == tail
        assert r.reply([b"small"])  # still works
        got: list[bytes] = []
        assert w.take_replies(lambda v: got.append(bytes(v))) == 1 and got == [b"small"]
    finally:
        r.close()
        w.close()


def _child(w: ring.WorkerRings, n: int, delay_s: float, q) -> None:
    time.sleep(delay_s)
    for i in range(n):
        assert w.send([json.dumps({"i": i}).encode()])
    got: list[int] = []
    deadline = time.monotonic() + 10
    import select

    while len(got) < n and time.monotonic() < deadline:
        select.select([w.event_fd], [], [], 1.0)  # the eventfd the parent posts per reply
        w.take_replies(lambda v: got.append(json.loads(bytes(v))["i"]))
    q.put(got)


def test_the_semaphore_and_the_eventfd_wake_the_other_process():
    ctx = mp.get_context("fork")
    w, r = _pair()
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(w, 50, 0.3, q))
    try:
        child.start()
        t0 = time.monotonic()
        r.wake.wait(5.0)  # the child's first post ends this wait, long before its timeout
        waited = time.monotonic() - t0
        assert 0.2 < waited < 3.0
        got: list[int] = []
        deadline = time.monotonic() + 10
        while len(got) < 50 and time.monotonic() < deadline:
            r.requests.take(lambda v: got.append(json.loads(bytes(v))["i"]))
            r.wake.wait(0.5)
        assert got == list(range(50))
        for i in got:
            assert r.reply([json.dumps({"i": i * 2}).encode()])
        assert q.get(timeout=10) == [2 * i for i in range(50)]
    finally:
        child.join(10)
        r.close()
        w.close()
    assert child.exitcode == 0


def test_after_close_the_runtime_end_refuses_replies_so_they_go_over_the_socket():
    w, r = _pair()
    try:
        r.close()
        assert not r.open and not r.reply([b"late"])
    finally:
        w.close()


class _IntakeService:
    """What the bridge's loop intake needs of a service: pollers registered once, a descriptor per call."""

    def __init__(self) -> None:
        self.pollers: list = []
        self.handed_out = 0
        self.held_until: list[float] = []  # hold_intake_posts' times, in order

    def add_intake(self, poll):
        if poll not in self.pollers:
            self.pollers.append(poll)
        self.handed_out += 1
        return os.open(os.devnull, os.O_RDONLY)

    def remove_intake(self, poll):
        self.pollers = [p for p in self.pollers if p is not poll]

    def hold_intake_posts(self, until_s):
        self.held_until.append(until_s)


def test_one_loop_poller_takes_from_every_attached_ring_and_only_from_rings_with_requests():
    from gpuloom.serve.bridge import _LoopIntake, _RingTaker

    class Bridge:
        loop_requests = loop_takes = loop_deferred = 0

    bridge, service = Bridge(), _IntakeService()
    intake = _LoopIntake(bridge)
    pairs = [_pair() for _ in range(3)]
    got: list[tuple[int, bytes]] = []
    calls = collections.Counter()  # taker -> times the poller called it

    def taker(i, r):
        t = _RingTaker(r, lambda v: got.append((i, bytes(v))))

        def counted(wait):
            calls[i] += 1
            return t(wait)
        return counted

    takes = [taker(i, r) for i, (_, r) in enumerate(pairs)]
    try:
        for (_, r), t in zip(pairs, takes):
            os.close(intake.attach(r.requests, t, service))
        assert service.pollers == [intake._poll] and service.handed_out == 3  # one poller, a descriptor each
        for _ in range(5):
            intake.poll()
        assert got == [] and not calls  # empty rings: nothing called
        assert pairs[1][0].send([b"x"]) and pairs[2][0].send([b"y"]) and pairs[2][0].send([b"z"])
        intake.poll()
        assert got == [(1, b"x"), (2, b"y"), (2, b"z")] and bridge.loop_requests == 3
        assert calls == {1: 1, 2: 1}
        intake.detach(takes[0], service)
        intake.detach(takes[1], service)
        assert service.pollers == [intake._poll]  # one ring still attached
        assert pairs[0][0].send([b"gone"]) and pairs[2][0].send([b"w"])
        intake.poll()
        assert got[-1] == (2, b"w") and (0, b"gone") not in got  # a detached ring is not polled
        intake.detach(takes[2], service)
        assert service.pollers == []  # the last ring gone: the poller leaves the loop
    finally:
        for w, r in pairs:
            r.close()
            w.close()


def test_with_an_intake_window_a_lone_request_is_taken_at_once_and_the_next_ones_together_at_its_end():
    """The window's contract, on the poller alone: a request with no take in the last window goes in
    at once; requests that come within the window are left where they are, the poll saying how long
    until the window ends (the loop's next call); then all go in at one take. Nothing waiting within
    the window: no call asked for."""
    from gpuloom.serve.bridge import _LoopIntake, _RingTaker

    class Bridge:
        loop_requests = loop_takes = loop_deferred = 0

    bridge, service, got = Bridge(), _IntakeService(), []
    intake = _LoopIntake(bridge, window_ms=300.0)
    w, r = _pair()
    try:
        os.close(intake.attach(r.requests, _RingTaker(r, lambda v: got.append(bytes(v))), service))
        assert w.send([b"a"])
        t0 = time.monotonic()
        assert intake.poll() == float("inf") and got == [b"a"]  # alone: at once
        assert intake.poll() == float("inf")  # within the window, nothing waiting: no call asked for
        assert w.send([b"b"]) and w.send([b"c"])
        left = intake.poll()
        elapsed_ms = (time.monotonic() - t0) * 1e3
        assert got == [b"a"] and 0.0 < left <= 300.0 - elapsed_ms + 1.0, left  # left for the window's end
        assert bridge.loop_deferred == 1 and bridge.loop_takes == 1
        # the workers were told they need not wake the loop before the window's end: it looks then
        assert len(service.held_until) == 1 and 0.0 < service.held_until[0] - time.monotonic() <= left / 1e3 + 1e-3
        assert intake.poll() > 0.0 and len(service.held_until) == 1  # (told once a window)
        time.sleep(left / 1e3)
        while time.monotonic() - t0 < 0.3:  # (a sleep may end a hair early)
            time.sleep(0.001)
        assert intake.poll() == float("inf") and got == [b"a", b"b", b"c"]  # together, at one take
        assert bridge.loop_takes == 2 and bridge.loop_requests == 3 and bridge.loop_deferred == 2
    finally:
        r.close()
        w.close()


def test_while_the_workers_are_told_not_to_wake_the_loop_the_intake_keeps_its_call_even_with_no_ring_pending():
    """The loop promised to look at the window's end (the workers skip its wake-ups until then). If
    the ring whose request made that promise goes (its worker's connection closed) and the loop wakes
    for something else meanwhile, the intake must still ask for its call at the window's end: another
    worker may publish a request before then without posting (a review, sixty-eighth session: taken
    only at an unrelated wake-up otherwise)."""
    from gpuloom.serve.bridge import _LoopIntake, _RingTaker

    class Bridge:
        loop_requests = loop_takes = loop_deferred = 0

    service, got = _IntakeService(), []
    intake = _LoopIntake(Bridge(), window_ms=300.0)
    (wa, ra), (wb, rb) = _pair(), _pair()
    try:
        take_a = _RingTaker(ra, lambda v: got.append(bytes(v)))
        os.close(intake.attach(ra.requests, take_a, service))
        os.close(intake.attach(rb.requests, _RingTaker(rb, lambda v: got.append(bytes(v))), service))
        assert wa.send([b"a1"]) and intake.poll() == float("inf")  # taken at once: the window opens
        assert wa.send([b"a2"]) and 0.0 < intake.poll() <= 300.0  # deferred: the workers told to stay quiet
        assert len(service.held_until) == 1
        intake.detach(take_a, service)  # worker a goes, its request with it
        left = intake.poll()  # an unrelated wake-up: nothing pending now, but the promise stands
        assert 0.0 < left <= 300.0, left
    finally:
        for w, r in ((wa, ra), (wb, rb)):
            r.close()
            w.close()


def test_an_intake_window_must_be_a_few_ms_at_most():
    from gpuloom.serve.bridge import check_intake_window

    assert check_intake_window(0) == 0 and check_intake_window(0.5) == 0.5
    for bad in (-0.1, 10.5, float("nan"), "1", True, None):
        with pytest.raises(ValueError, match="intake window must be a number of ms in"):
            check_intake_window(bad)


def test_a_ring_whose_take_raises_does_not_stop_the_others():
    from gpuloom.serve.bridge import _LoopIntake, _RingTaker

    class Bridge:
        loop_requests = loop_takes = loop_deferred = 0

    def boom(v):
        raise RuntimeError("bad record")

    service, got = _IntakeService(), []
    intake = _LoopIntake(Bridge())
    (w0, r0), (w1, r1) = _pair(), _pair()
    try:
        os.close(intake.attach(r0.requests, _RingTaker(r0, boom), service))
        os.close(intake.attach(r1.requests, _RingTaker(r1, lambda v: got.append(bytes(v))), service))
        assert w0.send([b"a"]) and w1.send([b"b"])
        assert intake.poll() == float("inf") and got == [b"b"]
    finally:
        for w, r in ((w0, r0), (w1, r1)):
            r.close()
            w.close()


def test_a_closed_taker_takes_nothing_more():
    from gpuloom.serve.bridge import _RingTaker

    w, r = _pair()
    got: list[bytes] = []
    take = _RingTaker(r, lambda v: got.append(bytes(v)))
    try:
        assert w.send([b"a"]) and take(True) == 1 and got == [b"a"]
        take.close()  # what the bridge does before it unlocks the worker's arena
        assert w.send([b"b"]) and take(True) == 0 and take(False) == 0
        assert got == [b"a"] and r.requests.pending()
    finally:
        r.close()
        w.close()


# -- the bridge with a worker's rings, over a raw socket ----------------------------------------
@pytest.fixture
def worker(bridge):
    """A stand-in worker connected to ``bridge`` with an arena and rings: ``make(arena_bytes,
    ring_bytes)`` gives ``(arena, rings, socket)``; all are closed after the test."""
    made = []

    def make(arena_bytes: int = 1 << 20, ring_bytes: int = 256 << 10):
        shared, rings = arena.Arena(arena_bytes), ring.WorkerRings(ring_bytes)
        made.append((shared, rings))
        s = _connect_with_rings(bridge, shared, rings)
        made.append((s,))
        return shared, rings, s

    yield make
    for objs in reversed(made):
        for o in objs:
            o.close()


def _connect_with_rings(b: InferBridge, shared: arena.Arena, rings: ring.WorkerRings) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(b.path)
    js = json.dumps({"hello": 1, "arena_bytes": shared.size, "ring_bytes": rings.size}).encode()
    socket.send_fds(s, [FRAME.pack(len(js), 0) + js], [shared.fd, *rings.fds])
    jlen, plen = FRAME.unpack(_recv_exact(s, FRAME.size))
    ack = json.loads(_recv_exact(s, jlen + plen)[:jlen])
    assert ack["hello"] == 1 and ack["ring"] is True  # the runtime mapped them: requests may go there
    return s


def _ring_replies(rings: ring.WorkerRings, n: int, timeout_s: float = 10.0) -> dict[int, tuple[dict, dict]]:
    import select

    out: dict[int, tuple[dict, dict]] = {}

    templates = _Templates(dict)

    def take(rec: memoryview) -> None:
        meta, payload = read_ring_reply(rec, templates)  # a compact record (served) or a frame (an error)
        out[meta["id"]] = (meta, unpack_tensors(meta, payload) if meta["status"] == 200 else {})

    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        select.select([rings.event_fd], [], [], 0.5)
        rings.take_replies(take)
    return out


def test_requests_through_the_rings_are_answered_through_them_with_their_own_outputs(bridge, worker):
    shared, rings, _ = worker()
    xs = {i: np.full((1 + i % 3, 4), i, np.float32) for i in range(100)}
    for i, x in xs.items():
        assert rings.send([_arena_frame(i, x, shared)])
    got = _ring_replies(rings, 100)
    assert sorted(got) == list(xs)
    for i, x in xs.items():
        np.testing.assert_array_equal(got[i][1]["y"], 2 * x)
    assert bridge.ring_requests == 100 and bridge.ring_replies == 100 and bridge.inline_requests == 0


def test_a_bad_ring_request_is_answered_with_an_error_and_the_drain_goes_on(worker):
    shared, rings, _ = worker(1 << 16)
    x = np.ones((1, 4), np.float32)
    meta = {"id": 1, "model": "m", "version": None, "deadline_ms": None, "outputs": None, "names": ["x"],
            "arena": 1 << 30}  # beyond the arena
    assert rings.send(pack(meta, [x], into=memoryview(bytearray(x.nbytes))))
    assert rings.send(pack(dict(meta, id=2, names=["x"], arena=None), [x]))  # tensors inline in a ring frame
    assert rings.send([b"not a frame"])  # no id to answer: logged, skipped
    assert rings.send([_arena_frame(3, x, shared)])
    got = _ring_replies(rings, 3)
    assert got[1][0]["status"] == 500 and "bad arena block" in got[1][0]["error"]
    assert got[2][0]["status"] == 500 and "arena" in got[2][0]["error"]
    np.testing.assert_array_equal(got[3][1]["y"], 2 * x)


def test_replies_that_do_not_fit_in_the_reply_ring_come_over_the_socket(bridge, worker):
    shared, rings, s = worker(1 << 22, 40 << 10)  # a reply ring of 35 KiB
    x = np.ones((1, 1024), np.float32)  # 4 KiB replies: about eight fit while nobody takes them
    for i in range(20):
        assert rings.send([_arena_frame(i, x, shared)])
    socket_ids = []
    while len(socket_ids) + bridge.ring_replies < 20:  # the socket's read times out if one is lost
        jlen, plen = FRAME.unpack(_recv_exact(s, FRAME.size))
        meta = json.loads(_recv_exact(s, jlen))
        np.testing.assert_array_equal(unpack_tensors(meta, memoryview(_recv_exact(s, plen)))["y"], 2 * x)
        socket_ids.append(meta["id"])
    in_ring = _ring_replies(rings, bridge.ring_replies)
    assert 1 <= len(in_ring) < 20 and len(socket_ids) == 20 - len(in_ring)
    assert sorted([*in_ring, *socket_ids]) == list(range(20))  # each answered once, one way or the other


def test_a_worker_that_goes_away_ends_its_drain_thread(worker):
    import threading

    shared, rings, s = worker(1 << 16, 64 << 10)
    assert rings.send([_arena_frame(0, np.ones((1, 4), np.float32), shared)])
    assert _ring_replies(rings, 1)
    s.close()
    deadline = time.monotonic() + 5
    while any(t.name == "gpuloom-bridge-ring" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "gpuloom-bridge-ring" for t in threading.enumerate())


# -- compact ring records (what workers write, and successful replies) ---------------------------
def _compact(rid: int, x: np.ndarray, shared: arena.Arena, deadline_ms=None, model: str = "m", waited_ms=0.0,
             handed_ms=None) -> list:
    from gpuloom.serve.wire import _copy_into, _describe, ring_request

    off = shared.alloc(x.nbytes)
    tensors, bufs = _describe(["x"], [x])
    _copy_into(shared.view(off, x.nbytes), bufs)
    return ring_request(rid, {"model": model, "version": None, "outputs": None}, tensors, off, deadline_ms, waited_ms,
                        handed_ms)


def test_compact_requests_are_answered_with_compact_replies_and_their_json_is_parsed_once(bridge, worker):
    shared, rings, _ = worker()
    seen = []
    submit = bridge.core.submit
    bridge.core.submit = lambda name, version, inputs, deadline_ms, waited_ms, **kw: (
        seen.append((name, deadline_ms, waited_ms)), submit(name, version, inputs, deadline_ms, waited_ms, **kw))[1]
    xs = {i: np.full((1 + i % 3, 4), i, np.float32) for i in range(60)}
    for i, x in xs.items():  # the time each waited in its worker comes along (the deadline counts from there)
        assert rings.send(_compact(i, x, shared, deadline_ms=None if i % 2 else 250.0 + i, waited_ms=i / 8,
                                   handed_ms=float("nan")))  # (no hand-off time: the time in the ring not added)
    got = _ring_replies(rings, 60)
    assert sorted(got) == list(xs)
    for i, x in xs.items():
        np.testing.assert_array_equal(got[i][1]["y"], 2 * x)
        assert got[i][0]["status"] == 200 and got[i][0]["service_ms"] >= 0
    assert sorted(d for _, d, _ in seen if d is not None) == [250.0 + i for i in range(0, 60, 2)]
    assert sum(d is None for _, d, _ in seen) == 30
    assert sorted(w for _, _, w in seen) == [i / 8 for i in range(60)]
    assert len(bridge._request_templates._known) == 3  # one JSON text per row count
    assert bridge.ring_requests == 60 and bridge.ring_replies == 60 and bridge.arena_requests == 60


def test_the_time_a_compact_request_waited_in_the_ring_counts_against_its_deadline_and_in_its_service_time(
        bridge, worker):
    """A record handed on 40 ms ago (the worker's clock is the host's monotonic one) reaches the core
    with those 40 ms added to the time it waited in the worker, and its reply's service time counts
    them: they were the runtime process's, not the worker's."""
    shared, rings, _ = worker()
    seen = []
    submit = bridge.core.submit
    bridge.core.submit = lambda name, version, inputs, deadline_ms, waited_ms, **kw: (
        seen.append(waited_ms), submit(name, version, inputs, deadline_ms, waited_ms, **kw))[1]
    handed = time.monotonic() * 1e3 - 40.0
    assert rings.send(_compact(1, np.ones((1, 4), np.float32), shared, waited_ms=3.0, handed_ms=handed))
    meta = _ring_replies(rings, 1)[1][0]
    assert 43.0 <= seen[0] < 43.0 + 5_000.0, seen
    assert meta["status"] == 200 and meta["service_ms"] >= 40.0, meta
    # a hand-off time from the future or long past (another clock) is not counted
    for rid, at in ((2, time.monotonic() * 1e3 + 1e6), (3, 0.0)):
        assert rings.send(_compact(rid, np.ones((1, 4), np.float32), shared, waited_ms=3.0, handed_ms=at))
        _ring_replies(rings, 1)
    assert seen[1:] == [3.0, 3.0]


def test_a_compact_requests_layout_remembers_the_config_it_matched_so_the_next_is_not_checked_again(bridge, worker):
    """The first request of a JSON text is checked in full; the core says which config it matched
    exactly, and the later requests of that text hand it back (checked_for), so the core and the
    runtime skip their checks while the model keeps that config. A new text starts unchecked."""
    shared, rings, _ = worker()
    for i in range(3):
        assert rings.send(_compact(i, np.full((2, 4), i, np.float32), shared))
        _ring_replies(rings, 1)  # one at a time: each request sees what the one before left
    assert rings.send(_compact(3, np.ones((1, 4), np.float32), shared))  # another row count: another text
    _ring_replies(rings, 1)
    cfg = bridge.core.config
    assert bridge.core.checked_for == [None, cfg, cfg, None]


def test_bad_compact_requests_are_answered_or_skipped_and_the_drain_goes_on(worker):
    from gpuloom.serve.wire import RING_MAGIC, RING_REQ

    shared, rings, _ = worker(1 << 16)
    x = np.ones((1, 4), np.float32)
    good = _compact(3, x, shared)
    _, jlen, _, off, _, _, _ = RING_REQ.unpack(good[0])
    assert rings.send([RING_REQ.pack(RING_MAGIC, jlen, 1, 1 << 30, float("nan"), 0.0, 0.0), good[1]])  # beyond the arena
    assert rings.send([RING_REQ.pack(RING_MAGIC, 8, 2, off, float("nan"), 0.0, 0.0), b"not json"])
    wrong = good[1].replace(b'"nbytes": 16', b'"nbytes": 12')  # the bytes disagree with the shape
    assert rings.send([RING_REQ.pack(RING_MAGIC, len(wrong), 4, off, float("nan"), 0.0, 0.0), wrong])
    floats = good[1].replace(b'"shape": [1, 4]', b'"shape": [1.0, 4]')  # only integers make a shape
    assert rings.send([RING_REQ.pack(RING_MAGIC, len(floats), 5, off, float("nan"), 0.0, 0.0), floats])
    unknown = good[1].replace(b'"FP32"', b'"FP99"')  # no such datatype: the client's mistake, a 400
    assert rings.send([RING_REQ.pack(RING_MAGIC, len(unknown), 6, off, float("nan"), 0.0, 0.0), unknown])
    assert rings.send([RING_MAGIC + b"\0\0"])  # truncated: no id to answer, logged and skipped
    assert rings.send(good)
    got = _ring_replies(rings, 6)
    assert got[1][0]["status"] == 500 and "bad arena block" in got[1][0]["error"]
    assert got[2][0]["status"] == 500 and got[4][0]["status"] == 500
    assert got[5][0]["status"] == 500 and "integer" in got[5][0]["error"]
    assert got[6][0]["status"] == 400 and "FP99" in got[6][0]["error"]
    np.testing.assert_array_equal(got[3][1]["y"], 2 * x)
    # a scalar input (shape []) reaches the core, which decides: never a 500 from the bridge (fuzzing found one)
    scalar = _compact(7, np.float32(3.0).reshape(()), shared)
    assert rings.send(scalar)
    assert _ring_replies(rings, 1)[7][0]["status"] == 200  # the echo core takes anything


def test_reply_records_carry_any_array_layout_and_the_remembered_texts_are_bounded(monkeypatch):
    from gpuloom.serve import wire
    from gpuloom.serve.wire import _ReplyEncoder

    enc, templates = _ReplyEncoder(), _Templates(dict)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = [base[:, ::2], base.astype(">f4"), np.arange(3, dtype=np.int64)]  # strided, big-endian, plain
    parts = enc.record(7, ["a", "b", "c"], arrays, 1.5)
    meta, payload = read_ring_reply(memoryview(b"".join(bytes(p) for p in parts)), templates)
    assert meta["id"] == 7 and meta["status"] == 200 and meta["service_ms"] == 1.5
    out = unpack_tensors(meta, payload)
    for name, a in zip("abc", arrays):
        np.testing.assert_array_equal(out[name], a)
    # a frame (an error reply) reads the same way
    frame = pack({"id": 9, "status": 404, "error": "no such model", "names": []}, [])
    assert read_ring_reply(memoryview(b"".join(frame)), templates)[0]["error"] == "no such model"
    monkeypatch.setattr(wire, "_TEMPLATES_MAX", 4)
    small = _Templates(dict)
    for i in range(10):
        small.get(json.dumps({"i": i}).encode())
        assert len(small._known) <= 4
    long = json.dumps({"name": "n" * (wire._TEMPLATE_BYTES_MAX + 1)}).encode()
    assert small.get(long)["name"].startswith("n") and long not in small._known  # parsed, not kept
    with pytest.raises(json.JSONDecodeError):
        small.get(b"{")
    assert b"{" not in small._known


def _posts(w: ring.WorkerRings) -> int:
    """How many times the worker's eventfd was posted since it was last read (0: none)."""
    try:
        return os.eventfd_read(w.event_fd)
    except BlockingIOError:
        return 0


def test_inside_one_post_per_worker_each_worker_is_woken_once_after_all_its_replies():
    import threading

    (w1, r1), (w2, r2) = _pair(), _pair()
    try:
        for i in range(3):
            assert r1.reply([b"plain %d" % i])
        assert _posts(w1) == 3  # outside the scope: one post per reply, as before
        with ring.one_post_per_worker():
            for i in range(4):
                assert r1.reply([b"a%d" % i])
            assert r2.reply([b"b"])
            with ring.one_post_per_worker():  # nested: the outermost posts
                assert r2.reply([b"c"])
            assert _posts(w1) == 0 and _posts(w2) == 0  # frames written, nobody woken yet
            other = threading.Thread(target=lambda: r2.reply([b"from another thread"]))
            other.start()
            other.join()
            assert _posts(w2) == 1  # the scope is this thread's: the other thread's reply posted at once
        assert _posts(w1) == 1 and _posts(w2) == 1
        got: list[bytes] = []
        w1.take_replies(lambda v: got.append(bytes(v)))
        assert got == [b"plain 0", b"plain 1", b"plain 2", b"a0", b"a1", b"a2", b"a3"]  # every frame is there
        with pytest.raises(RuntimeError), ring.one_post_per_worker():
            assert r1.reply([b"then a failure"])
            raise RuntimeError("booking failed")
        assert _posts(w1) == 1  # the frame it wrote still wakes the worker
        with ring.one_post_per_worker():
            assert r1.reply([b"before close"])
            r1.close()  # the worker went away before the post: nothing to wake, no error
        assert _posts(w1) == 0
    finally:
        for r, w in ((r1, w1), (r2, w2)):
            r.close()
            w.close()


def test_only_batches_of_enough_rows_wake_each_worker_once():
    assert isinstance(ring.batch_replies(ring.COALESCE_FROM_ROWS), ring.one_post_per_worker)
    assert not isinstance(ring.batch_replies(ring.COALESCE_FROM_ROWS - 1), ring.one_post_per_worker)
    assert not any(isinstance(ring.each_reply(n), ring.one_post_per_worker) for n in (1, 8, 64))
    w, r = _pair()
    try:
        with ring.batch_replies(2):
            assert r.reply([b"x"]) and r.reply([b"y"])
            assert _posts(w) == 2  # a small batch: each reply woke the worker at once
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("wakeups, scope", [("batch", ring.batch_replies), ("reply", ring.each_reply)])
def test_the_bridge_sets_the_services_answer_scope_to_its_wakeups(tmp_path, wakeups, scope):
    from test_serve_bridge import EchoCore

    class _Service:  # what the bridge looks for on its core's service
        answer_scope = None

    core = EchoCore()
    core.service = _Service()
    before = core.service.answer_scope = object()  # the service's own, before any server
    b = InferBridge(core, str(tmp_path / "b.sock"), wakeups=wakeups)
    shared, rings = arena.Arena(1 << 20), ring.WorkerRings(256 << 10)
    s = _connect_with_rings(b, shared, rings)
    try:
        deadline = time.monotonic() + 10
        while core.service.answer_scope is before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.service.answer_scope is scope
    finally:
        s.close()
        b.close()
        core.close()
        rings.close()
        shared.close()
    assert core.service.answer_scope is before  # the bridge gone, the service answers as it did
    with pytest.raises(ValueError, match="wakeups must be one of"):
        InferBridge(core, str(tmp_path / "c.sock"), wakeups="never")  # refused before it binds
