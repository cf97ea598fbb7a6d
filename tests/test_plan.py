"""The D-STACK planner: schedule invariants, SLOs, fairness under overload, JSON, speed."""

from __future__ import annotations

import json
import itertools
import math
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.bench.workload import load_workload
from gpuloom.plan import (
    Demand,
    PlanError,
    PlanInfeasible,
    Schedule,
    choose_batch,
    fits,
    plan,
    render_gantt,
)
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import synthetic_profile, zoo

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ZOO = ProfileStore(profiles=zoo())
NAMES = [p.model for p in zoo()]


# -- shared invariant checks -----------------------------------------------------------------------
def check_schedule(s: Schedule) -> None:
    """No two slots overlap on any SM at any time; everything lies within the GPU and the cycle."""
    parts = sorted(s.partitions, key=lambda p: p.sm_offset)
    end = 0
    rem = s.gpu_sms % s.granularity
    off = [p for p in parts if p.sms % s.granularity]
    assert len(off) <= 1 and all((p.sms - rem) % s.granularity == 0 for p in off), (
        f"partitions {off} are not multiples of {s.granularity} (only one may add the remainder {rem})"
    )
    for p in parts:
        assert p.sm_offset >= end, f"partitions overlap on SMs: {parts}"
        assert p.sms > 0
        end = p.sm_offset + p.sms
    assert end <= s.gpu_sms
    for p in s.partitions:
        period = p.period(s.cycle_ms)
        assert period > 0 and math.isclose(s.cycle_ms / period, round(s.cycle_ms / period), rel_tol=1e-9)
        t = 0.0
        for slot in sorted(p.slots, key=lambda x: x.start_ms):
            assert slot.start_ms >= t - 1e-9, f"slots overlap in partition {p.index}: {p.slots}"
            assert slot.duration_ms > 0
            t = slot.end_ms
        assert t <= s.cycle_ms + 1e-9, f"partition {p.index} runs past the cycle: {t} > {s.cycle_ms}"
    for m in s.models:
        if m.partition < 0:
            assert m.planned_rps == 0 and m.served_fraction < 1 or m.demand_rps == 0
            continue
        p = s.partitions[m.partition]
        mine = [x for x in p.slots if x.model == m.model]
        assert mine and all(x.batch == m.batch for x in mine)
        assert m.sms == p.sms
        assert m.planned_rps == pytest.approx(len(mine) * m.batch * 1000.0 / s.cycle_ms)
        # the latency bound, recomputed from the slots: one period of waiting + the model's run of slots
        period = p.period(s.cycle_ms)
        first = [x for x in mine if x.start_ms < period - 1e-9]
        span = max(x.end_ms for x in first) - min(x.start_ms for x in first)
        assert m.worst_ms == pytest.approx(period + span)
        assert m.worst_ms <= m.slo_ms + 1e-6, f"{m.model}: worst {m.worst_ms} ms > SLO {m.slo_ms} ms"
    shorts = dict(s.short)
    for m in s.models:
        assert (m.model in shorts) == m.short
        if m.short:
            assert shorts[m.model] == pytest.approx(1.0 - m.served_fraction)


def check_feasible(s: Schedule) -> None:
    assert s.feasible, f"expected a feasible plan:\n{s}"
    for m in s.models:
        assert m.planned_rps >= m.demand_rps - 1e-9, f"{m.model}: {m.planned_rps} < {m.demand_rps}"
        assert m.worst_ms <= m.slo_ms + 1e-9


def min_slo(name: str) -> float:
    return ZOO.get(name).min_latency()


# -- feasible plans ----------------------------------------------------------------------------------
# The examples are calibrated for the measured H200 profiles; the synthetic zoo is 2-3x slower.
ZOO_SCALE = {"mix6": 0.4, "light3": 1.0, "bursty": 1.0, "shift": 0.5}


