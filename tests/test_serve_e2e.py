"""scripts/serve_e2e.py on the CPU with tiny models: in-process vs HTTP over the same service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "serve_e2e.py"

WORKLOAD = """
duration_s: 1
seed: 5
models:
  - {name: alpha, slo_ms: 500, arrival: {kind: poisson, rate: 30}}
  - {name: beta,  slo_ms: 800, weight: 2, arrival: {kind: poisson, rate: 15}}
  - {name: gamma, slo_ms: 500, arrival: {kind: onoff, rate: 40, on_s: 0.5, off_s: 0.5}}
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[int, dict, str]:
    tmp = tmp_path_factory.mktemp("serve_e2e")
    wl = tmp / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "1,0.5",
                        "--duration", "1.5", "--max-batch", "4", "--clients", "2", "--loop-cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.exists(), p.stderr[-3000:]
    return p.returncode, json.loads(out.read_text()), p.stdout


def _expected_arrivals(scale: float) -> dict[str, int]:
    import dataclasses

    from gpuloom.bench.workload import arrival_times, workload_from_dict
    import yaml

    wl = workload_from_dict(yaml.safe_load(WORKLOAD))
    return {m: len(t) for m, t in arrival_times(dataclasses.replace(wl.scaled(scale), duration_s=1.5)).items()}


def test_every_http_request_is_answered_and_the_server_books_balance(report):
    rc, rep, _ = report
    assert rc == 0 and rep["ok"] and not rep["error"]
    assert [p["scale"] for p in rep["points"]] == [1.0, 0.5]
    assert rep["meta"]["inprocess_inputs"] == "pinned"  # the in-process reference skips the copy, as HTTP does
    assert rep["outputs"] == "copies"  # the service's default, for both legs
    # how fast this host was, at the start and the end: ratios of two machines (or one slowing) differ
    assert all(rep["meta"]["machine"][k]["python_loop_us"] > 0 for k in ("start", "end"))
    for pt in rep["points"]:
        expected = _expected_arrivals(pt["scale"])
        assert sum(expected.values()) > 10
        assert pt["books"] == {"all_answered": True, "server_balanced": True, "server_matches_client": True}
        for m, n in expected.items():
            h, i = pt["http"]["models"][m], pt["inprocess"]["models"][m]
            # both legs replay the same arrivals
            assert h["submitted"] == i["submitted"] == n
            assert h["answered"] == n == h["served"] + sum(h["errors"].values())
            srv = h["server"]
            assert srv["accepted"] == srv["success"] + srv["failure"] + sum(srv["dropped"].values())
            assert srv["success"] == h["served"] and srv["in_flight"] == 0
            assert h["on_time"] <= h["served"] and h["goodput_rps"] == pytest.approx(h["on_time"] / 1.5)


def test_ratio_is_http_goodput_over_in_process_goodput(report):
    _, rep, stdout = report
    for pt, row in zip(rep["points"], rep["summary"]):
        ip, ht = pt["inprocess"], pt["http"]
        assert ip["goodput_rps"] > 0 and ht["goodput_rps"] > 0
        assert pt["ratio"]["goodput"] == pytest.approx(ht["goodput_rps"] / ip["goodput_rps"])
        assert pt["meets_target"] == (pt["ratio"]["goodput"] >= rep["target"])
        assert row["ratio"] == pt["ratio"]["goodput"] and row["scale"] == pt["scale"]
        total_on_time = sum(v["on_time"] for v in ht["models"].values())
        assert ht["goodput_rps"] == pytest.approx(total_on_time / 1.5)
        for leg in (ip, ht):
            assert leg["p50_ms"] <= leg["p99_ms"]
            for v in leg["models"].values():
                assert v["p50_ms"] is None or v["p50_ms"] <= v["p99_ms"]
    assert "HTTP / in-process goodput" in stdout and "TOTAL" in stdout


