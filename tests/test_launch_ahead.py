"""Launch-ahead (``Runtime.lookahead_ms``): an exclusive partition takes its next batch shortly before
its running batch is predicted to end, so the device runs the two back to back while the host turns
round. These tests hold the runtime and the execution backend to what that may and may not do, on a
fake device. CPU only, a few seconds."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpuloom.policy import Status, make_policy
from gpuloom.policy.base import ModelInfo, PolicyContext
from gpuloom.profile.synthetic import synthetic_profile
from gpuloom.runtime.core import Runtime
from gpuloom.runtime.host_device import FakeDeviceLayer, FakeModel
from gpuloom.runtime.exec_backend import ExecBackend


class CountingFake(FakeDeviceLayer):
    """Counts the batches each lane holds (launched, not yet finished) and the order they finish in."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}
        self.most_held: dict[int, int] = {}
        self.launched: dict[int, list[int]] = {}  # lane -> batch numbers in launch order
        self.sizes: list[tuple[int, int]] = []  # (batches the lane held before this one, rows in it)
        self.finished: dict[int, list[int]] = {}
        self.n = 0

    def _launch(self, lanes, index, model, rows):
        ticket = super()._launch(lanes, index, model, rows)
        with self.lock:
            self.n += 1
            self.sizes.append((self.held.get(index, 0), len(rows)))
            self.held[index] = self.held.get(index, 0) + 1
            self.most_held[index] = max(self.most_held.get(index, 0), self.held[index])
            self.launched.setdefault(index, []).append(self.n)
            return (index, self.n, ticket)

    def finish(self, ticket):
        index, k, inner = ticket
        try:
            return super().finish(inner)
        finally:
            with self.lock:
                self.held[index] -= 1
                self.finished.setdefault(index, []).append(k)


def one_model_ctx(slo_ms: float = 400.0) -> PolicyContext:
    prof = synthetic_profile("m", per_item_sm_ms=30.0)
    return PolicyContext({"m": ModelInfo("m", prof, slo_ms, 1.0, 2000.0)}, 132, 8, simulated=False)


def serve(policy: str, lookahead_ms: float, *, latency_ms: float = 4.0, n: int = 120, gap_s: float = 0.0002,
          **options):
    dev = CountingFake()
    dev.add_model("m", FakeModel(lambda xs: [xs[0] * 3.0], latency_ms))
    be = ExecBackend(dev, lookahead_ms=lookahead_ms)
    rt = Runtime(make_policy(policy, **options), be, one_model_ctx(), trace=True)
    results: list = []
    rt.start(lambda r, o: results.append((r, o)))
    for i in range(n):
        rt.submit("m", [[np.full(2, float(i), np.float32)]], timeout_ms=2000.0)
        time.sleep(gap_s)
    assert rt.stop(drain=True, timeout_s=20)
    be.close()
    return rt, be, dev, results


def test_an_exclusive_partition_takes_its_next_batch_while_the_running_one_ends():
    # a lookahead longer than any batch: a partition with one batch is always open to a second
    rt, be, dev, results = serve("dstack", lookahead_ms=1000.0)
    assert len(results) == 120 and all(r.status == Status.SERVED for r, _ in results)
    for r, out in results:  # every request still gets its own row back
        np.testing.assert_array_equal(out.outputs[0], np.full(2, 3.0 * r.request.id, np.float32))
    assert max(dev.most_held.values()) == 2, dev.most_held  # ahead by one batch, never more
    for lane, order in dev.finished.items():
        assert order == dev.launched[lane]  # a lane runs its batches in the order they were launched


def test_with_ahead_full_only_batches_of_the_planned_size_are_launched_ahead():
    # dstack:ahead_full=true: a partition offered ahead takes a full batch or waits for its running one
    # (requests arrive faster than a 20 ms batch drains them: full batches are queued in time)
    rt, be, dev, results = serve("dstack", lookahead_ms=5.0, latency_ms=20.0, n=300, gap_s=0.0002, ahead_full=True)
    assert len(results) == 300 and all(r.status == Status.SERVED for r, _ in results)
    cap = rt.policy.cap["m"]
    ahead = [rows for held, rows in dev.sizes if held]
    assert cap > 1 and ahead, (cap, dev.sizes)  # the backlog did fill batches ahead
    assert all(rows == cap for rows in ahead), (cap, ahead)
    # without the option the same run launches smaller batches ahead too
    rt, _, dev, _ = serve("dstack", lookahead_ms=5.0, latency_ms=20.0, n=300, gap_s=0.0002, ahead_full=False)
    assert any(rows < rt.policy.cap["m"] for held, rows in dev.sizes if held), dev.sizes