@pytest.mark.parametrize("name", sorted(ZOO_SCALE))
def test_example_workloads_get_feasible_schedules_meeting_every_slo(name: str) -> None:
    w = load_workload(EXAMPLES / f"{name}.yaml").scaled(ZOO_SCALE[name])
    s = plan(w.demands(), ZOO)
    check_schedule(s)
    check_feasible(s)


def _shipped_h200() -> ProfileStore | None:
    try:
        store = ProfileStore.builtin("h200")
    except Exception:
        return None
    return store if all(n in store for n in NAMES) else None


@pytest.mark.skipif(_shipped_h200() is None, reason="measured H200 profiles not shipped yet")
def test_examples_on_measured_h200_profiles_are_feasible_except_overload() -> None:
    store = _shipped_h200()
    for name in ("mix6", "light3", "bursty", "shift"):
        s = plan(load_workload(EXAMPLES / f"{name}.yaml").demands(), store)
        check_schedule(s)
        check_feasible(s)
    s = plan(load_workload(EXAMPLES / "overload.yaml").demands(), store)
    check_schedule(s)
    assert s.short


demand_lists = st.lists(
    st.tuples(
        st.sampled_from(NAMES),
        st.floats(min_value=1.0, max_value=1500.0),
        st.floats(min_value=2.5, max_value=40.0),  # SLO as a multiple of the model's fastest latency
        st.sampled_from([0.5, 1.0, 2.0]),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda t: t[0],
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand_lists)
def test_any_plan_keeps_slots_disjoint_and_every_planned_model_within_its_slo(spec) -> None:
    demands = [Demand(n, rate, mult * min_slo(n), w) for n, rate, mult, w in spec]
    s = plan(demands, ZOO)
    check_schedule(s)
    if s.feasible:
        check_feasible(s)


@settings(max_examples=40, deadline=None)
@given(demand_lists)
def test_light_load_is_always_feasible(spec) -> None:
    # at most ~3% of the GPU per model and a roomy SLO: must fit
    demands = [Demand(n, min(rate, 20.0), max(mult, 12.0) * min_slo(n), w) for n, rate, mult, w in spec]
    s = plan(demands, ZOO)
    check_schedule(s)
    check_feasible(s)


def test_models_whose_best_option_is_the_whole_gpu_share_it_in_time() -> None:
    big = ProfileStore(
        profiles=[
            synthetic_profile("big_a", per_item_sm_ms=200.0, knee1=132, knee_growth=0.0),
            synthetic_profile("big_b", per_item_sm_ms=200.0, knee1=132, knee_growth=0.0),
        ]
    )
    # each needs the whole GPU to meet its SLO with batch 1, but only about a third of its time
    slo = 4 * (0.1 + 200.0 / 132) + 0.5
    s = plan([Demand("big_a", 150, slo), Demand("big_b", 150, slo)], big)
    check_schedule(s)
    check_feasible(s)
    assert len(s.partitions) == 1 and s.partitions[0].sms == 132
    assert set(s.partitions[0].models) == {"big_a", "big_b"}


def test_the_largest_partition_takes_the_sub_granularity_remainder_unless_told_the_smallest() -> None:
    # on the H200 the leftover SMs run convolutions slowly: spread over the largest partition (run 41)
    demands = load_workload(EXAMPLES / "mix6.yaml").scaled(ZOO_SCALE["mix6"]).demands()
    s = plan(demands, ZOO)
    check_schedule(s)
    assert s.feasible and s.used_sms == 132  # 16 x 8 + the 4 left over
    by_size = sorted(s.partitions, key=lambda p: -p.sms)
    assert by_size[0].sms % 8 == 4 and all(p.sms % 8 == 0 for p in by_size[1:])
    old = plan(demands, ZOO, remainder="smallest")
    check_schedule(old)
    assert old.used_sms == 132 and sorted(old.partitions, key=lambda p: p.sm_offset)[-1].sms % 8 == 4
    with pytest.raises(PlanError, match="remainder must be one of"):
        plan(demands, ZOO, remainder="last")


@pytest.mark.skipif(_shipped_h200() is None, reason="measured H200 profiles not shipped yet")
def test_remainder_sms_never_make_a_partition_of_less_than_min_plus_remainder() -> None:
    # on the H200 an 8 + 4 SM green context failed cuDNN launches (docs/reports/runtime.md)
    store = _shipped_h200()
    seen_small_last = False
    for name in ("mix6", "light3", "bursty", "shift", "overload"):
        wl = load_workload(EXAMPLES / f"{name}.yaml")
        for scale, remainder in itertools.product((0.25, 0.5, 0.75, 1.0), ("largest", "smallest")):
            s = plan(wl.scaled(scale).demands(), store, remainder=remainder)
            check_schedule(s)
            for p in s.partitions:
                if p.sms % 8:
                    assert p.sms >= 16 + 4, (name, scale, p)
            last = sorted(s.partitions, key=lambda p: p.sm_offset)[-1] if s.partitions else None
            seen_small_last |= last is not None and last.sms == 8
    assert seen_small_last  # the rule was exercised: some plan ends with a small partition


@pytest.mark.skipif(_shipped_h200() is None, reason="measured H200 profiles not shipped yet")
def test_min_sms_keeps_small_partitions_out_and_the_plan_valid() -> None:
    """mix6 x0.5 on the H200 profiles plans two 8-SM partitions (the layout that served worst on the
    H200, runs 20-23); with ``min_sms=16`` no partition is smaller and the demand is still met."""
    wl = load_workload(EXAMPLES / "mix6.yaml").scaled(0.5)
    store = _shipped_h200()
    plain = plan(wl.demands(), store, gpu_sms=132, granularity=8)
    assert min(p.sms for p in plain.partitions) == 8  # the case the option exists for
    big = plan(wl.demands(), store, gpu_sms=132, granularity=8, min_sms=16)
    check_schedule(big)
    check_feasible(big)
    assert min(p.sms for p in big.partitions) >= 16
    for name, spec in ZOO_SCALE.items():  # any workload: every partition at least min_sms
        s = plan(load_workload(EXAMPLES / f"{name}.yaml").scaled(spec).demands(), ZOO, min_sms=24)
        check_schedule(s)
        assert all(p.sms >= 24 for p in s.partitions), (name, s.partitions)
    with pytest.raises(PlanError, match="min_sms"):
        plan(wl.demands(), store, min_sms=-8)


@pytest.mark.skipif(_shipped_h200() is None, reason="measured H200 profiles not shipped yet")
def test_dstack_plans_no_partition_under_16_sms_unless_told_and_never_more_than_the_gpu_has() -> None:
    """dstack's default floor (two same-run A/Bs on the H200: the 8-SM layout served worse) keeps
    mix6 x0.5 off 8-SM partitions; ``min_sms=0`` plans them again; a GPU smaller than the floor is
    planned whole rather than refused."""
    from gpuloom.policy import make_policy
    from gpuloom.policy.base import ModelInfo, PolicyContext
    from gpuloom.policy.dstack import DEFAULT_MIN_SMS

    store = _shipped_h200()

    def context(scale: float, gpu_sms: int = 132) -> PolicyContext:
        wl = load_workload(EXAMPLES / "mix6.yaml").scaled(scale)
        models = {d.model: ModelInfo(d.model, store.get(d.model), d.slo_ms, d.weight, d.rate) for d in wl.demands()}
        return PolicyContext(models, gpu_sms, 8, simulated=False)

    def exclusive_sms(layout) -> list[int]:
        return [p.sms for p in layout.partitions if not p.shared]

    assert DEFAULT_MIN_SMS == 16
    # planning no hold (on a real device dstack plans 1.125 ms a batch, and its larger batches need no
    # 8-SM partitions): that plan wants 8-SM partitions at mix6 x0.5
    assert min(exclusive_sms(make_policy("dstack", batch_overhead_ms=0).setup(context(0.5)))) >= 16
    assert min(exclusive_sms(make_policy("dstack", min_sms=0, batch_overhead_ms=0).setup(context(0.5)))) == 8
    small = make_policy("dstack").setup(context(0.05, gpu_sms=8))  # 8 SMs: one partition, not a PlanError
    assert exclusive_sms(small) == [8]


@pytest.mark.skipif(_shipped_h200() is None, reason="measured H200 profiles not shipped yet")
def test_dstack_lays_out_no_partition_under_min_sms_and_rejects_a_bad_value() -> None:
    """``gpuloom bench --policy dstack:min_sms=16``: the option reaches the policy's plans."""
    from gpuloom.bench.experiment import make_context
    from gpuloom.policy.dstack import DStackPolicy

    wl = load_workload(EXAMPLES / "mix6.yaml").scaled(0.5)
    store = _shipped_h200()
    profs = {m.name: store.get(m.name) for m in wl.models}
    sizes = {ms: sorted(p.sms for p in DStackPolicy(min_sms=ms).setup(make_context(wl, profs)).partitions)
             for ms in (0, 16)}
    assert sizes[0][0] == 8 and sizes[16][0] >= 16, sizes
    with pytest.raises(ValueError, match="min_sms"):
        DStackPolicy(min_sms=8.5)


def test_zero_rate_models_get_no_slots_and_count_as_served() -> None:
    s = plan([Demand("resnet50", 0.0, 25.0), Demand("vgg16", 50.0, 100.0)], ZOO)
    check_schedule(s)
    assert s.model("resnet50").partition == -1 and s.model("resnet50").served_fraction == 1.0
    assert s.feasible


def test_headroom_plans_extra_capacity() -> None:
    d = [Demand("resnet50", 500.0, 25.0)]
    assert plan(d, ZOO, headroom=0.3).model("resnet50").planned_rps >= 650.0


def test_batch_overhead_is_planned_into_every_slot() -> None:
    """A batch holds its partition for L(b, s) + overhead; the plan stays valid with it and serves the
    same demand with at least as much partition time."""
    demands = load_workload(EXAMPLES / "mix6.yaml").scaled(ZOO_SCALE["mix6"] * 0.5).demands()
    plain, padded = plan(demands, ZOO), plan(demands, ZOO, batch_overhead_ms=1.0)
    check_schedule(padded)
    assert padded.feasible
    for mp in padded.models:
        prof = ZOO.get(mp.model)
        assert mp.latency_ms == pytest.approx(prof.latency(mp.batch, mp.sms) + 1.0)
        assert mp.worst_ms <= mp.slo_ms + 1e-6  # the SLO bound holds with the overhead in it
    for part in padded.partitions:
        for slot in part.slots:
            assert slot.duration_ms == pytest.approx(ZOO.get(slot.model).latency(slot.batch, part.sms) + 1.0)

    def busy(s: Schedule) -> float:  # SM-ms per cycle the slots take
        return sum(p.sms * sl.duration_ms for p in s.partitions for sl in p.slots) / s.cycle_ms

    assert busy(padded) >= busy(plain) - 1e-6


def test_a_large_batch_overhead_can_make_a_demand_infeasible() -> None:
    d = [Demand("mobilenet_v2", 3000.0, 10.0)]
    assert fits(d, ZOO)
    assert not fits(d, ZOO, batch_overhead_ms=9.0)  # no batch can run within the SLO any more
    with pytest.raises(PlanError, match="batch_overhead_ms"):
        plan(d, ZOO, batch_overhead_ms=-1.0)


# -- overload and fairness ---------------------------------------------------------------------------
def _overload(factor: float = 2.5, weights=None) -> list[Demand]:
    base = load_workload(EXAMPLES / "mix6.yaml").scaled(ZOO_SCALE["mix6"]).demands()
    weights = weights or {}
    return [Demand(d.model, d.rate * factor, d.slo_ms, weights.get(d.model, 1.0)) for d in base]


def check_max_min(demands: list[Demand], s: Schedule, step: float = 0.02) -> None:
    """The checkable form of weighted max-min fairness on served fraction of demand.

    1. Pareto: no short model can get ``step`` more of its demand while every other model keeps
       what it is served (the planner's packing search, ``fits``, cannot place that ask).
    2. The floor cannot rise: asking every model for ``min(1, weight * level)`` with ``level``
       ``step`` above the lowest weighted served fraction among short models is infeasible.
    """
    by = {d.model: d for d in demands}
    served = {m.model: m.served_fraction for m in s.models}
    shorts = [m for m in s.models if m.short and m.model in by]
    assert shorts
    for m in shorts:
        ask = [
            Demand(n, by[n].rate * (min(1.0, served[n] + step) if n == m.model else served[n]), by[n].slo_ms, by[n].weight)
            for n in by
        ]
        assert not fits(ask, ZOO), f"{m.model} could get more without hurting anyone"
    level = min(served[m.model] / by[m.model].weight for m in shorts) + step + 1e-9
    ask = [Demand(n, d.rate * min(1.0, d.weight * level), d.slo_ms, d.weight) for n, d in by.items()]
    assert all(a.rate > 0 for a in ask)
    assert not fits(ask, ZOO), f"every model could be raised to weighted level {level}"


@pytest.mark.parametrize("factor", [1.7, 2.5, 6.0])
def test_overload_is_weighted_max_min_fair_and_reports_short_models(factor: float) -> None:
    demands = _overload(factor)
    s = plan(demands, ZOO)
    check_schedule(s)
    assert not s.feasible and s.short
    check_max_min(demands, s)
    # equal weights: nobody is served much less than anybody else who is also short
    fr = [m.served_fraction for m in s.models if m.short]
    assert max(fr) - min(fr) < 0.35


def test_higher_weight_gets_a_larger_served_fraction() -> None:
    demands = _overload(3.0, weights={"resnet50": 3.0})
    s = plan(demands, ZOO)
    check_schedule(s)
    check_max_min(demands, s)
    others = [m.served_fraction for m in s.models if m.model != "resnet50" and m.short]
    assert s.model("resnet50").served_fraction > max(others)


def test_overload_example_reports_short_models_worst_first() -> None:
    w = load_workload(EXAMPLES / "overload.yaml")
    s = plan(w.demands(), ZOO)
    check_schedule(s)
    assert [f for _, f in s.short] == sorted((f for _, f in s.short), reverse=True)
    assert s.model("bert_base").served_fraction > s.model("resnet50").served_fraction  # weight 2


# -- batch-size optimizer ----------------------------------------------------------------------------
@pytest.mark.parametrize("rate, slo", [(50.0, 30.0), (800.0, 20.0), (3000.0, 15.0)])
def test_choose_batch_meets_the_slo_and_maximizes_throughput_per_sm(rate: float, slo: float) -> None:
    prof = ZOO.get("resnet50")
    sms = list(range(8, 133, 8))
    b, s, lat = choose_batch(prof, rate, slo, sms)
    assert b * 1000.0 / rate + lat <= slo + 1e-9
    assert lat == prof.latency(b, s)
    feasible = [
        (bb, ss) for ss in sms for bb in prof.batches
        if bb * 1000.0 / rate + prof.latency(bb, ss) <= slo and bb * 1000.0 / prof.latency(bb, ss) >= rate
    ]
    if feasible:
        best = max(bb * 1000.0 / prof.latency(bb, ss) / ss for bb, ss in feasible)
        assert b * 1000.0 / lat / s == pytest.approx(best)


def test_choose_batch_rejects_impossible_slo_and_bad_input() -> None:
    prof = ZOO.get("vgg16")
    with pytest.raises(PlanInfeasible, match="SLO"):
        choose_batch(prof, 100.0, prof.min_latency() * 0.5, [132])
    with pytest.raises(PlanError):
        choose_batch(prof, 0.0, 50.0, [132])


def test_plan_rejects_unknown_and_repeated_models() -> None:
    with pytest.raises(PlanError, match="nosuch"):
        plan([Demand("nosuch", 10, 10)], ZOO)
    with pytest.raises(PlanError, match="repeated"):
        plan([Demand("vgg16", 10, 100), Demand("vgg16", 20, 100)], ZOO)
    with pytest.raises(PlanError, match="rate"):
        Demand("vgg16", -1, 100)


def test_a_model_whose_slo_no_cycle_can_meet_is_reported_short_not_dropped() -> None:
    fastest = min_slo("vgg16")
    s = plan([Demand("vgg16", 10, fastest * 1.05), Demand("resnet50", 100, 25)], ZOO)
    check_schedule(s)
    assert s.model("vgg16").served_fraction == 0.0 and dict(s.short)["vgg16"] == 1.0
    assert not s.model("resnet50").short


# -- serialization, rendering, speed -----------------------------------------------------------------
def test_schedule_json_round_trip() -> None:
    for d in (load_workload(EXAMPLES / "mix6.yaml").demands(), _overload(2.0)):
        s = plan(d, ZOO)
        back = Schedule.from_json(json.loads(json.dumps(s.to_json())))
        assert back == s
        assert back.to_json()["schema"] == "gpuloom.schedule/1"
        assert str(back) == str(s)
    with pytest.raises(PlanError, match="schema"):
        Schedule.from_json({"schema": "gpuloom.schedule/0"})


def test_gantt_png_is_written(tmp_path: Path) -> None:
    s = plan(load_workload(EXAMPLES / "mix6.yaml").demands(), ZOO)
    out = tmp_path / "g.png"
    render_gantt(s, str(out), cycles=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def _ten_models() -> ProfileStore:
    extra = [
        synthetic_profile(f"m{i}", per_item_sm_ms=10.0 + 15 * i, knee1=32 + 8 * i, knee_growth=0.3)
        for i in range(4)
    ]
    return ProfileStore(profiles=[*zoo(), *extra])


def test_planning_ten_models_takes_under_100_ms() -> None:
    store = _ten_models()
    demands = [Demand(p.model, 30.0 + 10 * i, 8 * p.min_latency() + 10, 1.0) for i, p in enumerate(store)]
    assert len(demands) == 10
    times = []
    for _ in range(3):
        t = time.perf_counter()
        s = plan(demands, store)
        times.append(time.perf_counter() - t)
    check_schedule(s)
    assert s.feasible
    assert min(times) < 0.100, f"planning 10 models took {min(times) * 1000:.1f} ms"


def test_planning_ten_models_under_overload_stays_interactive() -> None:
    store = _ten_models()
    demands = [Demand(p.model, 400.0, 8 * p.min_latency() + 10, 1.0) for p in store]
    took = []
    for _ in range(2):  # the planner's own CPU time, the faster of two: on CI's two busy cores the wall
        t = time.thread_time()  # clock read 1.12 s where the thread's CPU time was 0.37 s
        s = plan(demands, store)
        took.append(time.thread_time() - t)
    check_schedule(s)
    assert not s.feasible
    assert min(took) < 1.0, f"overloaded 10-model plan took {min(took) * 1000:.0f} ms of CPU"


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(NAMES),
            st.floats(min_value=300.0, max_value=3000.0),
            st.floats(min_value=6.0, max_value=40.0),
            st.sampled_from([0.5, 1.0, 2.0]),
        ),
        min_size=2,
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
def test_fairness_rule_holds_for_random_overloads(spec) -> None:
    demands = [Demand(n, rate, mult * min_slo(n), w) for n, rate, mult, w in spec]
    s = plan(demands, ZOO)
    check_schedule(s)
    if any(m.short and m.served_fraction > 0 for m in s.models):
        check_max_min([d for d in demands if s.model(d.model).served_fraction > 0], s)