def test_http_time_is_split_into_network_worker_bridge_and_service(report):
    """Where the network layer's cost goes: the clients' Server-Timing summaries and the service's own
    queue/compute split for both legs (worker and bridge only behind --http-workers)."""
    _, rep, stdout = report
    for pt in rep["points"]:
        for m, h in pt["http"]["models"].items():
            st = h["server_timing_ms"]
            assert st["service"]["n"] == h["served"] and st["service"]["p50"] <= h["p50_ms"]
            assert ("worker" in st) == bool(pt["http_workers"])
            for leg in (pt["inprocess"], pt["http"]):
                q, c = leg["models"][m]["queue_ms"], leg["models"][m]["compute_ms"]
                assert q["n"] == c["n"] == leg["models"][m]["served"] and q["mean"] >= 0 and c["mean"] > 0
    assert "where an HTTP request's time went" in stdout


def test_the_http_leg_reports_how_busy_its_client_and_worker_processes_were(report):
    """Which process limits the HTTP path: each client process's CPU share (every model it drove
    carries it) and each front-end worker's (none here: no --http-workers)."""
    _, rep, _ = report
    for pt in rep["points"]:
        h = pt["http"]
        shares = [m["client_cpu_s_per_s"] for m in h["models"].values() if m["submitted"]]
        assert shares and all(0 < x < 4 for x in shares)
        assert h["client_cpu_max_s_per_s"] == max(shares)
        assert h["worker_cpu_s_per_s"] == []


def test_loop_cpu_splits_the_runtime_threads_cpu_by_callback_in_both_legs(report):
    """--loop-cpu: the runtime loop thread's CPU per request, by what it ran (decisions, completions,
    arrivals), for the in-process and the HTTP leg alike."""
    _, rep, _ = report
    for pt in rep["points"]:
        for leg in (pt["inprocess"], pt["http"]):
            lc = leg["loop_cpu"]
            names = {r["callback"] for r in lc["callbacks"]}
            assert {"Runtime._decide", "Runtime._on_completion", "Runtime._on_online_arrivals"} <= names
            assert lc["requests"] == leg["submitted"] and lc["thread_us_per_request"] > 0
            charged = sum(r["us_per_request"] for r in lc["callbacks"])
            assert 0 < charged <= lc["thread_us_per_request"] * 1.05  # never more than the thread used (clock reads)


def test_bad_scale_is_a_usage_error():
    p = subprocess.run([sys.executable, str(SCRIPT), "examples/mix6.yaml", "--tiny", "--scale", "0,x"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "--scale" in p.stderr


def test_a_run_killed_after_its_first_scale_keeps_that_point(tmp_path):
    """The device's time limit kills serve_e2e mid-run: the JSON on disk already holds every scale
    finished, marked in progress."""
    import signal
    import time

    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "e2e.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "0.5,0.5,0.5",
                          "--duration", "1", "--max-batch", "4", "--clients", "1", "--out", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        end = time.monotonic() + 90
        while not out.exists() and time.monotonic() < end and p.poll() is None:
            time.sleep(0.1)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(10)
    rep = json.loads(out.read_text())
    assert rep["error"].startswith("in progress") and not rep["ok"]
    assert len(rep["points"]) >= 1 and rep["points"][0]["scale"] == 0.5


def test_views_with_torch_launches_are_refused_before_anything_is_built(tmp_path):
    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--outputs", "views",
                        "--torch-launch"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "drop --torch-launch" in p.stderr


def test_http_workers_auto_is_gpuloom_serves_default_for_this_host():
    import os

    from script_loader import load_script

    from gpuloom.commands.serve import default_http_workers

    e2e = load_script("serve_e2e")
    assert e2e.parse_args(["examples/mix6.yaml", "--http-workers", "auto"]).http_workers == \
        default_http_workers(os.cpu_count())
    assert e2e.parse_args(["examples/mix6.yaml", "--http-workers", "3"]).http_workers == 3


def test_worker_counts_take_turns_on_one_service_in_rounds(tmp_path):
    """--http-workers 0,1 --rounds 2: per round an in-process leg, then an HTTP leg per count through a
    server of its own on the same loaded service, the order reversed in the second round (A B B A)."""
    from gpuloom.serve.frontend import WORKER_NICE

    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "0.5",
                        "--duration", "1", "--max-batch", "4", "--clients", "1", "--http-workers", "0,1",
                        "--rounds", "2", "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"]
    assert rep["http_workers"] == [0, 1] and rep["rounds"] == 2 and rep["worker_nice"] == WORKER_NICE
    assert rep["ring_drain_on"] == "loop" and rep["return_allowance"] == "off"  # one value each: a scalar
    assert rep["early_answer"] == "off"
    assert [(pt["round"], pt["http_workers"]) for pt in rep["points"]] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    for pt in rep["points"]:
        assert pt["books"]["all_answered"] and pt["books"]["server_balanced"]
        assert ("bridge" in pt["http"]) == bool(pt["http_workers"])  # the leg went through its own server
    # the two legs of a round share that round's in-process leg
    assert rep["points"][0]["inprocess"] == rep["points"][1]["inprocess"] != rep["points"][2]["inprocess"]
    by_count = {r["http_workers"]: r for r in rep["comparison"]}
    assert sorted(by_count) == [0, 1]
    assert by_count[1]["ratios"] == [rep["points"][1]["ratio"]["goodput"], rep["points"][2]["ratio"]["goodput"]]
    assert "HTTP / in-process goodput by worker count" in p.stdout


def test_the_clients_take_turns_and_the_lean_ones_get_every_answer(tmp_path):
    """--client aiohttp,lean: one HTTP leg per client over the same server settings; both legs' books
    balance, and the comparison keys each by its client."""
    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "0.5",
                        "--duration", "1", "--max-batch", "4", "--clients", "1", "--http-workers", "1",
                        "--client", "aiohttp,lean", "--out", str(out)], capture_output=True, text=True, timeout=180,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["client"] == ["aiohttp", "lean"]
    assert [pt["client"] for pt in rep["points"]] == ["aiohttp", "lean"]
    for pt in rep["points"]:
        assert pt["books"]["all_answered"] and pt["books"]["server_balanced"]
        assert pt["http"]["served"] == pt["http"]["submitted"] > 0
    assert sorted(r["client"] for r in rep["comparison"]) == ["aiohttp", "lean"]


