"""scripts/sim_queue_limit.py: the simulated GPU it reads off a report, and its errors (CPU)."""

from __future__ import annotations

import dataclasses

from script_loader import load_script


def test_a_report_is_simulated_with_its_own_preset_as_its_runtime_settings_ran_it():
    from gpuloom.runtime.sim import ContentionModel

    mod = load_script("sim_queue_limit")
    fast = ContentionModel.h100_fast_host()
    assert mod.report_contention({"sim_contention": {"preset": "h100-fast-host"}}) == fast
    assert mod.report_contention({}) == ContentionModel.h200_runs()  # the bench's default preset
    assert mod.report_contention({"sim_contention": {"preset": "plain"}}) == ContentionModel()
    yielding = mod.report_contention({"sim_contention": {"preset": "h100-fast-host"},
                                      "gpuloom_settings": {"GPULOOM_YIELD_ANSWERS": "1"}})
    assert yielding == dataclasses.replace(fast, drop_yield_ms=0.2, drop_answer_ms=0.01)


def test_errors_are_relative_to_the_measured_and_absent_without_one():
    mod = load_script("sim_queue_limit")
    assert mod.rel(110.0, 100.0) == 0.1 and mod.rel(50.0, 100.0) == -0.5
    assert mod.rel(None, 100.0) is None and mod.rel(5.0, 0.0) is None and mod.rel(5.0, None) is None
