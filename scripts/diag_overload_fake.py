#!/usr/bin/env python
"""A policy at overload on a fake device, launch-first on and off, against the simulator (CPU).

Why: on the GPU nexus served the overloaded mix 26% below the simulator (run 173): its requests came
back late (mobilenet_v2: p50 11.1 ms against a 10 ms SLO, 421 of 2,597 served on time), where the
simulator serves them in time. The runtime answered the dozens of requests nexus drops per decision
before launching the batch it decided on, while nexus's early drop assumed that batch starts at the
decision's clock. This reproduces that on any machine: the service (its runtime, execution backend,
policy) on a fake device whose batches take the shipped H200 profiles' time on their partition
(``gpuloom.bench.fake``; ``--slow`` times longer, with SLOs ``--slow`` times longer and
rates ``--scale``: the same overload at a request rate a small CPU keeps up with), in legs
alternating ``GPULOOM_LAUNCH_FIRST`` (``--legs``), each
point against the simulator of the same world told the lanes' measured hold (mean, lognormal spread).

Per leg and policy: goodput, attainment, per model served and on time, each lane's submit lag (its
decision's clock to its submit: what answering the drops first costs the batch) and hold, the loop
thread's CPU per request that entered (``loop_us_per_request``; run on a GPU host before its bench, a
probe of that host's per-drop time), and the simulator's goodput and error.

    python scripts/diag_overload_fake.py --policy nexus,dstack --legs 0,1,0,1 \\
        --out docs/results/runtime/overload_fake_cpu_session55.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sim_measured_hold import measured, measured_spread  # noqa: E402

from gpuloom.bench.e2e import check_arrivals, run_point, save_json  # noqa: E402
from gpuloom.bench.experiment import simulate  # noqa: E402
from gpuloom.bench.fake import fake_models, fake_service, fake_world  # noqa: E402
from gpuloom.bench.host_hold import cpu_us_per_request  # noqa: E402
from gpuloom.bench.machine import gpuloom_settings, python_loop_us  # noqa: E402
from gpuloom.bench.workload import load_workload  # noqa: E402
from gpuloom.runtime.events import cpu_delta  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402

def measured_point(wl, profiles: dict, policy: str, *, scale: float, duration_s: float, max_batch: int,
                   arrivals: str = "thread") -> dict:
    """One point served by the service on a ``ProfiledFakeLayer`` (``gpuloom.bench.fake``)."""
    svc = fake_service(policy, profiles)
    svc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.load_many(list(fake_models(wl, max_batch, rate_scale=scale).values()))
        cpu0, t0 = svc.loop_cpu(True), time.monotonic()
        pt = run_point(svc, wl, policy, scale=scale, duration_s=duration_s, pinned_inputs=False, arrivals=arrivals)
        wall = time.monotonic() - t0
        cpu = cpu_delta(cpu0, svc.loop_cpu(), wall)
    finally:
        svc.close()
    lanes = [q for q in pt.layouts if q["batches"]]
    entered = sum(m.submitted for m in pt.models)
    # the loop's CPU per request that entered, read as a bench point's (host_hold): the same runtime
    # code on this host's CPU, a probe of the per-drop host time taken before a GPU bench (runs 202-203)
    per_request = cpu_us_per_request(cpu["thread_cpu_s_per_s"], entered, duration_s)
    return {"entered": entered, "loop_us_per_request": per_request,
            "goodput_rps": pt.goodput_rps, "slo_attainment": pt.slo_attainment,
            "models": [{"model": m.model, "served": m.served, "on_time": m.on_time, "dropped": m.dropped,
                        "p50_ms": m.p50_ms, "p99_ms": m.p99_ms} for m in pt.models],
            "lanes": lanes, "loop_lag": pt.loop_lag, "loop_cpu": cpu, "loop_cpu_wall_s": wall,
            "answer_yields": pt.host.get("answer_yields", 0), "arrivals": pt.arrivals,
            "answer_us_per_request": pt.host.get("answer_us_per_request"),
            "intake_us_per_request": pt.host.get("intake_us_per_request")}


def told_hold(lanes: list[dict]) -> tuple[float, float]:
    """(mean hold ms, lognormal sigma) over the lanes, weighted by their batches: what the simulator is
    told, read as ``sim_measured_hold`` reads a bench point's lanes."""
    point = {"layouts": lanes}
    return max(0.0, measured(point)[0]), measured_spread(point) or 0.0


def simulated_point(wl, profiles: dict, policy: str, *, scale: float, duration_s: float, hold: float, sigma: float) -> dict:
    run = simulate(dataclasses.replace(wl.scaled(scale), duration_s=duration_s), profiles, policy,
                   contention=ContentionModel(batch_overhead_ms=hold, hold_spread=sigma)).metrics
    return {"goodput_rps": run.goodput_rps, "slo_attainment": run.slo_attainment,
            "models": [{"model": m.model, "served": m.served, "on_time": m.on_time} for m in run.models]}


