"""``gpuloom plan``: prints the schedule, writes JSON and the Gantt PNG, fails cleanly."""

from __future__ import annotations

import dataclasses
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


def test_plan_command_prints_the_plan_dstack_serves(tmp_path: Path, capsys) -> None:
    """The schedule ``gpuloom plan`` writes is the one dstack plans for the same workload: its
    smallest partition included (the command once planned without one, dstack with 16 SMs: light3's
    partitions came out 60/40/32 SMs where dstack served 84/48), and its planned hold (dstack's
    default since the fifty-third session)."""
    from gpuloom.bench.experiment import make_context
    from gpuloom.bench.workload import load_workload, resolve_profiles
    from gpuloom.policy.dstack import DStackPolicy

    for name, scale in (("light3.yaml", 1.0), ("light3.yaml", 6.0), ("mix6.yaml", 1.0)):
        rc = main(["plan", str(EXAMPLES / name), "--gpu", "h200", "--scale", str(scale), "--out", str(tmp_path),
                   "--no-png"])
        out = " ".join(capsys.readouterr().out.split())
        assert rc == 0 and "partitions of 16 SMs or more, a hold of 1.125 ms per batch" in out
        printed = Schedule.load(tmp_path / name.replace(".yaml", ".schedule.json"))
        workload = load_workload(EXAMPLES / name).scaled(scale)
        store, _ = resolve_profiles(workload, gpu="h200")
        policy = DStackPolicy()  # on a real device (in simulation it plans the simulated device's hold)
        policy.setup(dataclasses.replace(make_context(workload, {m.name: store.get(m.name) for m in workload.models}),
                                         simulated=False))
        served = policy.schedule
        assert [p.sms for p in printed.partitions] == [p.sms for p in served.partitions], name
        assert {(m.model, m.partition, m.batch) for m in printed.models} == \
            {(m.model, m.partition, m.batch) for m in served.models}, name
    rc = main(["plan", str(EXAMPLES / "light3.yaml"), "--gpu", "h200", "--min-sms", "0", "--batch-overhead-ms", "0",
               "--out", str(tmp_path), "--no-png"])
    assert rc == 0 and "partitions of 0 SMs or more, a hold of 0 ms" in " ".join(capsys.readouterr().out.split())
    assert [p.sms for p in Schedule.load(tmp_path / "light3.schedule.json").partitions] == [60, 40, 32]


def test_ctrl_c_in_a_command_is_one_line_and_status_130(monkeypatch, capsys) -> None:
    """Outside a command's own handling Ctrl-C printed Python's stack; now one line, status 130 (the
    console script then ends without the interpreter's teardown, which aborted under torch's threads)."""
    from gpuloom.commands import plan as plan_cmd

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cmd, "run", interrupted)
    assert main(["plan", "examples/mix6.yaml"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted"
