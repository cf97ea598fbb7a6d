"""The front-end workers' return allowance (``gpuloom.serve.allowance``): the estimator, the server's
setting, and the ``waited_ms`` the runtime receives through real workers. CPU only."""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402

from gpuloom.serve import arena, ring  # noqa: E402
from gpuloom.serve.allowance import ReturnAllowance  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.protocol import parse_server_timing  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"


# -- the estimator ---------------------------------------------------------------------------------
def test_the_allowance_is_zero_until_32_samples_then_their_median():
    a = ReturnAllowance()
    samples = [float(x) for x in range(1, 33)]  # median 16.5
    for x in samples[:31]:
        a.add(x)
        assert a.ms == 0.0
    a.add(samples[31])
    assert a.ms == statistics.median(samples) == 16.5


def test_the_median_is_of_the_last_128_samples_and_recomputed_every_32_only():
    a = ReturnAllowance()
    for _ in range(128):
        a.add(1.0)
    assert a.ms == 1.0
    for _ in range(31):  # not recomputed yet
        a.add(10.0)
    assert a.ms == 1.0
    a.add(10.0)  # 32 of 10 among the last 128
    assert a.ms == 1.0
    for _ in range(32):  # 64 and 64
        a.add(10.0)
    assert a.ms == 5.5
    for _ in range(32):  # the last 128: 32 ones, 96 tens
        a.add(10.0)
    assert a.ms == 10.0
    for _ in range(32):  # no one left among the last 128
        a.add(10.0)
    assert a.ms == 10.0


def test_one_stalled_sample_does_not_move_it_and_many_are_capped_at_50_ms():
    a = ReturnAllowance()
    for _ in range(31):
        a.add(2.0)
    a.add(5_000.0)  # one reply that waited out a pause
    assert a.ms == 2.0
    for _ in range(128):
        a.add(400.0)
    assert a.ms == 50.0 == a.cap_ms


def test_negative_and_nan_samples_neither_go_below_zero_nor_count():
    a = ReturnAllowance()
    for _ in range(32):
        a.add(-1.0)
    assert a.ms == 0.0
    a = ReturnAllowance()
    for _ in range(31):
        a.add(3.0)
    a.add(float("nan"))  # not a sample: the 32nd is still to come
    assert a.ms == 0.0
    a.add(3.0)
    assert a.ms == 3.0


def test_a_window_of_drops_in_a_row_starts_it_again_from_zero():
    """Requests the allowance itself may get dropped (each counted out of time) bring no sample that
    could lower it: after 128 drops in a row it starts again from 0, and again needs 32 samples."""
    a = ReturnAllowance()
    for _ in range(32):
        a.add(40.0)
    for _ in range(127):
        a.miss()
    a.add(40.0)  # a success between: the run of failures starts again
    for _ in range(127):
        a.miss()
    assert a.ms == 40.0
    a.miss()
    assert a.ms == 0.0
    for _ in range(31):
        a.add(7.0)
    assert a.ms == 0.0
    a.add(7.0)
    assert a.ms == 7.0  # the samples before the reset are gone


def test_a_window_or_cadence_that_cannot_work_is_refused():
    for kw in ({"every": 0}, {"every": 200}, {"cap_ms": -1.0}):
        with pytest.raises(ValueError, match="expected 0 < every <= window"):
            ReturnAllowance(**kw)


# -- the server's setting ----------------------------------------------------------------------------
def test_the_server_takes_auto_or_off_and_says_what_else_is_wrong():
    core = ServeCore(serve_fake.FakeService(), None)
    assert Server(core, http_workers=1).return_allowance == "off"  # until an A/B on the GPU
    assert Server(core, http_workers=1, return_allowance="auto").return_allowance == "auto"
    for bad in ("on", "", None, True):
        with pytest.raises(ValueError, match=r"return_allowance: expected one of \('auto', 'off'\)"):
            Server(core, http_workers=1, return_allowance=bad)


def test_the_worker_refuses_a_mode_it_does_not_know():
    pytest.importorskip("aiohttp")
    from gpuloom.serve.frontend import build_worker_app, main

    with pytest.raises(ValueError, match="return_allowance: expected one of"):
        build_worker_app("/nonexistent", "http://127.0.0.1:1", 1 << 20, return_allowance="on")
    with pytest.raises(SystemExit):
        main(["--socket", "s", "--host", "h", "--port", "1", "--upstream", "u", "--max-body", "1",
              "--return-allowance", "on"])


# -- through real workers ----------------------------------------------------------------------------
DELAY_MS = 20.0  # added to each reply on its way back, outside the service's clock
REQUESTS = 40


