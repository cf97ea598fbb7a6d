"""scripts/plot_sim_validation.py: which workload a point is, and a picture from a calibration report."""

from __future__ import annotations

import json
import sys

import pytest
from script_loader import load_script

plot = load_script("plot_sim_validation")


def test_a_points_workload_is_read_from_its_bench_files_name():
    assert plot.workload_of("mix6_deadlines_h200_run135.json") == "mix6_deadlines"  # not mix6
    assert plot.workload_of("bench_mix6_h200_run66_views_shared.json") == "mix6"
    assert plot.workload_of("bench_light3_h200_run54_warmup.json") == "light3"
    assert plot.workload_of("bench_overload_h200_run65_views.json") == "overload"
    assert plot.workload_of("bench_other.json") == "other"


def test_it_draws_a_reports_best_points_and_names_those_outside_the_target(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"file": "bench_mix6_x.json", "policy": "dstack", "scale": 1.0, "measured_goodput": 100.0,
             "simulated_goodput": 105.0, "goodput_error": 0.05},
            {"file": "bench_light3_x.json", "policy": "triton", "scale": 8.0, "measured_goodput": 100.0,
             "simulated_goodput": 130.0, "goodput_error": 0.30}]
    report = tmp_path / "fit.json"
    report.write_text(json.dumps({"best_points": rows}))
    out = tmp_path / "v.png"
    monkeypatch.setattr(sys, "argv", ["plot_sim_validation.py", f"fit={report}", "--out", str(out)])
    assert plot.main() == 0
    text = capsys.readouterr().out
    assert "fit: 1 of 2 points within 10%" in text and "bench_light3_x.json triton x8 +30.0%" in text
    assert out.stat().st_size > 1000
    not_a_report = tmp_path / "bench.json"
    not_a_report.write_text("{}")
    monkeypatch.setattr(sys, "argv", ["plot_sim_validation.py", str(not_a_report), "--out", str(out)])
    with pytest.raises(SystemExit, match="not a calibrate_sim.py report"):
        plot.main()
