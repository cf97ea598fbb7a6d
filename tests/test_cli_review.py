"""Regression tests for the review of ``gpuloom plan``, ``simulate``, ``demo`` and ``cache``: user
mistakes end in one line and exit 2, before anything is written; no tracebacks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from gpuloom.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LIGHT3 = str(EXAMPLES / "light3.yaml")


def usage_error(argv: list[str], capsys) -> str:
    """argparse's refusal of ``argv``: exit 2 and its message (stderr)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def one_error_line(text: str) -> str:
    """The single ``error: ...`` line of ``text``; no traceback."""
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    return lines[0]


def write_workload(path: Path, models: str) -> str:
    path.write_text(f"duration_s: 1\nseed: 1\ngpu: h200\nmodels:\n{models}")
    return str(path)


# 1. --cycles


@pytest.mark.parametrize("cycles", ["0", "-2", "100000"])
def test_plan_refuses_cycles_out_of_range_before_writing_anything(cycles, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    err = usage_error(["plan", LIGHT3, "--synthetic", "--out", str(out), "--cycles", cycles], capsys)
    assert "--cycles" in err and "from 1 to" in err
    assert not out.exists()


# 2. --headroom


@pytest.mark.parametrize("headroom", ["nan", "inf"])
def test_plan_refuses_a_non_finite_headroom(headroom, capsys) -> None:
    err = usage_error(["plan", LIGHT3, "--synthetic", "--no-png", "--headroom", headroom], capsys)
    assert "--headroom" in err and "finite" in err


@pytest.mark.parametrize("headroom", [math.nan, math.inf])
def test_the_planner_refuses_a_non_finite_headroom_with_a_plan_error(headroom) -> None:
    from gpuloom.bench.workload import load_workload
    from gpuloom.plan import PlanError, plan
    from gpuloom.profile.store import ProfileStore
    from gpuloom.profile.synthetic import zoo

    with pytest.raises(PlanError, match="headroom must be a finite number"):
        plan(load_workload(LIGHT3).demands(), ProfileStore(profiles=zoo()), headroom=headroom)


# 3. fair share when the common level is 0


def test_fair_share_serves_the_models_that_fit_together_when_min_sms_leaves_one_partition() -> None:
    """light3 with partitions of 128+ SMs (one partition on 132): each model fits alone and
    efficientnet_b0 + resnet50 fit together, but not all three; the plan served none of them."""
    from gpuloom.bench.workload import load_workload
    from gpuloom.plan import plan
    from gpuloom.profile.store import ProfileStore
    from gpuloom.policy.dstack import DEFAULT_HOLD_MS
    from gpuloom.profile.synthetic import zoo

    demands = load_workload(LIGHT3).demands()
    profiles = ProfileStore(profiles=zoo())
    for min_sms in (128, 132):
        s = plan(demands, profiles, min_sms=min_sms, batch_overhead_ms=DEFAULT_HOLD_MS)  # as gpuloom plan does
        served = {m.model: m.served_fraction for m in s.models}
        assert served["efficientnet_b0"] == pytest.approx(1.0) and served["resnet50"] == pytest.approx(1.0), served
        assert served["mobilenet_v2"] == 0.0, served
        assert all(p.sms >= min_sms for p in s.partitions)


# 4. a --profiles directory holding a JSON that is no profile


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_profiles_directory_with_a_non_profile_json_names_the_file(command, tmp_path, capsys) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "notes.json").write_text('{"hello": 1}')
    extra = ["--no-png", "--out", str(tmp_path / "o")] if command == "plan" else ["--policy", "dstack"]
    assert main([command, LIGHT3, "--profiles", str(profiles), *extra]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "notes.json" in line and "not a gpuloom profile" in line


# 5. demo


@pytest.mark.parametrize("flag", ["--iters", "--size", "--batch"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_demo_refuses_a_count_below_one(flag, value, capsys) -> None:
    err = usage_error(["demo", "resnet18", flag, value], capsys)
    assert flag in err and ">= 1" in err


def test_demo_refuses_an_unknown_device_or_cuda_without_a_gpu_in_one_line(monkeypatch, capsys) -> None:
    import torch

    assert main(["demo", "resnet18", "--device", "foo"]) == 2
    assert "expected cuda, cuda:N or cpu, found 'foo'" in one_error_line(capsys.readouterr().out)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "resnet18", "--device", "cuda"]) == 2
    assert "no CUDA GPU here" in one_error_line(capsys.readouterr().out)


def test_demo_refuses_a_draw_file_and_a_torchvision_name_that_is_no_model(tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["demo", "resnet18", "--device", "cpu", "--draw", str(afile)]) == 2
    assert "--draw" in one_error_line(capsys.readouterr().out)
    assert main(["demo", "Weights", "--device", "cpu"]) == 2
    assert "unknown torchvision model 'Weights'" in one_error_line(capsys.readouterr().out)


# 6. simulate --out writes null, not NaN


def test_simulate_writes_null_for_a_nan_metric(tmp_path, monkeypatch, capsys) -> None:
    from gpuloom.bench import experiment

    real = experiment.simulate

    def nan_p99(*a, **k):  # as a run that served nothing reports its percentiles
        r = real(*a, **k)
        return dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, p99_ms=math.nan))

    monkeypatch.setattr(experiment, "simulate", nan_p99)
    out = tmp_path / "out"
    assert main(["simulate", LIGHT3, "--synthetic", "--policy", "dstack", "--duration", "1", "--out", str(out)]) == 0

    def no_constant(name):
        raise AssertionError(f"{name} in the JSON")

    data = json.loads((out / "light3.simulate.json").read_text(), parse_constant=no_constant)
    assert data["runs"][0]["metrics"]["p99_ms"] is None


# 7. simulate --policy


@pytest.mark.parametrize("policy", [",", " , ", "dstack,dstack"])
def test_simulate_refuses_an_empty_or_repeated_policy_list(policy, capsys) -> None:
    assert main(["simulate", LIGHT3, "--synthetic", "--duration", "1", "--policy", policy]) == 2
    assert "--policy" in one_error_line(capsys.readouterr().err)


# 8. rich markup in messages


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_error_messages_keep_bracketed_text(command, tmp_path, capsys) -> None:
    w = write_workload(tmp_path / "w.yaml", "  - {name: mobilenet_v2, slo_ms: 5, arrival: {kind: piecewise, "
                                            "segments: [[0]]}}\n")
    assert main([command, w, "--synthetic"]) == 2
    assert "[start_s, rate]" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_model_named_like_a_closing_tag_is_an_error_not_a_markup_crash(command, tmp_path, capsys) -> None:
    w = write_workload(tmp_path / "w.yaml", '  - {name: "[/bold]", slo_ms: 5, arrival: {kind: poisson, rate: 10}}\n')
    assert main([command, w]) == 2
    assert "[/bold]" in capsys.readouterr().err


# 9. --out at a file; a cache directory that does not exist


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_out_at_an_existing_file_is_one_line_and_exit_2(command, tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep")
    extra = ["--no-png"] if command == "plan" else ["--policy", "dstack", "--duration", "1"]
    assert main([command, LIGHT3, "--synthetic", "--out", str(afile), *extra]) == 2
    assert "expected a directory" in one_error_line(capsys.readouterr().err)
    assert afile.read_text() == "keep"


@pytest.mark.parametrize("action", ["info", "purge"])
def test_cache_says_a_missing_directory_does_not_exist(action, tmp_path, capsys) -> None:
    gone = tmp_path / "missing"
    assert main(["cache", action, "profiles", "--profile-cache", str(gone)]) == 0
    assert f"{gone} does not exist" in capsys.readouterr().err