def test_ring_drains_and_return_allowances_take_turns_as_front_ends(tmp_path):
    """--ring-drain-on loop,thread --return-allowance off,auto: four HTTP legs per scale, each point
    recording its own, the report listing both values of each, the comparison one row per front end."""
    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "0.5",
                        "--duration", "1", "--max-batch", "4", "--clients", "1", "--http-workers", "1",
                        "--ring-drain-on", "loop,thread", "--return-allowance", "off,auto", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["ring_drain_on"] == ["loop", "thread"] and rep["return_allowance"] == ["off", "auto"]
    fronts = [("loop", "off"), ("loop", "auto"), ("thread", "off"), ("thread", "auto")]
    assert [(pt["ring_drain_on"], pt["return_allowance"]) for pt in rep["points"]] == fronts
    assert [(r["ring_drain_on"], r["return_allowance"]) for r in rep["summary"]] == fronts
    for pt in rep["points"]:
        assert pt["books"]["all_answered"] and pt["books"]["server_balanced"]
    assert sorted((r["ring_drain_on"], r["return_allowance"]) for r in rep["comparison"]) == sorted(fronts)
    assert "drain thread, allowance auto" in p.stdout
    assert "rings drained on thread, return allowance auto" in p.stderr


def test_the_early_answer_takes_turns_per_http_leg_and_the_service_keeps_its_own(tmp_path):
    """--early-answer off,on: two HTTP legs on one loaded service, each point recording its own; every
    request answered and the books balanced in both; the report lists both values."""
    wl = tmp_path / "three.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(wl), "--tiny", "--device", "cpu", "--scale", "0.5",
                        "--duration", "1", "--max-batch", "4", "--clients", "1", "--http-workers", "1",
                        "--early-answer", "off,on", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["early_answer"] == ["off", "on"]
    assert [pt["early_answer"] for pt in rep["points"]] == ["off", "on"]
    assert [r["early_answer"] for r in rep["summary"]] == ["off", "on"]
    for pt in rep["points"]:
        assert pt["books"]["all_answered"] and pt["books"]["server_balanced"]
        assert pt["http"]["served"] == pt["http"]["submitted"] > 0
    assert sorted(r["early_answer"] for r in rep["comparison"]) == ["off", "on"]
    assert "early answer on" in p.stderr and "early  on" in p.stdout


