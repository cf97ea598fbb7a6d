"""The HTTP workers' bridge (``InferBridge``) on its own, over a raw Unix socket: frames that arrive
several to a read, split over many reads, bigger than the reader's buffer, and a worker that goes
away mid-frame. CPU only, no worker process."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import numpy as np
import pytest

from gpuloom.serve import arena
from gpuloom.serve.bridge import _READ_BUF, InferBridge
from gpuloom.serve.wire import FRAME, pack, unpack_tensors


class EchoCore:
    """What the bridge calls on ``ServeCore``: a thread answers each request with ``y = 2 * x``."""

    service = None

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.waited: list[float] = []  # waited_ms of each request submitted
        self.checked_for: list = []  # checked_for of each request submitted
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            on_done, x = item
            on_done({"y": x * 2}, None)  # as the service answers: on its own thread

    def check_outputs(self, name, version, wanted) -> None:
        return None

    #: what a real core returns for inputs that match the model exactly (its config)
    config = object()

    def submit(self, name, version, inputs, deadline_ms, waited_ms=0.0, checked_for=None, on_done=None):
        self.waited.append(waited_ms)
        self.checked_for.append(checked_for)
        self._q.put((on_done, np.array(inputs["x"], copy=True)))
        return None, self.config

    def settle(self, name, outputs, error, t0, rows):
        if error is not None:
            raise error
        return outputs

    def close(self) -> None:
        self._q.put(None)


@pytest.fixture
def bridge(tmp_path):
    core = EchoCore()
    b = InferBridge(core, str(tmp_path / "bridge.sock"))
    yield b
    b.close()
    core.close()


def _connect(b: InferBridge, shared: arena.Arena | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(b.path)
    js = json.dumps({"hello": 1, "arena_bytes": shared.size if shared else 0}).encode()
    socket.send_fds(s, [FRAME.pack(len(js), 0) + js], [shared.fd] if shared else [])
    return s


def _frame(rid: int, x: np.ndarray, **extra) -> bytes:
    meta = {"id": rid, "model": "m", "version": None, "deadline_ms": None, "outputs": None, "names": ["x"], **extra}
    return b"".join(bytes(p) for p in pack(meta, [x]))


def _arena_frame(rid: int, x: np.ndarray, shared: arena.Arena) -> bytes:
    off = shared.alloc(x.nbytes)
    meta = {"id": rid, "model": "m", "version": None, "deadline_ms": None, "outputs": None, "names": ["x"],
            "arena": off}
    return b"".join(bytes(p) for p in pack(meta, [x], into=shared.view(off, x.nbytes)))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the bridge closed the connection"
        buf += chunk
    return bytes(buf)


def _replies(s: socket.socket, n: int) -> dict[int, tuple[dict, dict]]:
    out = {}
    for _ in range(n):
        jlen, plen = FRAME.unpack(_recv_exact(s, FRAME.size))
        meta = json.loads(_recv_exact(s, jlen))
        payload = memoryview(_recv_exact(s, plen))
        out[meta["id"]] = (meta, unpack_tensors(meta, payload) if meta["status"] == 200 else {})
    return out


def test_several_frames_in_one_send_are_each_answered(bridge):
    shared = arena.Arena(1 << 16) if arena.supported() else None
    s = _connect(bridge, shared)
    try:
        xs = {i: np.full((1 + i % 3, 4), i, np.float32) for i in range(40)}
        frames = [_arena_frame(i, x, shared) if shared is not None and i % 2 else _frame(i, x) for i, x in xs.items()]
        s.sendall(b"".join(frames))  # 40 frames back to back: most arrive several to one read
        got = _replies(s, len(xs))
        assert sorted(got) == sorted(xs)
        for i, x in xs.items():
            meta, outs = got[i]
            assert meta["status"] == 200
            np.testing.assert_array_equal(outs["y"], x * 2)
    finally:
        s.close()
        if shared is not None:
            shared.close()


def test_a_frame_says_how_long_its_worker_held_it_and_a_bad_figure_counts_as_none(bridge):
    """The deadline counts from the worker's handler: the frame's ``waited_ms`` reaches the core's
    submit (a number only: anything else, from a worker that is not ours, counts as no wait)."""
    s = _connect(bridge)
    try:
        x = np.ones((1, 4), np.float32)
        s.sendall(_frame(1, x, waited_ms=12.5) + _frame(2, x, waited_ms="soon") + _frame(3, x))
        got = _replies(s, 3)
        assert all(got[i][0]["status"] == 200 for i in (1, 2, 3))
        assert bridge.core.waited == [12.5, 0.0, 0.0]
    finally:
        s.close()


def test_a_frame_split_over_many_sends_is_reassembled(bridge):
    s = _connect(bridge)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        data = _frame(7, x) + _frame(8, x + 1)
        for i in range(0, len(data), 5):  # 5 bytes at a time, header and JSON cut anywhere
            s.sendall(data[i:i + 5])
            time.sleep(0.001)
        got = _replies(s, 2)
        np.testing.assert_array_equal(got[7][1]["y"], x * 2)
        np.testing.assert_array_equal(got[8][1]["y"], (x + 1) * 2)
    finally:
        s.close()


def test_payloads_and_json_bigger_than_the_readers_buffer(bridge):
    s = _connect(bridge)
    try:
        big = np.arange(3 * _READ_BUF // 4, dtype=np.float32).reshape(3, -1)  # 3 buffers of payload
        small = np.ones((1, 4), np.float32)
        pad = "p" * (2 * _READ_BUF)  # a JSON head twice the buffer (ignored by the bridge)
        s.sendall(_frame(1, small) + _frame(2, big) + _frame(3, small, pad=pad) + _frame(4, small))
        got = _replies(s, 4)
        np.testing.assert_array_equal(got[2][1]["y"], big * 2)  # a reply bigger than _JOIN_MAX, too
        for i in (1, 3, 4):
            np.testing.assert_array_equal(got[i][1]["y"], small * 2)
    finally:
        s.close()


def test_a_bad_arena_block_is_answered_with_an_error_frame_and_the_next_request_still_works(bridge):
    s = _connect(bridge)  # no arena
    try:
        x = np.ones((1, 4), np.float32)
        bad = b"".join(bytes(p) for p in pack({"id": 1, "model": "m", "names": ["x"], "arena": 0}, [x],
                                                into=memoryview(bytearray(16))))
        s.sendall(bad + _frame(2, x))
        got = _replies(s, 2)
        assert got[1][0]["status"] == 500 and "bad arena block" in got[1][0]["error"]
        assert got[2][0]["status"] == 200
    finally:
        s.close()


def test_a_worker_that_goes_away_mid_frame_ends_its_connection_threads(bridge):
    s = _connect(bridge)
    x = np.ones((2, 4), np.float32)
    s.sendall(_frame(1, x))
    assert _replies(s, 1)[1][0]["status"] == 200
    s.sendall(_frame(2, x)[:-5])  # all but the last 5 bytes of the payload
    threads = list(bridge._threads)
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.01)
    assert len(threads) == 1 and not threads[0].is_alive()
    assert not bridge._threads and not bridge._conns  # forgotten: a restarted worker leaves nothing behind


class GatedCore(EchoCore):
    """Answers only once ``gate`` is set; books what it settles and what it is told was lost."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.settled: list[str] = []
        self.lost_reasons: list[str] = []

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            self.gate.wait(30)
            on_done, x = item
            on_done({"y": x * 2}, None)

    def settle(self, name, outputs, error, t0, rows):
        self.settled.append(name)
        return super().settle(name, outputs, error, t0, rows)

    def lost(self, name, reason) -> None:
        self.lost_reasons.append(reason)


