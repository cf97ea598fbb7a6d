#!/usr/bin/env python
"""Would the scheduler serve more requests on time at the HTTP client if it knew the time a request
spends in the server outside its clock? Simulated, pure Python, no GPU.

Why: behind ``gpuloom serve --http-workers`` a request's deadline is counted from the worker's
handler (``waited_ms``), but the ring to the runtime, the runtime's answer and the way back through
the worker to the client are not counted. On an H100 at mix6 x1 over HTTP (run 209) the service
served 6,428 mobilenet_v2 requests of which 2,600 reached the client on time: the scheduler spent GPU
time on requests already late. A worker that adds the measured outside time to ``waited_ms``
(``--http-return-allowance auto``) makes the scheduler drop those instead.

The model: each request is sent at its workload time ``t`` and due at the client at ``t + SLO``; it
reaches the scheduler ``--forward-ms`` later (the part ``waited_ms`` does not cover); its answer
reaches the client ``--return-ms`` after the batch ends. The scheduler sees the deadline
``t + SLO - allowance`` (``allowance`` 0: the server now; ``forward + return``: a worker that knows
them). On time means ``finish + return <= t + SLO``. The policies run on the simulated GPU with the
shipped profiles (optionally a fitted contention preset), one run per policy, allowance and load.

    python3 scripts/sim_return_allowance.py examples/mix6.yaml --loads 0.9,1 --forward-ms 0.5 --return-ms 1,2,3 \\
        --out docs/results/simulate/return_allowance_mix6.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.experiment import make_context, make_requests  # noqa: E402
from gpuloom.bench.workload import load_workload, resolve_profiles, validate  # noqa: E402
from gpuloom.commands.simulate import CONTENTION_PRESETS, preset_model  # noqa: E402
from gpuloom.policy import Request, Status, make_policy  # noqa: E402
from gpuloom.runtime import Runtime, SimBackend  # noqa: E402


def run(policy: str, workload, profiles, contention, forward_ms: float, return_ms: float, allowance_ms: float) -> dict:
    """One simulated run; counts at the client (``finish + return_ms`` against the client's deadline)."""
    client = make_requests(workload)
    due = {r.id: r.deadline_ms for r in client}
    seen = [Request(r.id, r.model, r.arrival_ms + forward_ms, r.deadline_ms - allowance_ms) for r in client]
    seen.sort(key=lambda r: r.arrival_ms)  # (a constant shift keeps the order)
    profs = {m.name: profiles.get(m.name) for m in workload.models}
    rt = Runtime(make_policy(policy), SimBackend(profs, contention=contention),
                 make_context(workload, profs, contention=contention))
    until = workload.duration_s * 1000.0 + forward_ms
    rec = rt.run(seen, until_ms=until, drain_ms=max(m.slo_ms for m in workload.models))
    served = [r for r in rec.results if r.status == Status.SERVED]
    on_time = sum(r.finish_ms + return_ms <= due[r.request.id] + 1e-9 for r in served)
    per_model: dict[str, dict] = {}
    for r in rec.results:
        row = per_model.setdefault(r.request.model, {"requests": 0, "on_time": 0, "late": 0, "dropped": 0})
        row["requests"] += 1
        if r.status == Status.SERVED:
            row["on_time" if r.finish_ms + return_ms <= due[r.request.id] + 1e-9 else "late"] += 1
        elif r.status == Status.DROPPED:
            row["dropped"] += 1
    return {"requests": len(rec.results), "on_time": on_time, "late": len(served) - on_time,
            "dropped": sum(r.status == Status.DROPPED for r in rec.results),
            "on_time_ratio": round(on_time / max(1, len(rec.results)), 4), "models": per_model}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", help="a workload YAML (examples/mix6.yaml)")
    ap.add_argument("--loads", default="1", help="load factors on every arrival rate, comma-separated (default 1)")
    ap.add_argument("--forward-ms", type=float, default=0.5,
                    help="ms from the client's send to the scheduler that waited_ms does not cover (default 0.5)")
    ap.add_argument("--return-ms", default="2", help="ms from a batch's end to its answers at the client, "
                                                     "comma-separated values (default 2)")
    ap.add_argument("--policies", default="dstack,triton")
    ap.add_argument("--contention", choices=CONTENTION_PRESETS, default="plain",
                    help="the simulated GPU's contention model (default plain; h100-fast-host: the H100 hosts' holds)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    base = load_workload(args.workload)
    contention = preset_model(args.contention)
    out = {"workload": args.workload, "forward_ms": args.forward_ms, "contention": args.contention,
           "duration_s": args.duration, "seed": args.seed, "points": []}
    for load in floats(args.loads):
        workload = dataclasses.replace(base.scaled(load), duration_s=args.duration, seed=args.seed)
        profiles, warnings = resolve_profiles(workload, profiles_dir=None, synthetic=False)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        validate(workload, profiles)
        for ret in floats(args.return_ms):
            for policy in args.policies.split(","):
                legs = {name: run(policy, workload, profiles, contention, args.forward_ms, ret, allow)
                        for name, allow in (("off", 0.0), ("auto", args.forward_ms + ret))}
                gain = legs["auto"]["on_time"] / max(1, legs["off"]["on_time"])
                out["points"].append({"load": load, "return_ms": ret, "policy": policy, "legs": legs,
                                      "on_time_gain": round(gain, 4)})
                print(f"x{load:g} return {ret:g} ms {policy:7s} on time at the client {legs['off']['on_time']:6d} "
                      f"-> {legs['auto']['on_time']:6d} (x{gain:.3f}); late {legs['off']['late']:5d} -> "
                      f"{legs['auto']['late']:5d}; dropped {legs['off']['dropped']:5d} -> {legs['auto']['dropped']:5d}",
                      file=sys.stderr)
    if args.out:
        save_json(args.out, out)
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
