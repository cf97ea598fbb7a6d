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
