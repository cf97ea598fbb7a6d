"""gpuloom.bench.host_hold: a bench report's lane holds, the preset fitted on hosts like it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuloom.bench.host_hold import PRESET_HOST_HOLD_MS, hold_line, host_hold, lane_holds

ROOT = Path(__file__).resolve().parent.parent


def _report(points: dict[str, list[tuple[float, list[float]]]]) -> dict:
    """policy -> [(attainment, [each lane's p50 hold])]"""
    return {"policies": {name: {"points": [{"slo_attainment": att, "layouts": [{"hold_p50_ms": h} for h in holds]}
                                           for att, holds in pts]} for name, pts in points.items()}}


def test_only_points_that_held_count_and_the_nearest_preset_is_named():
    rep = _report({"dstack": [(1.0, [0.2, 0.3]), (0.5, [5.0, 6.0])], "triton": [(0.995, [0.25])]})
    assert sorted(lane_holds(rep)) == [0.2, 0.25, 0.3]  # past the edge a hold is queueing: left out
    assert host_hold(rep) == {"median_ms": 0.25, "lanes": 3, "nearest_preset": "h100-fast-host"}
    slow = host_hold(_report({"triton": [(1.0, [0.55, 0.6, 0.7])]}))
    assert slow["nearest_preset"] == "h200"
    assert host_hold(_report({"dstack": [(0.9, [0.3])]})) is None  # nothing held: nothing to say
    assert host_hold({"policies": {"dstack": {"points": [{"slo_attainment": 1.0, "layouts": [{}]}]}}}) is None


def test_the_line_names_the_nearer_preset_only_where_the_points_used_another():
    fast = {"median_ms": 0.24, "lanes": 12, "nearest_preset": "h100-fast-host"}
    assert "nearer this host: --contention h100-fast-host" in hold_line(fast, "h200")
    assert "nearer" not in hold_line(fast, "h100-fast-host")
    assert "nearer" not in hold_line(fast, "plain")  # the knee model has no host hold to compare
    assert "0.24 ms" in hold_line(fast, "h200") and "12 lanes" in hold_line(fast, "h200")


@pytest.mark.parametrize("name, preset", [("bench_light3_h100_run173_every_policy.json", "h100-fast-host"),
                                          ("bench_mix6_h100_run171_edge.json", "h100-fast-host"),
                                          ("bench_mix6_h100_run167_edge.json", "h200"),
                                          ("bench_mix6_h200_run70_views_aba.json", "h200")])
def test_the_runs_each_preset_was_fitted_on_point_to_it(name, preset):
    rep = json.loads((ROOT / "docs/results/runtime" / name).read_text())
    assert host_hold(rep)["nearest_preset"] == preset


def test_every_preset_with_a_host_hold_is_a_contention_preset():
    from gpuloom.commands.simulate import CONTENTION_PRESETS

    assert set(PRESET_HOST_HOLD_MS) <= set(CONTENTION_PRESETS)


def _scaled(points: dict[str, list[tuple[float, float, list[float]]]]) -> dict:
    """policy -> [(scale, attainment, [each lane's p50 hold])]"""
    return {"policies": {name: {"points": [{"scale": s, "slo_attainment": att,
                                            "layouts": [{"hold_p50_ms": h} for h in holds]}
                                           for s, att, holds in pts]} for name, pts in points.items()}}


def test_the_calibration_is_the_lowest_load_held_with_every_policys_lanes_there():
    from gpuloom.bench.host_hold import calibration_point

    rep = _scaled({"dstack": [(0.5, 0.9, [0.1]), (1.0, 1.0, [0.3, 0.5]), (2.0, 1.0, [9.0])],
                   "triton": [(1.0, 0.995, [0.4]), (0.75, 0.98, [0.2])]})
    # x0.5 and x0.75 did not hold; at x1 both policies' three lanes count
    assert calibration_point(rep) == (1.0, 0.4, 3)
    assert calibration_point(rep, target=0.9) == (0.5, 0.1, 1)
    assert calibration_point(_scaled({"dstack": [(1.0, 0.5, [0.3])]})) is None
    no_holds = {"policies": {"dstack": {"points": [{"scale": 1.0, "slo_attainment": 1.0, "layouts": [{}]}]}}}
    assert calibration_point(no_holds) is None


def test_a_host_holding_like_a_presets_hosts_is_simulated_like_that_preset():
    from gpuloom.bench.host_hold import host_contention
    from gpuloom.runtime.sim import ContentionModel

    for name, preset in (("h200", ContentionModel.h200_runs), ("h100-fast-host", ContentionModel.h100_fast_host)):
        got, want = host_contention(PRESET_HOST_HOLD_MS[name]), preset()
        assert abs(got.batch_overhead_ms - want.batch_overhead_ms) <= 0.01
        assert got.hold_per_ms == want.hold_per_ms and got.demand_fraction == want.demand_fraction
    assert host_contention(1.0).batch_overhead_ms > host_contention(0.5).batch_overhead_ms
    with pytest.raises(ValueError, match="hold >= 0"):
        host_contention(-0.1)
    with pytest.raises(ValueError, match="hold >= 0"):
        host_contention(float("nan"))


def test_a_report_simulated_again_with_its_hosts_hold_scores_only_the_loads_above_it():
    from gpuloom.bench.host_hold import host_contention
    from gpuloom.bench.resimulate import WITHIN, add_host_resimulation, scored, simulate_report_point
    from gpuloom.bench.e2e import planned_profiles
    from gpuloom.bench.workload import workload_from_dict
    from gpuloom.profile.store import ProfileStore

    rep = json.loads((ROOT / "docs/results/runtime/bench_light3_h100_run176_hold_ab_0.json").read_text())
    store = ProfileStore.builtin("h200")
    res = add_host_resimulation(rep, store)
    cal = rep["host_calibration"]
    points = rep["policies"]["dstack"]["points"]
    low = min(p["scale"] for p in points if p["slo_attainment"] >= 0.99)
    assert cal["scale"] == low and res["calibration"]["scale"] == low
    assert [p["sim_host"]["held_out"] for p in points] == [p["scale"] > low for p in points]
    # each column is the point simulated with the host's hold, as a script would simulate it
    wl, profs = workload_from_dict(rep["workload"]), planned_profiles(rep, store, "dstack")
    p = points[-1]
    want = simulate_report_point(rep, wl, profs, "dstack", p["scale"], host_contention(cal["hold_ms"]), p.get("plan"))
    assert p["sim_host"]["goodput_rps"] == pytest.approx(want.goodput_rps)
    assert p["sim_host"]["goodput_error"] == pytest.approx(want.goodput_rps / p["goodput_rps"] - 1)
    # the summary counts the scored points above the calibration, and each column's within 10%
    held_out = [q for q in points if q["sim_host"]["held_out"] and scored(q)]
    assert cal["scored"] == len(held_out) > 0
    assert cal["within_10pct_host"] == sum(abs(q["sim_host"]["goodput_error"]) <= WITHIN for q in held_out)
    assert cal["within_10pct_preset"] == sum(abs(q["sim"]["goodput_error"]) <= WITHIN for q in held_out)
    assert cal["yield_answers"] is False
    # a report whose process ran with GPULOOM_YIELD_ANSWERS is simulated again with the option's model
    rep["meta"]["gpuloom_settings"] = {"GPULOOM_YIELD_ANSWERS": "1"}
    assert add_host_resimulation(rep, store)["calibration"]["yield_answers"] is True


def test_the_bench_line_gives_the_simulate_flags_of_this_host():
    from gpuloom.bench.resimulate import host_line

    res = {"calibration": {"scale": 0.8125, "hold_ms": 0.642, "lanes": 9, "batch_overhead_ms": 0.757},
           "summary": {"scored": 13, "within_10pct_host": 11, "within_10pct_preset": 10}}
    line = host_line(res, "h200")
    assert "above x0.8125 (13 points): 11 told this host's hold (0.64 ms" in line
    assert "10 with --contention h200" in line
    # a report that ran without the yield option: gpuloom simulate simulates it on unless told
    assert line.endswith("--contention h100-fast-host --batch-overhead-ms 0.757 --no-yield-answers")
    none = host_line({**res, "summary": {"scored": 0, "within_10pct_host": 0, "within_10pct_preset": 0}}, "h200")
    assert "no higher load" in none and none.endswith("--batch-overhead-ms 0.757 --no-yield-answers")
    yielding = {**res, "calibration": {**res["calibration"], "yield_answers": True}}
    assert host_line(yielding, "h200").endswith("--batch-overhead-ms 0.757")


def test_a_point_where_most_requests_drop_is_told_its_hosts_time_per_drop_read_off_its_loop():
    """The overload holds no load, so sim_host was not computed; the preset's fixed 0.04 ms per drop
    put nexus +88.8% off on run 204's host. Where most requests that entered were dropped, sim_host
    now takes the host's time per drop from the point's runtime loop CPU (DROP_MS_PER_LOOP_US, fitted
    on runs 173 and 183): -7.6% there (held out)."""
    from gpuloom.bench.host_hold import DROP_MS_PER_LOOP_US, loop_us_per_request
    from gpuloom.bench.resimulate import DROP_DOMINATED, add_host_resimulation, host_line, point_drop_ms
    from gpuloom.profile.store import ProfileStore

    rep = json.loads((ROOT / "docs/results/runtime/bench_overload_h100_run204_nexus_gslice.json").read_text())
    nexus = rep["policies"]["nexus"]["points"][0]
    assert abs(nexus["sim"]["goodput_error"]) > 0.5  # the preset's column, as the run printed it
    want = round(DROP_MS_PER_LOOP_US * loop_us_per_request(nexus), 4)
    assert point_drop_ms(nexus) == want
    few = {**nexus, "models": [{**m, "dropped": int(m["submitted"] * DROP_DOMINATED) - 1} for m in nexus["models"]]}
    assert point_drop_ms(few) is None  # where drops do not dominate, the loop's CPU is mostly batches'
    res = add_host_resimulation(rep, ProfileStore.builtin("h200"))
    assert res is not None and rep["host_calibration"]["hold_ms"] is None  # no load held
    sim = rep["policies"]["nexus"]["points"][0]["sim_host"]
    assert sim["host_drop_ms"] == want and sim["held_out"] and abs(sim["goodput_error"]) <= 0.10
    assert "no load held" in host_line(res, "h100-fast-host")
