"""scripts/sim_host_calibrated.py: the holds it reads per load, and its trend (CPU)."""

from __future__ import annotations

import pytest

from script_loader import load_script


def _report(points):
    """[(policy, load, attainment, [lane holds])] as a bench report's policies."""
    pols: dict = {}
    for pol, scale, att, holds in points:
        pols.setdefault(pol, {"points": []})["points"].append(
            {"scale": scale, "slo_attainment": att, "layouts": [{"hold_p50_ms": h} for h in holds]})
    return {"policies": pols}


def test_the_holds_are_read_per_held_load_over_every_policy():
    mod = load_script("sim_host_calibrated")
    rep = _report([("dstack", 1.0, 1.0, [0.2, 0.4]), ("triton", 1.0, 0.995, [0.3]), ("dstack", 0.5, 0.999, [0.1]),
                   ("triton", 2.0, 0.8, [5.0])])  # x2 did not hold: its hold is queueing
    assert mod.held_holds(rep) == [(0.5, 0.1), (1.0, 0.3)]
    s0, h0, s1, slope = mod.trend(rep)
    assert (s0, h0, s1) == (0.5, 0.1, 1.0) and slope == pytest.approx(0.4)


def test_a_hold_that_falls_with_the_load_has_no_trend_and_one_load_none():
    mod = load_script("sim_host_calibrated")
    falling = _report([("dstack", 1.0, 1.0, [0.5]), ("dstack", 1.5, 1.0, [0.3])])
    assert mod.trend(falling) == (1.0, 0.5, 1.5, 0.0)
    assert mod.trend(_report([("dstack", 1.0, 1.0, [0.5]), ("dstack", 1.5, 0.9, [0.9])])) is None
