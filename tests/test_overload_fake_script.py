"""scripts/diag_overload_fake.py: the world it builds and what it tells the simulator (CPU)."""

from __future__ import annotations

import math

import pytest

from script_loader import load_script


def test_the_simulator_is_told_the_lanes_mean_hold_and_their_spread_weighted_by_batches():
    mod = load_script("diag_overload_fake")
    z99 = load_script("sim_measured_hold").Z99
    lanes = [{"batches": 300, "gap_ms": 1.0, "shared": True, "hold_p50_ms": 0.5, "hold_p99_ms": 0.5 * math.exp(z99 * 0.6)},
             {"batches": 100, "gap_ms": 3.0, "shared": True, "hold_p50_ms": 1.0, "hold_p99_ms": 1.0 * math.exp(z99 * 1.0)}]
    hold, sigma = mod.told_hold(lanes)
    assert hold == pytest.approx(1.5) and sigma == pytest.approx(0.7)
    assert mod.told_hold([{"batches": 10, "gap_ms": 0.4, "shared": True}]) == (pytest.approx(0.4), 0.0)  # no tails kept: no spread


def test_the_script_runs_a_leg_and_writes_what_it_measured_and_simulated(tmp_path, monkeypatch):
    mod = load_script("diag_overload_fake")
    out = tmp_path / "ovf.json"
    monkeypatch.setenv("GPULOOM_LAUNCH_FIRST", "0")  # the leg asks 1; the setting is put back after
    monkeypatch.setattr("sys.argv", ["diag_overload_fake.py", "--policy", "nexus", "--legs", "1", "--duration", "1",
                                     "--scale", "0.1", "--out", str(out)])
    assert mod.main() == 0
    import json
    import logging
    import os

    assert not logging.root.manager.disable and os.environ["GPULOOM_LAUNCH_FIRST"] == "0"  # both as they were

    rep = json.loads(out.read_text())
    (leg,) = rep["legs"]
    assert leg["launch_first"] == "1" and leg["policy"] == "nexus"
    got, sim = leg["measured"], leg["simulated"]
    assert got["goodput_rps"] > 0 and sim["goodput_rps"] > 0
    assert {m["model"] for m in got["models"]} == {m["model"] for m in sim["models"]} == {
        "resnet50", "mobilenet_v2", "inception_v3", "vgg16", "bert_base"}
    (lane,) = got["lanes"]  # nexus: one lane, every batch's submit lag kept
    assert lane["batches"] > 0 and 0 <= lane["submit_lag_p50_ms"] <= lane["submit_lag_p99_ms"]
    cpu = got["loop_cpu"]["thread_cpu_s_per_s"]  # the loop's CPU per request that entered: a host probe
    assert got["entered"] >= sum(m["served"] + m["dropped"] for m in got["models"]) > 0
    # read as a bench point's: the CPU per second over the requests per second of the arrivals' duration
    assert got["loop_us_per_request"] == pytest.approx(cpu / (got["entered"] / rep["duration_s"]) * 1e6)
    assert sim["told_hold_ms"] >= 0 and sim["goodput_error"] == pytest.approx(sim["goodput_rps"] / got["goodput_rps"] - 1)


def test_the_loop_threads_answering_is_read_per_request_answered_served_or_dropped():
    mod = load_script("diag_overload_fake")
    got = {"loop_cpu_wall_s": 2.0, "models": [{"served": 300, "dropped": 700}, {"served": 1000, "dropped": 0}],
           "loop_cpu": {"thread_cpu_s_per_s": 0.2, "callbacks": [
               {"callback": "Runtime._answer_due", "cpu_s_per_s": 0.01},
               {"callback": "Runtime._decide", "cpu_s_per_s": 0.005}]}}
    line = mod.answer_cost(got)  # 0.01 CPU-s/s over 2 s for 2,000 answers: 10 us each
    assert "0.200 CPU-s/s" in line and "answering 10.0 us per request answered" in line and "_decide 0.005" in line
    got["loop_cpu"]["callbacks"] = got["loop_cpu"]["callbacks"][1:]
    assert "answering ? us" in mod.answer_cost(got) and "in all ? us per request that entered" in mod.answer_cost(got)
    got["loop_us_per_request"] = 12.34
    assert "in all 12.3 us per request that entered" in mod.answer_cost(got)
