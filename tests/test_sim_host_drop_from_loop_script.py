"""scripts/sim_host_drop_from_loop.py (the zero-error bisection, the fit) and the loop's CPU per request it reads
(``host_hold.loop_us_per_request``) (CPU)."""

from __future__ import annotations

import pytest

from script_loader import load_script


def test_the_loop_cpu_is_read_per_request_that_entered():
    from gpuloom.bench.host_hold import loop_us_per_request

    point = {"duration_s": 5.0, "models": [{"submitted": 40_000}, {"submitted": 10_000}],
             "host": {"thread_cpu": {"gpuloom-runtime": 0.2, "MainThread": 0.3}}}
    assert loop_us_per_request(point) == pytest.approx(0.2 / 10_000 * 1e6)  # 20 us per request
    assert loop_us_per_request({**point, "host": {}}) is None  # reports before the thread CPU
    assert loop_us_per_request(point, "MainThread") == pytest.approx(30.0)  # another thread's, per request


def test_the_zero_error_drop_time_is_found_where_the_simulated_goodput_meets_the_measured():
    mod = load_script("sim_host_drop_from_loop")
    goodput = lambda hd: 3000.0 - 30_000.0 * hd  # noqa: E731 - falls with the host's per-drop time
    assert mod.zero_error_drop_ms(goodput, 1650.0) == pytest.approx(0.045, abs=1e-4)
    assert mod.zero_error_drop_ms(goodput, 3500.0) == 0.0  # above even a free drop: the range's end
    assert mod.zero_error_drop_ms(goodput, 100.0) == pytest.approx(0.0967, abs=1e-4)
    floored = lambda hd: max(1000.0, goodput(hd))  # noqa: E731 - a simulation that never serves below 1,000/s
    assert mod.zero_error_drop_ms(floored, 500.0) == 0.15  # below its slowest: the other end


def test_the_fit_goes_through_the_origin():
    mod = load_script("sim_host_drop_from_loop")
    assert mod.through_origin([10.0, 20.0], [0.02, 0.04]) == pytest.approx(0.002)
    assert mod.through_origin([10.0, 20.0], [0.03, 0.03]) == pytest.approx(0.9 / 500)
