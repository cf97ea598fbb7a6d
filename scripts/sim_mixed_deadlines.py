#!/usr/bin/env python
"""Per-request deadlines in simulation: each model's queue in deadline order against arrival order.

Why: a client may send its own timeout (KServe's ``timeout`` parameter, the server's deadline
header), and an HTTP worker's wait shortens a deadline by a little; so deadlines along a model's
queue are not always increasing. The policies read a queue's head as its most urgent request (they
drop hopeless heads, order models earliest deadline first, size a batch by its first request's slack).
Since the thirty-ninth session the runtime keeps each queue in deadline order
for the policies with ``deadline_queues`` (dstack, nexus, ideal; the FIFO baselines keep arrival
order, as the systems they model do). This replays a workload whose requests draw their deadline
from ``--factors`` x their model's SLO (the workload key ``deadline_factors`` on every model), with
each policy's queues in arrival order and in deadline order (the policy option ``queues``), on the simulated H200 with its shipped profiles. Pure Python, no GPU; one JSON document on stdout (or ``--out``)::

    python3 scripts/sim_mixed_deadlines.py examples/mix6.yaml --load 1.0 --out docs/results/simulate/mixed_deadlines_mix6.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.experiment import make_context, make_requests  # noqa: E402
from gpuloom.bench.workload import load_workload, resolve_profiles, validate  # noqa: E402
from gpuloom.policy import Status, make_policy, policy_names  # noqa: E402
from gpuloom.runtime import Runtime, SimBackend  # noqa: E402


def run(policy: str, workload, profiles, requests, *, order: str) -> dict:
    pol = make_policy(policy, queues=order)
    profs = {m.name: profiles.get(m.name) for m in workload.models}
    rt = Runtime(pol, SimBackend(profs), make_context(workload, profs))
    until = workload.duration_s * 1000.0
    rec = rt.run(requests, until_ms=until, drain_ms=max(m.slo_ms for m in workload.models))
    served = [r for r in rec.results if r.status == Status.SERVED]
    on_time = sum(r.finish_ms <= r.request.deadline_ms + 1e-9 for r in served)
    return {"requests": len(rec.results), "on_time": on_time, "late": len(served) - on_time,
            "dropped": sum(r.status == Status.DROPPED for r in rec.results),
            "on_time_ratio": round(on_time / max(1, len(rec.results)), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", help="a workload YAML (examples/mix6.yaml)")
    ap.add_argument("--load", type=float, default=1.0, help="scale every arrival rate (default 1.0)")
    ap.add_argument("--factors", default="0.25,1,1,4", help="a request's deadline: one of these x its SLO, at random")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (arrivals and deadlines)")
    ap.add_argument("--policies", default=",".join(p for p in policy_names()))
    ap.add_argument("--profiles", default=None, help="profile directory (default: the shipped ones, as gpuloom simulate)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    workload = dataclasses.replace(load_workload(args.workload).scaled(args.load), duration_s=args.duration)
    profiles, warnings = resolve_profiles(workload, profiles_dir=args.profiles, synthetic=False)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    validate(workload, profiles)
    factors = [float(f) for f in args.factors.split(",")]
    workload = dataclasses.replace(workload, seed=args.seed, models=tuple(
        dataclasses.replace(m, deadline_factors=tuple(factors)) for m in workload.models))
    requests = make_requests(workload)
    out = {"workload": args.workload, "load": args.load, "duration_s": args.duration, "factors": factors,
           "seed": args.seed, "policies": {}}
    for policy in args.policies.split(","):
        rows = {order: run(policy, workload, profiles, requests, order=order) for order in ("arrival", "deadline")}
        rows["on_time_gain"] = round(rows["deadline"]["on_time"] / max(1, rows["arrival"]["on_time"]), 3)
        out["policies"][policy] = rows
        print(f"{policy:9s} on time {rows['arrival']['on_time']:6d} -> {rows['deadline']['on_time']:6d} "
              f"(x{rows['on_time_gain']:.3f}); late {rows['arrival']['late']:6d} -> {rows['deadline']['late']:6d}",
              file=sys.stderr)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
