"""The knee: occupancy arithmetic, aggregation of synthetic kernel records, measured knees, traces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.gpu import sm_grid
from gpuloom.profile.knee import (KernelRecord, OccupancyLimits, blocks_per_sm, fillable_sms, measured_knee,
                                  modelled_latency_us, parse_chrome_trace, predict_knee, throughput_per_sm,
                                  wave_sms)

H200 = OccupancyLimits()
GRID = sm_grid(132, 8)


def k(blocks, threads=256, regs=32, smem=0, dur=10.0, name="k"):
    return KernelRecord(name, dur, (blocks, 1, 1), (threads, 1, 1), regs, smem)


# -- occupancy -----------------------------------------------------------------------------------

def test_threads_limit_blocks_per_sm():
    assert blocks_per_sm(k(1, threads=256, regs=32)) == 8  # 2048 / 256
    assert blocks_per_sm(k(1, threads=1024, regs=32)) == 2


def test_registers_limit_blocks_per_sm():
    # 128 threads x 255 regs: 8160 regs per warp after rounding to 256 -> 8 warps -> 2 blocks of 4 warps
    assert blocks_per_sm(k(1, threads=128, regs=255)) == 2
    assert blocks_per_sm(k(1, threads=128, regs=64)) == 8  # 2048 regs/warp -> 32 warps -> 8 blocks


def test_shared_memory_limits_blocks_per_sm():
    assert blocks_per_sm(k(1, threads=128, regs=32, smem=100 * 1024)) == 2
    assert blocks_per_sm(k(1, threads=128, regs=32, smem=200 * 1024)) == 1


def test_block_count_limit_applies_to_tiny_blocks():
    assert blocks_per_sm(k(1, threads=32, regs=16)) == 32


def test_an_oversized_kernel_still_holds_one_block():
    assert blocks_per_sm(k(1, threads=1024, regs=255)) == 1


def test_fillable_sms_is_the_ceiling_of_blocks_over_blocks_per_sm_capped_at_the_device():
    assert fillable_sms(k(264, threads=256)) == 33  # 264 / 8
    assert fillable_sms(k(265, threads=256)) == 34
    assert fillable_sms(k(100000, threads=256)) == 132
    assert fillable_sms(k(1, threads=256)) == 1


def test_saturation_makes_a_kernel_want_more_sms():
    x = k(80, threads=256)
    assert wave_sms(x, H200, 0.5) == pytest.approx(2 * wave_sms(x, H200, 1.0))
    with pytest.raises(ValueError):
        wave_sms(x, H200, 0.0)


def test_limits_read_from_device_facts():
    class Facts:
        sm_count, max_threads_per_sm, max_blocks_per_sm, regs_per_sm, smem_per_sm, warp_size = 108, 2048, 32, 65536, 164 * 1024, 32

    lim = OccupancyLimits.from_device(Facts)
    assert lim.sm_count == 108 and lim.smem_per_sm == 164 * 1024


# -- aggregation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["latency", "mean", "quantile"])
def test_kernels_that_fill_64_sms_give_a_knee_of_64(method):
    recs = [k(64 * 8, threads=256, dur=d) for d in (5.0, 20.0, 7.0)]  # 8 blocks/SM -> exactly 64 SMs
    assert predict_knee(recs, GRID, method=method, eps=0.0) == 64


def test_a_long_wide_kernel_outweighs_many_short_narrow_ones():
    narrow = [k(8 * 8, dur=1.0) for _ in range(10)]  # 8 SMs each, 10 us in all
    wide = [k(132 * 8 * 4, dur=1000.0)]  # 4 waves over the whole device
    for method in ("latency", "mean", "quantile"):
        assert predict_knee(narrow + wide, GRID, method=method) >= 120, method
        assert predict_knee(narrow, GRID, method=method) == 8, method


def test_weighting_is_by_duration_not_by_kernel_count():
    a = [k(16 * 8, dur=100.0)]  # 16 SMs, long
    b = [k(128 * 8, dur=1.0) for _ in range(5)]  # 128 SMs, short
    assert predict_knee(a + b, GRID, method="quantile", q=0.5) == 16
    assert predict_knee(a + b, GRID, method="mean") == 24  # (16*100 + 128*5) / 105 = 21.3 -> 24


def test_latency_model_is_flat_past_the_widest_kernel_and_grows_below():
    recs = [k(40 * 8, dur=10.0), k(80 * 8, dur=10.0)]
    assert modelled_latency_us(recs, 80) == pytest.approx(modelled_latency_us(recs, 132))
    assert modelled_latency_us(recs, 40) == pytest.approx(10 + 20)
    assert modelled_latency_us(recs, 20) == pytest.approx(20 + 40)


def test_launch_overhead_lowers_the_predicted_knee():
    recs = [k(132 * 8, dur=10.0)]
    assert predict_knee(recs, GRID, overhead_us=0.0) == 120  # 132/120 = 1.1 <= 1.1, 132/112 > 1.1
    # with 100 us that do not scale: 10 * 132 / s + 100 <= 1.1 * 110 -> s >= 62.9
    assert predict_knee(recs, GRID, overhead_us=100.0) == 64


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([64, 128, 256, 512, 1024]),
                          st.integers(16, 255), st.floats(0.1, 500.0)), min_size=1, max_size=30),
       st.floats(0.0, 0.5))
def test_predicted_knee_is_on_the_grid_and_shrinks_as_eps_grows(kernels, eps):
    recs = [k(b, threads=t, regs=r, dur=d) for b, t, r, d in kernels]
    for method in ("latency", "mean", "quantile"):
        assert predict_knee(recs, GRID, method=method, eps=eps) in GRID
    assert predict_knee(recs, GRID, eps=eps + 0.2) <= predict_knee(recs, GRID, eps=eps)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="method"):
        predict_knee([k(8)], GRID, method="max")
    with pytest.raises(ValueError, match="positive durations"):
        predict_knee([k(8, dur=0.0)], GRID)
    with pytest.raises(ValueError, match="non-empty"):
        predict_knee([k(8)], [])


# -- measured ------------------------------------------------------------------------------------

def test_measured_knee_is_the_fewest_sms_within_eps_of_the_whole_gpu():
    sms = [8, 16, 32, 64, 132]
    lat = [8.0, 4.0, 2.5, 2.1, 2.0]
    assert measured_knee(sms, lat, 0.1) == 64
    assert measured_knee(sms, lat, 0.3) == 32
    assert measured_knee(sms, lat, 0.0) == 132


def test_measured_knee_flattens_noise_that_says_more_sms_are_slower():
    assert measured_knee([8, 16, 32], [4.0, 1.0, 1.2]) == 16


def test_measured_knee_agrees_with_the_profile_store():
    from gpuloom.profile.synthetic import zoo

    for p in zoo():
        for i, b in enumerate(p.batches):
            assert measured_knee(p.sms, p.latency_ms[i], 0.1) == p.knee(b, 0.1)


def test_throughput_per_sm_is_batch_over_latency_over_sms():
    assert throughput_per_sm([8, 16], [2.0, 1.0], batch=4) == [(8, 250.0), (16, 250.0)]


# -- traces --------------------------------------------------------------------------------------

def test_parse_chrome_trace_reads_kineto_kernel_args(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 12.5,
         "args": {"grid": [66, 2, 1], "block": [128, 1, 1], "registers per thread": 168, "shared memory": 98304}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 3.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "no_shape", "dur": 1.0, "args": {}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "dur": 1.0, "args": {}},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    for src in (trace, str(path), json.dumps(trace)):
        recs = parse_chrome_trace(src)
        assert recs == [KernelRecord("gemm", 12.5, (66, 2, 1), (128, 1, 1), 168, 98304)]
    assert recs[0].blocks == 132 and recs[0].threads_per_block == 128


def test_named_variants_match_their_keyword_arguments():
    from gpuloom.profile.knee import DEFAULT_VARIANT, predict_variant, variants

    recs = [k(40 * 8, dur=10.0), k(132 * 8 * 2, dur=30.0), k(16, dur=5.0)]
    assert DEFAULT_VARIANT in variants()
    assert predict_variant("latency_sat0.5", recs, GRID) == predict_knee(recs, GRID, saturation=0.5)
    assert predict_variant("median", recs, GRID) == predict_knee(recs, GRID, method="quantile", q=0.5)
    # +gaps: the whole-GPU latency beyond the kernels' sum is a constant overhead
    full = modelled_latency_us(recs, 132) + 200.0
    assert predict_variant("latency+gaps", recs, GRID, full_latency_us=full) == predict_knee(
        recs, GRID, overhead_us=200.0)
    with pytest.raises(ValueError, match="full_latency_us"):
        predict_variant("latency+gaps", recs, GRID)
    with pytest.raises(ValueError, match="known"):
        predict_variant("nope", recs, GRID)