@pytest.mark.parametrize("value", ["False", "true", 0, 1])
def test_dstack_flags_must_be_real_booleans(value):
    # "False" from a hand-written variant must not read as True
    with pytest.raises(ValueError, match="must be true or false"):
        make_policy("dstack", ahead_full=value)


def test_without_lookahead_a_partition_holds_one_batch():
    _, _, dev, results = serve("dstack", lookahead_ms=0.0)
    assert all(r.status == Status.SERVED for r, _ in results)
    assert max(dev.most_held.values()) == 1


@pytest.mark.parametrize("lookahead_ms", [0.0, 1000.0])
def test_the_backend_counts_which_batches_were_launched_ahead(lookahead_ms):
    # what the bench splits a partition's gap by: batches launched ahead did not leave it idle
    _, be, _, results = serve("dstack", lookahead_ms=lookahead_ms)
    parts = be.stats()["partitions"]
    batches = sum(p["batches"] for p in parts)
    ahead = sum(p["ahead"] for p in parts)
    assert batches >= 1 and len(results) == 120
    if lookahead_ms == 0:
        assert ahead == 0 and all(p["ahead_busy_ms"] == p["ahead_device_ms"] == 0 for p in parts)
    else:  # requests arrive faster than one 4 ms batch: most batches queue behind the running one
        assert ahead >= batches // 2, (ahead, batches)
    for p in parts:
        assert p["busy_ms"] >= p["ahead_busy_ms"] >= p["ahead_device_ms"] >= 0


@pytest.mark.parametrize("policy", ["triton", "clipper", "temporal"])
def test_shared_lanes_never_launch_ahead(policy):
    # their batches slow each other down by amounts no profile predicts: no early launch there
    _, _, dev, results = serve(policy, lookahead_ms=1000.0, n=60)
    assert all(r.status == Status.SERVED for r, _ in results)
    assert max(dev.most_held.values()) == 1


def test_a_batch_launched_ahead_is_timed_from_when_its_lane_came_free():
    # queueing and compute time stay honest: a batch waiting behind another on the device is not
    # counted as computing while it waits
    rt, be, dev, results = serve("dstack", lookahead_ms=1000.0, latency_ms=5.0, n=60, gap_s=0.001)
    spans = sorted({(o.start_ms, o.end_ms) for _, o in results})
    assert len(spans) >= 2
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert s1 >= e0 - 1e-6, f"batch [{s1}, {e1}] overlaps the batch before it [{s0}, {e0}]"
    assert all(o.end_ms - o.start_ms >= 4.5 for _, o in results)  # the fake sleeps 5 ms per batch


def test_the_runtime_opens_a_partition_lookahead_ms_before_its_batch_is_predicted_to_end():
    # one batch of latency L (the profile's) from t: the partition is offered again at t + L - lookahead
    c = one_model_ctx()
    dev = CountingFake()
    # the batch is held on the "device" until the partition's opening time has been read (it is gone
    # once the batch ends): read after a fixed 20 ms, it could be not yet set or gone on a loaded host
    release = threading.Event()
    dev.add_model("m", FakeModel(lambda xs: [xs[0]] if release.wait(30) else [], 50.0))
    be = ExecBackend(dev, lookahead_ms=10.0)
    rt = Runtime(make_policy("dstack"), be, c, trace=True)
    rt.start(lambda r, o: None)
    deadline = time.monotonic() + 10
    while not rt._parts and time.monotonic() < deadline:
        time.sleep(0.01)
    rt.submit("m", [[np.zeros(2, np.float32)]], timeout_ms=2000.0)
    try:
        deadline = time.monotonic() + 30
        while not rt._open_at:
            assert time.monotonic() < deadline, "no partition opened in 30 s"
            time.sleep(0.001)
        lanes = dict(rt._open_at)
    finally:
        release.set()
    assert rt.stop(drain=True, timeout_s=10)
    be.close()
    (index, t_open), = lanes.items()
    d = next(e for e in rt.trace if e.kind == "dispatch")
    part = rt._parts[index] if rt._parts else None
    expect = d.time_ms + c.models["m"].profile.latency(1, part.sms) - 10.0
    assert t_open == pytest.approx(max(expect, d.time_ms), abs=1e-6)


def test_lookahead_must_not_be_negative():
    with pytest.raises(ValueError, match="lookahead_ms must be >= 0"):
        ExecBackend(CountingFake(), lookahead_ms=-1.0)
