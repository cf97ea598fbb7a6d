"""``gpuloom bench``'s arguments are checked before any model is compiled, and its sweep reports the
highest load it measured held (a reviewer's findings, session 69). No test here compiles a model:
model setup fails the test if it is reached."""

from __future__ import annotations

import argparse
import os
import types

import pytest

from gpuloom.bench import e2e, machine
from gpuloom.commands import bench

WORKLOAD = """
duration_s: 1
seed: 3
models:
  - {name: alpha, slo_ms: 200, arrival: {kind: poisson, rate: 20}}
  - {name: beta,  slo_ms: 300, arrival: {kind: poisson, rate: 10}}
"""


@pytest.fixture
def workload(tmp_path):
    wl = tmp_path / "two.yaml"
    wl.write_text(WORKLOAD)
    return str(wl)


@pytest.fixture
def no_setup(monkeypatch):
    """Fail the test if the bench goes on to set up its device, models or machine probes."""

    def reached(*a, **kw):
        raise AssertionError("the bench went on to set up (a bad argument was not refused up front)")

    monkeypatch.setattr(e2e, "build_models", reached)
    monkeypatch.setattr(machine, "describe_machine", reached)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuloom bench")
    bench.add_arguments(p)
    return p


def run(*argv: str) -> int:
    return bench.run(parser().parse_args(list(argv)))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err, err
    return " ".join(err.split())  # the console may wrap a long line


def test_out_naming_a_directory_or_a_path_under_a_file_is_refused_before_setup(tmp_path, workload, no_setup,
                                                                                capsys, monkeypatch):
    monkeypatch.setattr(e2e, "resolve_device_and_profiles", lambda *a, **kw: pytest.fail("setup reached"))
    outdir = tmp_path / "reports"
    outdir.mkdir()
    assert run(workload, "--tiny", "--out", str(outdir)) == 2
    assert "is a directory" in one_error_line(capsys)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert run(workload, "--tiny", "--out", str(afile / "x.json")) == 2
    assert "is a file, not a directory" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "reports", "two.yaml"]  # no stray .tmp


def test_sweep_reports_the_highest_load_held_and_marks_a_lower_bound():
    from gpuloom.bench.e2e import highest_held, sweep_search

    def search(held: dict[float, bool], steps: int) -> list[float]:
        measured: list[float] = []
        sweep_search(lambda s: measured.append(s) or held[s], steps=steps)
        return measured

    # --scale 3 --sweep --steps 2 (the review): x3, then x1 and x2 held; the steps ran out while doubling
    swept = search({1.0: True, 2.0: True}, steps=2)
    assert swept == [1.0, 2.0]
    assert highest_held([(3.0, True)] + [(s, True) for s in swept]) == (3.0, False)
    # a miss bounds it: doubled to x2, which missed, then bisected
    held = {1.0: True, 2.0: False, 1.5: True, 1.75: False}
    swept = search(held, steps=2)
    assert swept == [1.0, 2.0, 1.5, 1.75]
    assert highest_held([(s, held[s]) for s in swept]) == (1.5, True)
    # x1 missed: bisected down from it
    held = {1.0: False, 0.5: True, 0.75: False}
    assert search(held, steps=2) == [1.0, 0.5, 0.75]
    assert highest_held([(s, held[s]) for s in held]) == (0.5, True)
    assert highest_held([(1.0, False)]) == (0.0, True)  # none held
    assert highest_held([]) == (0.0, False)


def test_an_unbounded_max_load_reads_at_least_in_the_table_and_the_report(workload):
    from gpuloom.bench.workload import load_workload

    unbounded = e2e.PolicyResult("dstack", [], 4.0, 120.0, max_scale_bounded=False)
    bounded = e2e.PolicyResult("triton", [], 2.0, 60.0)
    assert bench.max_load_cells(unbounded) == ("at least 4", "at least 120")
    assert bench.max_load_cells(bounded) == ("2", "60")
    assert bench.max_load_cells(e2e.PolicyResult("nexus", [], 0.0, 0.0)) == ("none", "-")
    rep = e2e.to_json(load_workload(workload), [unbounded, bounded], device="cpu", target=0.99)
    assert rep["policies"]["dstack"]["max_scale_bounded"] is False
    assert rep["policies"]["triton"]["max_scale_bounded"] is True


def test_steps_must_be_at_least_one_and_needs_sweep(workload, no_setup, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args([workload, "--sweep", "--steps", "0"])
    assert e.value.code == 2 and "--steps" in capsys.readouterr().err
    assert run(workload, "--tiny", "--steps", "3") == 2
    assert "needs --sweep" in one_error_line(capsys)


@pytest.mark.parametrize("flag,value", [
    ("--scale", "-1"), ("--scale", "0"), ("--scale", "nan"), ("--scale", "1,,2"),
    ("--duration", "0"), ("--duration", "-1"), ("--queue-limit", "0"), ("--max-batch", "0"),
    ("--target", "2"), ("--target", "0"), ("--device", "foo"),
])
def test_bad_numbers_and_devices_are_refused_by_the_parser(workload, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args([workload, f"{flag}={value}"])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_good_numbers_and_devices_pass_the_parser(workload):
    args = parser().parse_args([workload, "--scale", "0.5,2", "--device", "cuda:1", "--target", "1",
                                "--max-batch", "1", "--queue-limit", "1", "--duration", "0.5"])
    assert args.scale == [0.5, 2.0] and args.device == "cuda:1" and args.target == 1.0
    assert parser().parse_args([workload, "--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("variant,said", [
    ("dstack:lookahead_ms=abc", "lookahead_ms"),
    ("dstack:tune_gc=maybe", "tune_gc"),
    ("dstack:switch_interval_ms=0", "switch_interval_ms"),
    ("dstack:workqueues=many", "workqueues"),
    (f"dstack:cpus={max(os.sched_getaffinity(0)) + 1}", "not available"),
])
def test_a_variants_service_options_are_checked_before_setup(workload, no_setup, variant, said, capsys,
                                                            monkeypatch):
    monkeypatch.setattr(e2e, "resolve_device_and_profiles", lambda *a, **kw: pytest.fail("setup reached"))
    assert run(workload, "--tiny", "--device", "cpu", "--policy", f"triton,{variant}") == 2
    line = one_error_line(capsys)
    assert variant in line and said in line


def test_a_missing_profile_directory_is_refused(tmp_path, workload, no_setup, capsys):
    assert run(workload, "--tiny", "--device", "cpu", "--profiles", str(tmp_path / "nonexist")) == 2
    assert "does not exist" in one_error_line(capsys)


def test_the_table_shows_no_attainment_for_a_point_nothing_was_submitted_to():
    def point(*submitted: int, attainment: float):
        return types.SimpleNamespace(slo_attainment=attainment,
                                     models=[types.SimpleNamespace(submitted=n) for n in submitted])

    assert bench.attainment_cell(point(0, 0, attainment=1.0)) == "-"
    assert bench.attainment_cell(point(3, 0, attainment=0.95)) == "0.950"


def test_an_error_naming_a_bracketed_policy_is_printed_literally(workload, no_setup, capsys):
    """rich markup: a name like ``[/bold]`` in bench's error ended in a MarkupError traceback (plan and
    simulate were mended by the same review; bench's errors printed with markup on still)."""
    assert run(workload, "--tiny", "--device", "cpu", "--policy", "triton,[/bold]") == 2
    assert "[/bold]" in one_error_line(capsys)