def test_requests_served_after_their_worker_went_away_are_booked_lost_not_served(tmp_path, caplog):
    """A worker killed (or cut off at its stop's end) with requests in the runtime: their clients'
    connections went with it, so what the runtime serves after is booked dropped "worker_exited",
    and the bridge says how many were left (before the sixty-ninth session: booked served)."""
    core = GatedCore()
    b = InferBridge(core, str(tmp_path / "bridge.sock"))
    try:
        s = _connect(b)
        for rid in range(3):
            s.sendall(_frame(rid, np.ones((1, 4), np.float32)))
        deadline = time.monotonic() + 10
        while b.inline_requests < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close()  # the worker dies with its 3 requests in the runtime
        while any(t.is_alive() for t in b._threads) and time.monotonic() < deadline:
            time.sleep(0.01)
        core.gate.set()
        while len(core.lost_reasons) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.lost_reasons == ["worker_exited"] * 3 and core.settled == []
        assert "closed with 3 of its requests unanswered" in caplog.text
        s2 = _connect(b)  # a worker connected now is served as ever
        s2.sendall(_frame(7, np.ones((1, 4), np.float32)))
        meta, outs = _replies(s2, 1)[7]
        assert meta["status"] == 200 and core.settled == ["m"] and len(core.lost_reasons) == 3
        s2.close()
    finally:
        core.gate.set()
        b.close()
        core.close()


def test_a_worker_that_does_not_read_its_replies_holds_up_no_other_worker(bridge):
    """Replies are made on the thread that answers (here the core's one thread) and sent by each
    connection's writer: one worker that leaves its replies unread must not block that thread, or
    every other worker would wait too. (Sending from the answering thread itself was tried, and lost
    on the H200: ``docs/reports/serving.md``, twenty-third session.)"""
    slow, fast = _connect(bridge), _connect(bridge)
    big = np.ones((1, 1 << 16), np.float32)  # 256 KB replies: a few fill the socket's buffer
    n_slow = 40
    for rid in range(n_slow):
        slow.sendall(_frame(rid, big))
    deadline = time.monotonic() + 10
    while bridge.inline_requests < n_slow and time.monotonic() < deadline:  # all submitted ...
        time.sleep(0.01)
    assert bridge.inline_requests == n_slow
    time.sleep(0.1)  # ... and answered by the core's thread (10 MB the slow worker does not read)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    fast.sendall(_frame(1000, x))
    meta, outs = _replies(fast, 1)[1000]
    assert meta["status"] == 200 and np.array_equal(outs["y"], x * 2)
    got = _replies(slow, n_slow)  # once it reads, every reply arrives whole (and the framing holds)
    assert sorted(got) == list(range(n_slow))
    assert all(m["status"] == 200 and np.array_equal(o["y"], big * 2) for m, o in got.values())
    slow.close()
    fast.close()


def test_a_tensor_with_a_zero_in_its_shape_packs_and_unpacks():
    """(A worker's request with shape [0, 16] raised in ``memoryview.cast`` and was a 500 that left the
    request and its arena block behind, sixty-fourth session's review; the runtime answers its 400.)"""
    x, y = np.zeros((0, 16), np.float32), np.arange(4, dtype=np.int64).reshape(2, 2)
    frame = b"".join(bytes(p) for p in pack({"id": 1, "names": ["x", "y"]}, [x, y]))
    jlen, plen = FRAME.unpack(frame[:FRAME.size])
    meta = json.loads(frame[FRAME.size:FRAME.size + jlen])
    got = unpack_tensors(meta, memoryview(frame)[FRAME.size + jlen:])
    assert plen == y.nbytes and got["x"].shape == (0, 16) and got["x"].dtype == np.float32
    np.testing.assert_array_equal(got["y"], y)
