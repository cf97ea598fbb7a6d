"""dstack's admission at the delivered rate (``dstack:adapt=true``) against plain dstack, in simulation.

Runs the shipped workloads at the points measured on the H200 (overload x0.5 and x1, mix6 x1,
light3 x8; ``--max-batch 16`` as the bench) through the simulated backend with the H200 profiles,
under two host models: ``plain`` (each batch held 0.25 ms beyond its device time, the host never
saturates) and ``interpreter`` (the shared-interpreter model fitted to the overloaded mix in the
sixteenth session: 0.06 ms per request, 0.6 ms per batch; it reproduces dstack's collapse there
without shedding, and is too slow on mix6 and light3: docs/reports/runtime.md).

What it can show on a CPU: that ``adapt`` sheds where a saturated host makes a model miss, and
leaves a host that keeps up alone. The gain on the GPU needs the GPU.

    .venv/bin/python scripts/sim_adaptive_admission.py --duration 4 --out docs/results/runtime/sim_adapt_session17.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.experiment import simulate  # noqa: E402
from gpuloom.bench.workload import load_workload  # noqa: E402
from gpuloom.bench.variants import parse_policy_spec  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.service import trim_profile  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HOSTS = {
    "plain": ContentionModel(batch_overhead_ms=0.25),
    "interpreter": ContentionModel(batch_overhead_ms=0.25, gil_request_ms=0.06, gil_batch_ms=0.6),
}
POINTS = (("overload", 0.5), ("overload", 1.0), ("mix6", 1.0), ("light3", 8.0))
POLICIES = ("dstack", "dstack:adapt=true", "dstack:shed=false")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds of arrivals per point")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    store = ProfileStore.builtin("h200")
    rows = []
    for host, contention in HOSTS.items():
        for name, scale in POINTS:
            w = load_workload(EXAMPLES / f"{name}.yaml")
            wl = dataclasses.replace(w.scaled(scale), duration_s=args.duration)
            profs = {m.name: trim_profile(store.get(m.name), args.max_batch) for m in w.models}
            for spec in POLICIES:
                pol, opts, _ = parse_policy_spec(spec)
                t0 = time.perf_counter()
                run = simulate(wl, profs, pol, contention=contention, options=opts)
                m = run.metrics
                shed = sum(r.reason == "shed" for r in run.record.results)
                row = {"host": host, "workload": name, "scale": scale, "policy": spec,
                       "goodput_rps": round(m.goodput_rps, 1), "slo_attainment": round(m.slo_attainment, 4),
                       "p99_ms": round(m.p99_ms, 2), "shed": shed, "arrived": m.arrived,
                       "delivery_caps": run.policy.get("delivery_caps"), "delivery_cuts": run.policy.get("delivery_cuts"),
                       "wall_s": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(f"{host:11s} {name:8s} x{scale:<4} {spec:20s} goodput {m.goodput_rps:7.0f}/s "
                      f"attainment {m.slo_attainment:.3f} shed {shed:6d} cuts {row['delivery_cuts']}", flush=True)
    out = {"script": "scripts/sim_adaptive_admission.py", "duration_s": args.duration, "max_batch": args.max_batch,
           "hosts": {h: dataclasses.asdict(c) for h, c in HOSTS.items()}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