def test_bad_early_answer_values_are_usage_errors():
    from script_loader import load_script

    e2e = load_script("serve_e2e")
    with pytest.raises(SystemExit):
        e2e.parse_args(["examples/mix6.yaml", "--early-answer", "yes"])


def test_front_ends_are_every_combination_of_the_lists_given():
    from script_loader import load_script

    from gpuloom.serve.frontend import WORKER_NICE

    e2e = load_script("serve_e2e")
    args = e2e.parse_args(["examples/mix6.yaml", "--ring-drain-on", "loop,thread", "--return-allowance", "off,auto"])
    assert args.front_ends == [e2e.FrontEnd(0, WORKER_NICE, "lean", d, a, "off") for d in ("loop", "thread")
                               for a in ("off", "auto")]
    args = e2e.parse_args(["examples/mix6.yaml", "--http-workers", "1,2"])
    assert args.front_ends == [e2e.FrontEnd(w, WORKER_NICE, "lean", "loop", "off", "off") for w in (1, 2)]  # defaults
    args = e2e.parse_args(["examples/mix6.yaml", "--return-allowance", "off,auto", "--early-answer", "off,on"])
    assert [(f.return_allowance, f.early_answer) for f in args.front_ends] == [
        ("off", "off"), ("off", "on"), ("auto", "off"), ("auto", "on")]
    args = e2e.parse_args(["examples/mix6.yaml", "--intake-window-ms", "0,0.5", "--switch-interval-ms", "off,1"])
    assert [(f.intake_window_ms, f.switch_interval_ms) for f in args.front_ends] == [
        (0.0, None), (0.0, 1.0), (0.5, None), (0.5, 1.0)]
    assert e2e.FrontEnd.of_point({"http_workers": 8}).intake_window_ms == 0.0  # a report from before the window
    for flag, bad in (("--intake-window-ms", "11"), ("--intake-window-ms", "soon"), ("--switch-interval-ms", "0"),
                      ("--switch-interval-ms", "on")):
        with pytest.raises(SystemExit):
            e2e.parse_args(["examples/mix6.yaml", flag, bad])


def test_batch_split_weighs_each_batch_size_by_its_batches_and_leaves_unknown_holds_unknown():
    from script_loader import load_script

    e2e = load_script("serve_e2e")
    rows = [{"model": "a", "sms": 64, "batch": 1, "batches": 30, "measured_ms": 1.0, "hold_ms": 0.5},
            {"model": "a", "sms": 64, "batch": 4, "batches": 10, "measured_ms": 2.0, "hold_ms": 1.0},
            {"model": "b", "sms": 64, "batch": 2, "batches": 5, "measured_ms": 3.0}]
    out = e2e.batch_split(rows)
    assert out["a"]["batches"] == 40 and out["a"]["mean_batch"] == (30 + 40) / 40
    assert out["a"]["device_ms_per_batch"] == (30 * 1.0 + 10 * 2.0) / 40
    assert out["a"]["hold_ms_per_batch"] == (30 * 0.5 + 10 * 1.0) / 40
    assert out["b"]["mean_batch"] == 2 and out["b"]["hold_ms_per_batch"] is None


def test_the_comparison_gives_each_count_its_rounds_in_order_with_mean_and_spread():
    from script_loader import load_script

    e2e = load_script("serve_e2e")

    def pt(scale, workers, ratio, nice=10):
        return {"scale": scale, "http_workers": workers, "worker_nice": nice, "ratio": {"goodput": ratio}}

    rows = e2e.comparison([pt(1, 4, 0.5), pt(1, 8, 0.7), pt(1, 8, 0.9), pt(1, 4, None), pt(0.5, 8, 1.0),
                           pt(1, 8, 0.3, nice=0), pt(1, 8, 0.4, nice=0)])
    assert [(r["scale"], r["http_workers"], r["worker_nice"], r["ratios"]) for r in rows] == [
        (0.5, 8, 10, [1.0]), (1, 4, 10, [0.5, None]), (1, 8, 0, [0.3, 0.4]), (1, 8, 10, [0.7, 0.9])]
    assert rows[1]["mean"] == 0.5 and rows[1]["spread"] == 0.0
    assert abs(rows[3]["mean"] - 0.8) < 1e-12 and abs(rows[3]["spread"] - 0.2) < 1e-12
    # points of reports from before them: rings drained on the loop, no return allowance
    assert {(r["ring_drain_on"], r["return_allowance"]) for r in rows} == {("loop", "off")}


