"""scripts/calibrate_sim.py's rules: points whose load generator fell behind, the best setting of a grid."""

from __future__ import annotations

import pytest
from script_loader import load_script as _load


def load_script():
    return _load("calibrate_sim")


def test_a_point_counts_as_late_by_its_flag_else_by_its_lateness_else_not():
    from gpuloom.bench.e2e import LATE_LIMIT_MS

    cal = load_script()
    assert cal.client_late({"offered_as_scheduled": False}) is True
    assert cal.client_late({"offered_as_scheduled": True, "arrivals": {"late_ms": {"p99": 5000}}}) is False  # the flag rules
    assert cal.client_late({"arrivals": {"late_ms": {"p99": LATE_LIMIT_MS + 1}}}) is True  # runs before the flag
    assert cal.client_late({"arrivals": {"late_ms": {"p99": LATE_LIMIT_MS - 1}}}) is False
    assert cal.client_late({}) is False  # runs before either: unknown, counted on time (as they always were)


def test_the_measured_hold_and_slowdown_of_a_point_are_batch_weighted():
    mod = _load("sim_measured_hold")
    point = {"layouts": [{"batches": 30, "gap_ms": 1.0, "shared": False}, {"batches": 10, "gap_ms": 3.0, "shared": False},
                         {"batches": 0, "gap_ms": None, "shared": False}],
             "profile_check": [{"profile_ms": 1.0, "measured_ms": 1.2, "batches": 10},
                               {"profile_ms": 2.0, "measured_ms": 2.0, "batches": 5}]}
    hold, slow, parts = mod.measured(point)
    assert hold == 1.5 and slow == (12 + 10) / (10 + 10) and parts == 3


def test_the_spread_of_a_points_holds_is_the_batch_weighted_lognormal_sigma_of_its_lanes():
    import math

    mod = _load("sim_measured_hold")
    wide = math.exp(mod.Z99 * 0.6)  # p99 / p50 of a lognormal of sigma 0.6
    point = {"layouts": [{"batches": 30, "hold_p50_ms": 0.5, "hold_p99_ms": 0.5 * wide},
                         {"batches": 10, "hold_p50_ms": 1.0, "hold_p99_ms": 1.0},  # no tail: sigma 0
                         {"batches": 0, "hold_p50_ms": 1.0, "hold_p99_ms": 9.0},  # ran nothing: left out
                         {"batches": 5, "hold_p50_ms": None, "hold_p99_ms": None}]}  # no figures: left out
    assert mod.measured_spread(point) == pytest.approx(0.6 * 30 / 40)
    assert mod.measured_spread({"layouts": [{"batches": 5, "gap_ms": 1.0}]}) is None  # reports before the figures


def test_the_told_worlds_share_nothing_so_a_batch_is_slowed_only_by_the_told_slowdown():
    from gpuloom.runtime.sim import ContentionModel

    mod = _load("sim_measured_hold")
    told = ContentionModel(demand_fraction=mod.NO_SHARING)
    # six shared lanes each demanding the whole GPU (132 SMs), as the simulator passes it: knee x fraction
    assert told.shared_factor(6 * 132 * told.demand_fraction, 132) == 1.0
    assert ContentionModel(demand_fraction=0.89).shared_factor(6 * 132 * 0.89, 132) > 5  # the sharing it replaces


def test_the_best_setting_is_the_minimax_or_the_one_with_most_points_within_the_target():
    cal = load_script()
    near = {"name": "near", "worst_abs_error_fitted": 0.12, "mean_abs_error_fitted": 0.06, "within_target_fitted": 30}
    many = {"name": "many", "worst_abs_error_fitted": 0.21, "mean_abs_error_fitted": 0.04, "within_target_fitted": 33}
    tie = {**many, "name": "tie", "worst_abs_error_fitted": 0.20, "mean_abs_error_fitted": 0.05}
    assert cal.best_setting([near, many])["name"] == "near"  # the default: the smallest worst error
    assert cal.best_setting([near, many], "within")["name"] == "many"
    assert cal.best_setting([near, many, tie], "within")["name"] == "tie"  # equal counts: the smaller worst error


