"""``gpuloom plan``: prints the schedule, writes JSON and the Gantt PNG, fails cleanly."""

from __future__ import annotations

from pathlib import Path

from gpuloom.cli import main
from gpuloom.plan import Schedule

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_plan_command_writes_schedule_json_and_gantt(tmp_path: Path, capsys) -> None:
    rc = main(["plan", str(EXAMPLES / "light3.yaml"), "--synthetic", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "SYNTHETIC" in err
    assert "mobilenet_v2" in out and "every model gets its demand" in out
    s = Schedule.load(tmp_path / "light3.schedule.json")
    assert {m.model for m in s.models} == {"mobilenet_v2", "efficientnet_b0", "resnet50"}
    assert (tmp_path / "light3.gantt.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_command_reports_short_models_under_overload(tmp_path: Path, capsys) -> None:
    rc = main(["plan", str(EXAMPLES / "overload.yaml"), "--synthetic", "--out", str(tmp_path), "--no-png"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "short:" in out and "misses" in out
    assert not (tmp_path / "overload.gantt.png").exists()


def test_plan_command_rejects_a_bad_workload_with_exit_code_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("duration_s: 10\nmodels:\n  - {name: nosuch_model, slo_ms: 10, rate: 5}\n")
    rc = main(["plan", str(bad), "--synthetic", "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert rc == 2 and "nosuch_model" in err


def test_plan_command_says_where_dstack_auto_lanes_would_run_the_plan(tmp_path: Path, capsys) -> None:
    for name, scale, where in (("light3.yaml", "6", "shared lanes"), ("mix6.yaml", "1", "partitions")):
        rc = main(["plan", str(EXAMPLES / name), "--gpu", "h200", "--scale", scale, "--out", str(tmp_path), "--no-png"])
        out, _ = capsys.readouterr()
        assert rc == 0
        assert "turnaround share" in out and f"would run a plan with this share on {where}" in " ".join(out.split()), (name, out)
