"""The host probes a bench report carries (gpuloom.bench.machine)."""

from __future__ import annotations

import time

from gpuloom.bench.machine import describe_machine, gpuloom_settings, python_loop_us, summary, sync_us, thread_wake_us


def test_the_probes_measure_what_they_name():
    loop = python_loop_us(repeats=3)
    assert 0 < loop < 5e6  # 100,000 additions: microseconds to a second, never zero
    assert 0 < thread_wake_us(round_trips=50) < 1e6
    # a synchronize that sleeps 2 ms is timed as at least that
    assert sync_us(lambda: time.sleep(0.002), repeats=5) >= 2000


def test_the_machine_description_is_plain_data_with_a_one_line_summary():
    m = describe_machine(sync=lambda: None)
    assert isinstance(m["cpu"], str) and m["cpus"] >= m["usable_cpus"] >= 1
    assert m["cuda_sync_us"] >= 0
    line = summary(m)
    assert line.startswith("host: ") and "thread wake-up" in line and "CUDA synchronize" in line
    assert "CUDA" not in summary(describe_machine())


def test_the_gpuloom_settings_are_the_processes_gpuloom_variables_without_the_cache_paths():
    env = {"GPULOOM_YIELD_ANSWERS": "1", "GPULOOM_LAUNCH_FIRST": "0", "GPULOOM_GRAPH_CACHE": "/tmp/g",
           "GPULOOM_PROFILE_CACHE": "/tmp/p", "CUDA_DEVICE_MAX_CONNECTIONS": "32", "PATH": "/bin"}
    got = gpuloom_settings(env)
    assert got == {"GPULOOM_LAUNCH_FIRST": "0", "GPULOOM_YIELD_ANSWERS": "1"} and list(got) == sorted(got)
    # the yield option is recorded set or not (its default, on since the sixty-fifth session): a report
    # without the key ran before then, with it off
    assert gpuloom_settings({"PATH": "/bin"}) == {"GPULOOM_YIELD_ANSWERS": "1"}
    assert gpuloom_settings({"GPULOOM_YIELD_ANSWERS": "0"}) == {"GPULOOM_YIELD_ANSWERS": "0"}


def test_answers_yield_by_default_and_a_report_without_the_setting_ran_without():
    from gpuloom.runtime.core import REPORT_YIELD_DEFAULT, yields_answers

    assert yields_answers({}) and not yields_answers({"GPULOOM_YIELD_ANSWERS": "0"})
    assert not yields_answers({"GPULOOM_LAUNCH_FIRST": "0"})  # it stops only what launch-first holds back
    assert not yields_answers({}, default=REPORT_YIELD_DEFAULT)
    assert yields_answers(gpuloom_settings({}), default=REPORT_YIELD_DEFAULT)  # a report made now says it was on