def test_the_comparison_keeps_ring_drains_and_return_allowances_apart():
    from script_loader import load_script

    e2e = load_script("serve_e2e")

    def pt(ratio, **front):
        return {"scale": 1, "http_workers": 4, "worker_nice": 0, "client": "lean", "ratio": {"goodput": ratio},
                **front}

    rows = e2e.comparison([pt(0.5), pt(0.6, ring_drain_on="loop", return_allowance="auto"),
                           pt(0.7, ring_drain_on="thread", return_allowance="off"), pt(0.9, return_allowance="off")])
    assert [(r["ring_drain_on"], r["return_allowance"], r["ratios"]) for r in rows] == [
        ("loop", "auto", [0.6]), ("loop", "off", [0.5, 0.9]), ("thread", "off", [0.7])]


def test_a_bad_worker_count_or_round_count_is_a_usage_error():
    for extra in (["--http-workers", "2,x"], ["--rounds", "0"], ["--worker-nice", "0,20"], ["--client", "curl"],
                  ["--ring-drain-on", "loop,x"], ["--return-allowance", "on"], ["--return-allowance", ","]):
        p = subprocess.run([sys.executable, str(SCRIPT), "examples/mix6.yaml", "--tiny", *extra],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2 and extra[0] in p.stderr, p.stderr


def test_each_leg_reports_its_lanes_work_and_turnarounds(report):
    """Both legs carry each lane's work in the leg (lane_deltas): its batches, which together ran every
    served request, and how often and how long a lane sat free with work waiting (its turnaround)."""
    _, rep, _ = report
    for pt in rep["points"]:
        for leg in (pt["inprocess"], pt["http"]):
            lanes = leg["lanes"]
            assert lanes and sum(q["batches"] for q in lanes) * 4 >= leg["served"] > 0  # (--max-batch 4)
            for q in lanes:
                assert 0 <= q.get("turnarounds", 0) <= q["batches"]
                if q.get("turnarounds"):
                    assert 0 <= q["turnaround_p50_ms"] <= q["turnaround_p99_ms"]


def test_the_fake_device_serves_the_workloads_models_as_profiled_with_slowed_slos(tmp_path):
    """--fake-device: the shipped H200 profiles' models, slowed, on no GPU and no models: both legs
    served, every request answered, the SLOs slowed with the device."""
    out = tmp_path / "fake.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "examples/mix6.yaml", "--fake-device", "8", "--scale", "0.02",
                        "--duration", "1.5", "--clients", "1", "--http-workers", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "GPULOOM_LAUNCH_FIRST": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["device"] == "fake" and rep["fake_slow"] == 8 and rep["ok"]
    assert rep["meta"]["gpuloom_settings"]["GPULOOM_LAUNCH_FIRST"] == "1"  # which leg of an A/B it was
    (pt,) = rep["points"]
    assert pt["books"]["all_answered"] and pt["books"]["server_balanced"]
    assert pt["inprocess"]["goodput_rps"] > 0 and pt["http"]["goodput_rps"] > 0
    assert pt["http"]["models"]["mobilenet_v2"]["slo_ms"] == 80.0  # mix6's 10 ms, 8 times slower
    assert "x8 slower than the H200's profiles" in p.stdout


def test_the_fake_device_refuses_a_speed_below_the_h200s_or_a_device_of_its_own():
    for extra, says in ((["--fake-device", "0.5"], "(>= 1)"), (["--fake-device", "2", "--tiny"], "drop --tiny")):
        p = subprocess.run([sys.executable, str(SCRIPT), "examples/mix6.yaml", *extra],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2 and says in p.stderr, p.stderr
