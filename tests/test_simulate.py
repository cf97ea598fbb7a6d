"""``gpuloom simulate`` and the experiment helpers (rate sweep)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from gpuloom.bench.experiment import simulate, sweep_rate
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.cli import main
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import zoo

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
duration_s: 1
seed: 0
models:
  - {name: resnet50,     slo_ms: 25, arrival: {kind: poisson, rate: 300}}
  - {name: mobilenet_v2, slo_ms: 10, arrival: {kind: poisson, rate: 600}}
"""


def test_simulate_command_prints_a_table_and_writes_json_and_png(tmp_path, capsys):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    rc = main(["simulate", str(wl), "--synthetic", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for p in ("dstack", "triton", "clipper", "nexus", "gslice", "temporal", "ideal"):
        assert p in out
    data = json.loads((tmp_path / "tiny.simulate.json").read_text())
    assert [r["metrics"]["policy"] for r in data["runs"]] == ["dstack", "triton", "clipper", "nexus", "gslice", "temporal", "ideal"]
    for r in data["runs"]:
        m = r["metrics"]
        assert m["arrived"] == m["served"] + m["dropped"] + m["failed"] + m["queued"]
    assert (tmp_path / "tiny.simulate.png").stat().st_size > 1000


@pytest.mark.parametrize("args, needle", [(["--target", "0"], "an attainment is a fraction in (0, 1]"),
                                          (["--target", "1.5"], "an attainment is a fraction in (0, 1]"),
                                          (["--sweep-duration", "0"], "a positive number of seconds")])
def test_sweep_options_out_of_range_are_usage_errors_not_tracebacks(tmp_path, capsys, args, needle):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    with pytest.raises(SystemExit) as e:
        main(["simulate", str(wl), "--synthetic", "--sweep-rate", *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_simulate_command_rejects_an_unknown_policy(tmp_path, capsys):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    assert main(["simulate", str(wl), "--synthetic", "--policy", "dstack,nosuch"]) == 2
    assert "known policies" in capsys.readouterr().err


def test_sweep_finds_the_load_where_attainment_falls_below_target():
    store = ProfileStore(profiles=zoo())
    w = Workload((ModelSpec("resnet50", 25, arrival=Arrival("poisson", rate=200)),), duration_s=0.5)
    s = sweep_rate(w, store, "temporal", target=0.99, rel_tol=0.1)
    assert s.max_factor > 1.0  # 200 req/s is light for one resnet50
    passing = [f for f, a in s.points if a >= 0.99]
    failing = [f for f, a in s.points if a < 0.99]
    assert s.max_factor == max(f for f in passing if f < min(failing))
    assert min(failing) / s.max_factor <= 1.1 + 1e-9
    assert s.max_rps == pytest.approx(200 * s.max_factor)
    # consistent with a direct run at that factor
    assert simulate(w.scaled(s.max_factor), store, "temporal").metrics.slo_attainment >= 0.99


def test_fluid_bound_scales_inversely_with_the_load_and_exceeds_what_a_policy_sustains():
    from gpuloom.bench.experiment import fluid_bound

    store = ProfileStore(profiles=zoo())
    w = Workload((ModelSpec("resnet50", 25, arrival=Arrival("poisson", rate=300)),
                  ModelSpec("mobilenet_v2", 10, arrival=Arrival("poisson", rate=600))), duration_s=0.5)
    f = fluid_bound(w, store)
    assert fluid_bound(w.scaled(2.0), store) == pytest.approx(f / 2, rel=0.02)
    s = sweep_rate(w, store, "temporal", rel_tol=0.1)
    assert s.max_factor <= f


def test_simulate_command_runs_policy_variants_with_their_options_side_by_side(tmp_path, capsys):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    rc = main(["simulate", str(wl), "--synthetic", "--policy", "dstack:min_sms=0,dstack:min_sms=64", "--out", str(tmp_path)])
    assert rc == 0
    runs = json.loads((tmp_path / "tiny.simulate.json").read_text())["runs"]
    assert [r["metrics"]["policy"] for r in runs] == ["dstack:min_sms=0", "dstack:min_sms=64"]
    small, big = ([sms for sms, _ in r["policy_config"]["partitions"]] for r in runs)
    assert min(small) < 64 <= min(big)  # the option reached the planner (and made a difference)


def test_simulate_command_runs_a_gpu_slower_than_the_profiles_the_policies_plan_with(tmp_path, capsys):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"resnet50": 3.0, "mobilenet_v2": 3.0}))
    out = {}
    for label, extra in (("plain", []), ("slowed", ["--slowdowns", str(slow), "--batch-overhead-ms", "0.5",
                                                        "--hold-spread", "0.6", "--host-launch-ms", "0.15",
                                                        "--hold-per-ms", "0.2", "--host-drop-ms", "0.04"])):
        d = tmp_path / label
        # (dstack told its hold: by default it would plan the simulated device's, 0.5 ms in the slowed run)
        assert main(["simulate", str(wl), "--synthetic", "--policy", "dstack:batch_overhead_ms=0,triton",
                     "--out", str(d)] + extra) == 0
        out[label] = json.loads((d / "tiny.simulate.json").read_text())
    assert out["plain"]["slowdowns"] is None and out["slowed"]["slowdowns"]["factors"]["resnet50"] == 3.0
    assert out["slowed"]["contention"]["batch_overhead_ms"] == 0.5 and out["slowed"]["contention"]["hold_spread"] == 0.6
    assert out["slowed"]["contention"]["host_launch_ms"] == 0.15 and out["slowed"]["contention"]["hold_per_ms"] == 0.2
    assert out["slowed"]["contention"]["host_drop_ms"] == 0.04 and out["plain"]["contention"]["host_drop_ms"] == 0.0
    for plain, slowed in zip(out["plain"]["runs"], out["slowed"]["runs"]):
        assert plain["policy_config"] == slowed["policy_config"]  # planned from the same profiles
        assert slowed["metrics"]["p50_ms"] > 2 * plain["metrics"]["p50_ms"]  # on a GPU 3x slower
    assert main(["simulate", str(wl), "--synthetic", "--slowdowns", str(tmp_path / "none.json")]) == 2
    assert "could not read" in capsys.readouterr().err
    assert main(["simulate", str(wl), "--synthetic", "--hold-spread", "-1"]) == 2
    err = capsys.readouterr().err
    assert "hold_spread" in err and "must be >= 0" in err and "found" in err


@pytest.mark.parametrize("spec, says", [("dstack:lookahead_ms=1", "real runtime"), ("dstack:bogus=1", "bogus"),
                                        ("dstack:min_sms=-8", "min_sms"), ("dstack:min_sms", "KEY=VALUE")])
def test_simulate_command_refuses_a_variant_it_cannot_simulate_and_says_why(tmp_path, capsys, spec, says):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    assert main(["simulate", str(wl), "--synthetic", "--policy", spec]) == 2
    assert says in capsys.readouterr().err


def test_a_rate_sweep_says_each_policy_it_finished_on_stderr(tmp_path, capsys):
    """The spinner shows nothing in a pipe or a log, where a sweep of several policies ran silent for minutes."""
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    assert main(["simulate", str(wl), "--synthetic", "--policy", "dstack,triton", "--sweep-rate",
                 "--sweep-duration", "0.5"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"swept dstack \(1/2\): highest load x[\d.]+ in [\d.]+ s", err), err
    assert re.search(r"swept triton \(2/2\): highest load x[\d.]+ in [\d.]+ s", err), err


def test_the_mixed_deadline_script_compares_both_queue_orders_and_keeps_the_class_choice(tmp_path):
    """scripts/sim_mixed_deadlines.py: each policy with its queues in arrival and in deadline order; the
    order is set on the policy object only (the class keeps its own), and with deadline order dstack
    serves nothing late on the overloaded mix."""
    import json

    from script_loader import load_script

    from gpuloom.policy.dstack import DStackPolicy
    from gpuloom.policy.triton import TritonPolicy

    script = load_script("sim_mixed_deadlines")
    out = tmp_path / "md.json"
    assert script.main(["examples/overload.yaml", "--duration", "1", "--policies", "dstack,triton", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"dstack", "triton"}
    for rows in doc["policies"].values():
        for order in ("arrival", "deadline"):
            r = rows[order]
            assert r["on_time"] + r["late"] + r["dropped"] <= r["requests"]
    assert doc["policies"]["dstack"]["deadline"]["late"] == 0
    assert DStackPolicy.deadline_queues is True and TritonPolicy.deadline_queues is False


def test_the_h200_contention_preset_is_the_calibrations_best_and_flags_change_one_parameter(tmp_path):
    from gpuloom.runtime.sim import ContentionModel

    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    runs = {}
    for label, extra in (("h200", ["--contention", "h200"]),
                         ("h200_hold", ["--contention", "h200", "--batch-overhead-ms", "0.5"]),
                         ("plain", [])):
        assert main(["simulate", str(wl), "--synthetic", "--policy", "dstack", "--out", str(tmp_path / label)] + extra) == 0
        runs[label] = json.loads((tmp_path / label / "tiny.simulate.json").read_text())
    h200 = runs["h200"]["contention"]
    assert runs["h200"]["contention_preset"] == "h200"
    assert (h200["batch_overhead_ms"], h200["hold_per_ms"], h200["host_launch_ms"], h200["demand_fraction"]) \
        == (0.75, 0.1, 0.15, 0.89)
    assert runs["h200_hold"]["contention"] == {**h200, "batch_overhead_ms": 0.5}  # only that one moved
    assert runs["plain"]["contention"] == json.loads(json.dumps(dataclasses.asdict(ContentionModel())))
    # the preset is what the calibration it cites found best (scripts/calibrate_sim.py --rank within)
    fit = json.loads((ROOT / "docs/results/runtime/sim_calibration_session45_hold_per_ms.json").read_text())["best"]
    preset = ContentionModel.h200_runs()
    for k in ("batch_overhead_ms", "hold_per_ms", "host_launch_ms", "demand_fraction", "hold_spread", "interference",
              "hold_per_request_ms"):
        assert getattr(preset, k) == fit[k], k


def test_the_h100_fast_host_preset_is_its_calibrations_best_and_only_the_hold_and_the_drops_differ(tmp_path):
    from gpuloom.runtime.sim import ContentionModel

    fast, h200 = ContentionModel.h100_fast_host(), ContentionModel.h200_runs()
    fit = json.loads((ROOT / "docs/results/runtime/sim_calibration_session52_h100_runs171_175.json").read_text())["best"]
    for k in ("batch_overhead_ms", "hold_per_ms", "host_launch_ms", "demand_fraction", "hold_spread", "interference",
              "hold_per_request_ms", "efficiency", "demand"):
        assert getattr(fast, k) == fit[k], k
    # the per-drop host time came later, fitted on runs 173 and 183's overloaded mix with the rest as above
    drop = json.loads((ROOT / "docs/results/runtime/sim_calibration_session56_host_drop_h100_runs173_183_186_187.json")
                      .read_text())["best"]
    assert fast.host_drop_ms == drop["host_drop_ms"] > 0
    for k in ("batch_overhead_ms", "hold_per_ms", "host_launch_ms", "demand_fraction"):
        assert drop[k] == fit[k], k
    differ = {k for k, v in dataclasses.asdict(fast).items() if dataclasses.asdict(h200)[k] != v}
    assert differ == {"batch_overhead_ms", "host_drop_ms"} and fast.batch_overhead_ms < h200.batch_overhead_ms
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    assert main(["simulate", str(wl), "--synthetic", "--policy", "nexus", "--contention", "h100-fast-host",
                 "--out", str(tmp_path / "fast")]) == 0
    run = json.loads((tmp_path / "fast" / "tiny.simulate.json").read_text())
    assert run["contention_preset"] == "h100-fast-host"
    # the preset, as the runtime runs by default: its drops' answers yield to launches (--no-yield-answers: not)
    yielding = dataclasses.replace(fast, drop_yield_ms=0.2, drop_answer_ms=min(0.01, fast.host_drop_ms))
    assert run["contention"] == json.loads(json.dumps(dataclasses.asdict(yielding)))


def test_simulate_yield_answers_charges_only_the_answers_of_drops_as_yielding(tmp_path):
    from gpuloom.runtime.sim import DROP_ANSWER_MS, ContentionModel

    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    assert main(["simulate", str(wl), "--synthetic", "--policy", "nexus", "--contention", "h100-fast-host",
                 "--yield-answers", "--out", str(tmp_path / "y")]) == 0
    c = json.loads((tmp_path / "y" / "tiny.simulate.json").read_text())["contention"]
    fast = ContentionModel.h100_fast_host()
    assert (c["drop_yield_ms"], c["drop_answer_ms"], c["host_drop_ms"]) == (0.2, DROP_ANSWER_MS, fast.host_drop_ms)
    # without a per-drop host time there is nothing to yield (the option is named, the model unchanged)
    assert main(["simulate", str(wl), "--synthetic", "--policy", "nexus", "--yield-answers",
                 "--out", str(tmp_path / "p")]) == 0
    assert json.loads((tmp_path / "p" / "tiny.simulate.json").read_text())["contention"]["drop_answer_ms"] == 0.0
    # on by default, as the runtime runs since the sixty-fifth session; --no-yield-answers: as it ran before
    for flag, want in (([], 0.2), (["--no-yield-answers"], None)):
        out = tmp_path / f"d{len(flag)}"
        assert main(["simulate", str(wl), "--synthetic", "--policy", "nexus", "--contention", "h100-fast-host",
                     *flag, "--out", str(out)]) == 0
        assert json.loads((out / "tiny.simulate.json").read_text())["contention"]["drop_yield_ms"] == want


def test_simulate_queue_limit_refuses_what_the_server_would_and_says_so_in_its_json(tmp_path, capsys):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY.replace("rate: 600", "rate: 60000"))  # mobilenet_v2 far past what the GPU serves
    assert main(["simulate", str(wl), "--synthetic", "--policy", "triton", "--queue-limit", "64",
                 "--out", str(tmp_path / "q")]) == 0
    run = json.loads((tmp_path / "q" / "tiny.simulate.json").read_text())
    assert run["queue_limit"] == 64
    drops = run["runs"][0]["metrics"]["drops"]
    assert drops.get("overloaded", 0) > 1000  # refused at the bound, as gpuloom serve answers 429
    assert main(["simulate", str(wl), "--synthetic", "--policy", "triton", "--out", str(tmp_path / "u")]) == 0
    unbounded = json.loads((tmp_path / "u" / "tiny.simulate.json").read_text())
    assert unbounded["queue_limit"] is None and "overloaded" not in unbounded["runs"][0]["metrics"]["drops"]
    capsys.readouterr()
    assert main(["simulate", str(wl), "--synthetic", "--queue-limit", "0"]) == 2
    assert "--queue-limit: expected a positive number" in " ".join(capsys.readouterr().err.split())