def _infer(url: str, x: np.ndarray) -> dict[str, float]:
    """One request; its Server-Timing (ms by name). HTTPError for an error status."""
    body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    req = urllib.request.Request(f"http://{url}/v2/models/tiny_mlp/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()
        return parse_server_timing(r.headers.get("Server-Timing"))


def _status(url: str, x: np.ndarray) -> int:
    import urllib.error

    try:
        _infer(url, x)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def _slow_replies(monkeypatch, delay_ms: float = DELAY_MS) -> None:
    """Every successful reply waits ``delay_ms`` on its way back to the worker, after the service's
    time was taken: through the reply ring (a compact record) and over the socket (a frame) alike."""
    from gpuloom.serve import bridge, wire

    record, frame = wire._ReplyEncoder.record, bridge.InferBridge._ok_frame

    def slow_record(self, *a):
        time.sleep(delay_ms / 1e3)
        return record(self, *a)

    def slow_frame(*a):
        time.sleep(delay_ms / 1e3)
        return frame(*a)

    monkeypatch.setattr(wire._ReplyEncoder, "record", slow_record)
    monkeypatch.setattr(bridge.InferBridge, "_ok_frame", staticmethod(slow_frame))


def _record_waited(core: ServeCore) -> list[float]:
    """The ``waited_ms`` of each request the bridge submits to ``core``, in order."""
    seen: list[float] = []
    real = core.submit

    def submit(name, version, inputs, deadline_ms, waited_ms=0.0, checked_for=None, on_done=None):
        seen.append(waited_ms)
        return real(name, version, inputs, deadline_ms, waited_ms, checked_for=checked_for, on_done=on_done)

    core.submit = submit
    return seen


@pytest.mark.skipif(not arena.supported(), reason="no memfd_create on this platform")
@pytest.mark.parametrize("ring_kb", [256, 0], ids=["ring", "socket"])
def test_the_runtime_counts_the_workers_return_allowance_as_waited(ring_kb, monkeypatch):
    """With ``return_allowance="auto"`` a worker's first 32 requests carry their handler time only;
    from the 33rd on, also the median of the replies' time outside the service (here at least
    ``DELAY_MS``, and at least the Server-Timing's bridge minus service, which that time contains).
    With "off" every request carries its handler time only. Through the rings and over the socket."""
    if ring_kb and not ring.supported():
        pytest.skip("shared rings need x86-64 Linux")
    _slow_replies(monkeypatch)
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    x = np.ones((1, 16), np.float32)
    try:
        for mode in ("off", "auto"):
            core = ServeCore(service, repo)  # (a stopped server's core stays closing)
            waited = _record_waited(core)
            server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=16,
                            worker_ring_kb=ring_kb, close_service=False, return_allowance=mode)
            addr = server.start()
            try:
                timings = [_infer(addr.http_url, x) for _ in range(REQUESTS)]
                bridge = server._bridge
                assert (bridge.ring_requests > 0) == bool(ring_kb)
            finally:
                server.stop()
            assert len(waited) == REQUESTS
            assert all(0 <= w < DELAY_MS for w in waited[:32]), waited  # the plain handler time
            if mode == "off":
                assert all(w < DELAY_MS for w in waited[32:]), waited
                continue
            outside = statistics.median(t["bridge"] - t["service"] for t in timings[:32])
            assert outside >= DELAY_MS
            later = waited[32:]
            assert min(later) >= outside and max(later) <= 50.0 + DELAY_MS, (outside, waited)
    finally:
        service.close()


@pytest.mark.skipif(not arena.supported(), reason="no memfd_create on this platform")
def test_a_return_time_past_the_slo_is_capped_and_the_drops_it_causes_start_it_again(monkeypatch):
    """Replies that take 80 ms outside the service: the allowance stops at 50 ms, which is tiny_mlp's
    whole SLO, so the runtime drops every request from the 33rd on (504); after 128 drops in a row
    the worker starts its estimate again from 0, and the next request is served."""
    _slow_replies(monkeypatch, 80.0)
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    assert service.config("tiny_mlp").slo_ms == 50.0
    waited = _record_waited(core)
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=16,
                    return_allowance="auto")
    addr = server.start()
    x = np.ones((1, 16), np.float32)
    try:
        statuses = [_status(addr.http_url, x) for _ in range(32 + 128 + 2)]
    finally:
        server.stop()
    assert statuses == [200] * 32 + [504] * 128 + [200] * 2, statuses
    assert all(50.0 <= w < 50.0 + DELAY_MS for w in waited[32:160]), waited  # the cap, plus the handler's time
    assert all(w < DELAY_MS for w in waited[160:]), waited
