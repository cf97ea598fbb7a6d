"""scripts/sim_measured_hold.py: what it reads off a measured point (CPU)."""

from __future__ import annotations

import pytest

from script_loader import load_script


def test_the_lanes_idle_time_per_batch_is_weighted_by_their_batches():
    mod = load_script("sim_measured_hold")
    # 5 s: one lane idle 10% over 1,000 batches (0.5 ms each), one idle 40% over 500 (4 ms each)
    point = {"duration_s": 5.0, "layouts": [{"batches": 1000, "busy_ratio": 0.9}, {"batches": 500, "busy_ratio": 0.6},
                                            {"batches": 0, "busy_ratio": 0.0}]}
    assert mod.idle_per_batch(point) == pytest.approx((1000 * 0.5 + 500 * 4.0) / 1500)
    assert mod.idle_per_batch({"duration_s": 5.0, "layouts": [{"batches": 0, "busy_ratio": None}]}) == 0.0
