"""scripts/diag_overload_fake.py: the world it builds and what it tells the simulator (CPU)."""

from __future__ import annotations

import math

import pytest

from script_loader import load_script


def test_the_fake_world_is_the_workload_slowed_evenly_and_cut_to_the_max_batch():
    mod = load_script("diag_overload_fake")
    wl0, _ = mod.fake_world(str(mod.ROOT / "examples" / "overload.yaml"), 1.0, 16)
    wl, profiles = mod.fake_world(str(mod.ROOT / "examples" / "overload.yaml"), 4.0, 16)
    assert [m.slo_ms for m in wl.models] == [4.0 * m.slo_ms for m in wl0.models]
    assert set(profiles) == {m.name for m in wl.models}
    from gpuloom.profile.store import ProfileStore

    store = ProfileStore.builtin("h200")
    for name, p in profiles.items():
        assert max(p.batches) == 16 and p.input_shapes == ((4,),)  # one row of 4 floats, as the fake models read
        assert p.latency(8, 132) == pytest.approx(4.0 * store.get(name).latency(8, 132))


def test_the_simulator_is_told_the_lanes_mean_hold_and_their_spread_weighted_by_batches():
    mod = load_script("diag_overload_fake")
    lanes = [{"batches": 300, "gap_ms": 1.0, "hold_p50_ms": 0.5, "hold_p99_ms": 0.5 * math.exp(mod.Z99 * 0.6)},
             {"batches": 100, "gap_ms": 3.0, "hold_p50_ms": 1.0, "hold_p99_ms": 1.0 * math.exp(mod.Z99 * 1.0)}]
    hold, sigma = mod.told_hold(lanes)
    assert hold == pytest.approx(1.5) and sigma == pytest.approx(0.7)
    assert mod.told_hold([{"batches": 10, "gap_ms": 0.4}]) == (pytest.approx(0.4), 0.0)  # no tails kept: no spread