def answer_cost(got: dict) -> str:
    """The loop thread's CPU per s, and what answering took per request answered (served or dropped)."""
    cpu = got["loop_cpu"]
    answered = sum(m["served"] + m["dropped"] for m in got["models"])
    due = [r for r in cpu["callbacks"] if r["callback"].endswith("_answer_due")]
    per = (sum(r["cpu_s_per_s"] for r in due) * got["loop_cpu_wall_s"] / answered * 1e6) if due and answered else None
    thread = cpu["thread_cpu_s_per_s"]
    top = ", ".join(f"{r['callback'].rsplit('.', 1)[-1]} {r['cpu_s_per_s']:.3f}" for r in cpu["callbacks"][:4])
    entered = got.get("loop_us_per_request")
    return (f"{'?' if thread is None else f'{thread:.3f}'} CPU-s/s ({top}); answering "
            f"{'?' if per is None else f'{per:.1f}'} us per request answered; in all "
            f"{'?' if entered is None else f'{entered:.1f}'} us per request that entered")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(ROOT / "examples" / "overload.yaml"))
    ap.add_argument("--policy", default="nexus", help="comma-separated policies")
    ap.add_argument("--scale", type=float, default=0.25, help="load factor (default 0.25: a 2-core VM keeps up)")
    ap.add_argument("--slow", type=float, default=4.0, help="device and SLOs this many times slower (default 4)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per point")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--legs", default="0,1,0,1", help="the --leg-env variable's value per leg (default 0,1,0,1)")
    ap.add_argument("--leg-env", default="GPULOOM_LAUNCH_FIRST",
                    help="the process-wide setting the legs alternate (default GPULOOM_LAUNCH_FIRST; or "
                         "GPULOOM_YIELD_ANSWERS: answers that stop for a batch that finished meanwhile). Yielding "
                         "answers is on by default since the sixty-fifth session and needs launch-first, so a "
                         "launch-first A/B switches it too unless GPULOOM_YIELD_ANSWERS=0 is set; each leg records "
                         "its settings")
    ap.add_argument("--arrivals", default="thread",
                    help="who submits each point's requests (gpuloom bench's arrivals key): thread (default) or "
                         "loop, the runtime's own thread; comma-separated: every policy once per value, in turn")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        for x in a.arrivals.split(","):
            check_arrivals(x)
    except ValueError as e:
        ap.error(f"--arrivals: {e}")
    wl, profiles = fake_world(load_workload(a.workload), a.slow, a.max_batch)
    prior = os.environ.get(a.leg_env)
    logging.disable(logging.WARNING)  # the fake device's drops and the service's replans
    try:
        legs = run_legs(a, wl, profiles)
    finally:  # (as they were: a test runs this in its own process)
        logging.disable(logging.NOTSET)
        if prior is None:
            os.environ.pop(a.leg_env, None)
        else:
            os.environ[a.leg_env] = prior
    report = {"workload": a.workload, "policies": a.policy.split(","), "arrivals": a.arrivals.split(","),
              "scale": a.scale, "slow": a.slow,
              "duration_s": a.duration, "max_batch": a.max_batch, "legs": legs,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                          "python_loop_us": python_loop_us()}}
    if a.out:
        save_json(a.out, report)
        print(f"wrote {a.out}")
    return 0


def run_legs(a, wl, profiles: dict) -> list[dict]:
    """Each leg (``a.legs``: values of ``a.leg_env``) and policy: measured, then simulated."""
    legs = []
    for i, env in enumerate(a.legs.split(",")):
        os.environ[a.leg_env] = env  # read by each runtime at its start
        for policy, arrivals in [(p, x) for p in a.policy.split(",") for x in a.arrivals.split(",")]:
            t0 = time.monotonic()
            got = measured_point(wl, profiles, policy, scale=a.scale, duration_s=a.duration, max_batch=a.max_batch,
                                 arrivals=arrivals)
            hold, sigma = told_hold(got["lanes"])
            sim = simulated_point(wl, profiles, policy, scale=a.scale, duration_s=a.duration, hold=hold, sigma=sigma)
            sim["told_hold_ms"], sim["told_hold_sigma"] = hold, sigma
            sim["goodput_error"] = sim["goodput_rps"] / got["goodput_rps"] - 1.0 if got["goodput_rps"] else None
            legs.append({"leg": i, "launch_first": os.environ.get("GPULOOM_LAUNCH_FIRST", "1"), "env": {a.leg_env: env},
                         "settings": gpuloom_settings(),
                         "policy": policy, "arrivals": arrivals, "measured": got, "simulated": sim, "seconds": time.monotonic() - t0})
            lag = ", ".join(f"{q['label']} {q.get('submit_lag_p50_ms', float('nan')):.2f} / "
                            f"{q.get('submit_lag_p99_ms', float('nan')):.2f}" for q in got["lanes"])
            on_time = ", ".join(f"{m['model']} {m['on_time']}/{m['served']}" for m in got["models"])
            hold_p50 = ", ".join(f"{q['label']} {q.get('hold_p50_ms') or float('nan'):.2f}" for q in got["lanes"])
            late = got["arrivals"].get("late_ms") or {}
            print(f"leg {i} {a.leg_env}={env} {policy}, arrivals by {arrivals} (late p99 {late.get('p99', float('nan')):.1f} "
                  f"ms): goodput {got['goodput_rps']:.1f} req/s (sim told hold "
                  f"{hold:.2f} ms, sigma {sigma:.2f}: {sim['goodput_rps']:.1f}, {sim['goodput_error']:+.1%}); "
                  f"submit lag p50 / p99 ms: {lag}; hold p50 ms: {hold_p50}; answers stopped for a finished batch {got['answer_yields']} times; "
                  f"on time / served: {on_time}", flush=True)
            print(f"  loop thread: {answer_cost(got)}", flush=True)
    return legs


if __name__ == "__main__":
    sys.exit(main())