def test_shared_work_counts_a_points_batches_in_knee_and_area_units_and_skips_partitions(tmp_path):
    import importlib.util
    from pathlib import Path

    from gpuloom.profile.store import GpuInfo, Profile

    spec = importlib.util.spec_from_file_location(
        "diag_shared_work", Path(__file__).resolve().parent.parent / "scripts" / "diag_shared_work.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # batch 1: 3 ms on 8 SMs (24 SM-ms), 1 ms on 16 (16 SM-ms, knee 16); batch 2: 4 ms on 8 (32), 2.5 on 16 (40)
    prof = Profile(model="m", input_shapes=((4,),), dtype="float32", gpu=GpuInfo("toy", 16, 8), batches=(1, 2),
                   sms=(8, 16), latency_ms=((3.0, 1.0), (4.0, 2.5)))
    point = {"scale": 1.0, "slo_attainment": 0.9, "duration_s": 1.0, "profile_check": [
        {"model": "m", "sms": 16, "batch": 1, "batches": 100}, {"model": "m", "sms": 16, "batch": 2, "batches": 50}]}
    w = mod.point_work(point, {"m": prof}, 16, demand_fraction=1.0, min_sms=8)
    # knee: 100 x 16 x 1.0 + 50 x 16 x 2.5 = 3,600 SM-ms; area: 100 x 16 + 50 x 32 = 3,200; over 16 SMs x 1,000 ms
    assert w["knee"] == pytest.approx(3600 / 16000) and w["area"] == pytest.approx(3200 / 16000)
    assert w["mean_batch"] == pytest.approx(200 / 150, abs=0.01)
    assert mod.point_work(point, {"m": prof}, 16, demand_fraction=1.0, min_sms=16)["area"] == pytest.approx(
        (100 * 16 + 50 * 40) / 16000)  # from 16 SMs up only the whole GPU
    on_partitions = {**point, "profile_check": [{"model": "m", "sms": 8, "batch": 1, "batches": 10}]}
    assert mod.point_work(on_partitions, {"m": prof}, 16) is None
    assert mod.spread([1.0, 3.0])["relative_range"] == 1.0 and mod.spread([]) is None
    mod.plot([w, {**w, "attainment": 1.0}], 0.99, str(tmp_path / "work.png"), "t")
    assert (tmp_path / "work.png").read_bytes()[:4] == b"\x89PNG"


def test_diag_sim_per_model_weights_each_models_slowdown_and_batch_by_its_batches():
    """The card's slowdown per model (run 167: bert 2.7x its profile past triton's edge, the small
    CNNs 5.3-5.5x) is its device time over its profiled time, summed over its rows by batches."""
    mod = _load("diag_sim_per_model")
    point = {"profile_check": [
        {"model": "a", "sms": 16, "batch": 1, "batches": 30, "measured_ms": 2.0, "profile_ms": 1.0},
        {"model": "a", "sms": 16, "batch": 4, "batches": 10, "measured_ms": 9.0, "profile_ms": 3.0},
        {"model": "b", "sms": 16, "batch": 2, "batches": 5, "measured_ms": 1.0, "profile_ms": 1.0},
        {"model": "c", "sms": 16, "batch": 2, "batches": 0, "measured_ms": 1.0, "profile_ms": 1.0}]}
    s = mod.measured_slowdowns(point)
    # a: (30 x 2 + 10 x 9) / (30 x 1 + 10 x 3) = 150 / 60; its mean batch (30 x 1 + 10 x 4) / 40
    assert s["a"]["slowdown"] == pytest.approx(2.5) and s["a"]["mean_batch"] == pytest.approx(1.75)
    assert s["b"] == {"slowdown": 1.0, "mean_batch": 2.0}
    assert "c" not in s  # no batch: nothing measured
    assert mod.measured_slowdowns({}) == {}


def test_diag_pair_slowdown_gives_each_models_slowdown_and_the_sets_spread():
    """One factor for every model (the simulator's shared lanes) reads as a spread of 1."""
    mod = _load("diag_pair_slowdown")
    r = mod.slowdowns({"bert": 4.0, "cnn": 1.0, "idle": 2.0}, {"bert": 6.0, "cnn": 3.0})
    assert r["slowdown"] == {"bert": 1.5, "cnn": 3.0} and r["spread"] == 2.0  # a model not in the set is left out
    assert mod.slowdowns({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 4.0})["spread"] == 1.0
    assert mod.slowdowns({}, {"a": 1.0}) == {"slowdown": {}, "spread": None}


def test_effective_sms_read_a_batchs_measured_time_back_off_its_profile():
    from gpuloom.profile.store import GpuInfo, Profile

    mod = _load("diag_sim_per_model")
    # batch 1: 4 ms on 8 SMs, 2 ms on 16; batch 2: 8 ms on 8, 3 ms on 16
    prof = Profile(model="m", input_shapes=((4,),), dtype="float32", gpu=GpuInfo("toy", 16, 8), batches=(1, 2),
                   sms=(8, 16), latency_ms=((4.0, 2.0), (8.0, 3.0)))
    assert mod.effective_sms(prof, 1, 2.0) == 16 and mod.effective_sms(prof, 1, 1.0) == 16  # at or under the whole GPU
    assert mod.effective_sms(prof, 1, 3.0) == pytest.approx(12.0)  # halfway between 4 and 2 ms
    assert mod.effective_sms(prof, 2, 16.0) == pytest.approx(4.0)  # past the fewest: 8 SMs x 8 ms / 16 ms
    point = {"duration_s": 1.0, "profile_check": [
        {"model": "m", "sms": 16, "batch": 1, "batches": 100, "measured_ms": 3.0},   # as if on 12 SMs
        {"model": "m", "sms": 16, "batch": 2, "batches": 100, "measured_ms": 5.5},   # as if on 12 (8 -> 3 ms)
        {"model": "gone", "sms": 16, "batch": 1, "batches": 5, "measured_ms": 1.0}]}  # no profile: left out
    shares = mod.effective_shares(point, {"m": prof})
    assert list(shares) == ["m"] and shares["m"]["effective_sms"] == pytest.approx(12.0)
    assert shares["m"]["busy"] == pytest.approx((100 * 3.0 + 100 * 5.5) / 1000)


def test_share_weights_come_from_the_points_past_the_edge_as_inverse_slowdowns_of_geometric_mean_one():
    mod = _load("sim_share_weights")

    def point(attainment, slow_a, slow_b):
        return {"slo_attainment": attainment, "profile_check": [
            {"model": "a", "sms": 16, "batch": 1, "batches": 10, "measured_ms": slow_a, "profile_ms": 1.0},
            {"model": "b", "sms": 16, "batch": 1, "batches": 10, "measured_ms": slow_b, "profile_ms": 1.0}]}

    # a slowed 2x and b 8x: shares 1/2 and 1/8, scaled to a geometric mean of 1 -> 2 and 0.5
    w = mod.weights_from([point(0.5, 2.0, 8.0), point(0.999, 1.0, 100.0)], below=0.99)  # the held point is left out
    assert w == {"a": pytest.approx(2.0), "b": pytest.approx(0.5)}
    w = mod.weights_from([point(0.5, 2.0, 8.0), point(0.7, 3.0, 3.0)], below=0.99)  # averaged over the points
    assert w == {"a": pytest.approx(1.5), "b": pytest.approx(0.75)}
    assert mod.weights_from([point(1.0, 2.0, 8.0)], below=0.99) == {}


def test_a_simulated_sweeps_highest_load_is_read_as_the_bench_reads_its_points():
    mod = _load("sim_report_policies")
    pts = [{"scale": 1.0, "slo_attainment": 0.999}, {"scale": 1.25, "slo_attainment": 0.995},
           {"scale": 1.125, "slo_attainment": 0.98}, {"scale": 1.5, "slo_attainment": 0.5}]
    assert mod.highest_held(pts, 0.99) == 1.25  # the highest held, as gpuloom bench's best_scale
    assert mod.highest_held(pts[2:], 0.99) == 0.0
