"""The device call's GPU monitor summary (scripts/gpu_monitor_summary.py)."""

from __future__ import annotations

from script_loader import load_script

mon = load_script("gpu_monitor_summary")

SAMPLES = """\
2026/12/02 03:10:00.100, 345 MHz, 3201 MHz, 75.10 W, 31, 0 %, 0x0000000000000001
2026/12/02 03:10:01.100, 1980 MHz, 3201 MHz, 410.55 W, 48, 97 %, 0x0000000000000000
2026/12/02 03:10:02.100, 1755 MHz, 3201 MHz, 690.02 W, 61, 99 %, 0x0000000000000004
2026/12/02 03:10:03.100, 1830 MHz, 3201 MHz, 650.00 W, 60, 88 %, 0x0000000000000004
Field "clocks_event_reasons.active" is not a valid field to query.
"""


def test_the_summary_reads_busy_samples_only_and_names_each_clock_event_reason():
    rows = mon.parse(SAMPLES.splitlines())
    assert len(rows) == 4  # the error line is skipped
    assert rows[1]["sm_mhz"] == 1980 and rows[1]["util"] == 97
    text = mon.summarize(rows)
    assert "4 samples, 3 at >= 50% utilization" in text
    assert "SM clock MHz min/median/max 1755 / 1830 / 1980" in text  # the idle 345 MHz is left out
    assert "0x0000000000000004 x2" in text and "0x0000000000000001" not in text  # idle's reason too


def test_no_samples_or_no_reasons_are_said_plainly(tmp_path, capsys):
    assert "no samples" in mon.summarize(mon.parse(["Failed to initialize NVML"]))
    rows = mon.parse(["t, 1980 MHz, 3201 MHz, 400 W, 50, 90 %"])  # a driver without the reasons field
    assert "clock-event reasons while busy: none" in mon.summarize(rows)
    assert mon.main([str(tmp_path / "missing.csv")]) == 0 and "could not read" in capsys.readouterr().out
