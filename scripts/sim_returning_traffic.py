#!/usr/bin/env python
"""Traffic coming back to a model the running plan gives no slots: how much of it dstack serves (CPU).

Why (sixty-fifth session): a re-plan for measured rates leaves out a model that had no traffic. Model b's
batch of one (6.35 ms at the default ``--b-item-ms 200``) fits no gap between model a's slots, so until a re-plan gives b slots every request
of b is dropped; and a plan made too early, for the rate a 2 s window shows a quarter second in, gives b
too little until the cooldown ends. a at 300 requests/s throughout, b at ``--rate`` from 3 s, 10 s of
arrivals on the simulated GPU. Run with another checkout first on ``PYTHONPATH`` to time the code before.

    python scripts/sim_returning_traffic.py --rate 300,600 --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # (a PYTHONPATH given first wins: another tree's policy)
    sys.path.append(str(ROOT))

import numpy as np  # noqa: E402

import gpuloom  # noqa: E402
from gpuloom.bench.experiment import make_context  # noqa: E402
from gpuloom.bench.metrics import compute_metrics  # noqa: E402
from gpuloom.bench.workload import Arrival, ModelSpec, Workload  # noqa: E402
from gpuloom.plan import Demand, plan  # noqa: E402
from gpuloom.policy import make_policy  # noqa: E402
from gpuloom.policy.types import Request  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.profile.synthetic import synthetic_profile  # noqa: E402
from gpuloom.runtime import Runtime, SimBackend  # noqa: E402


def run(b_rate: float, b_item_ms: float = 200.0, seed: int = 1) -> dict:
    a = synthetic_profile("a", per_item_sm_ms=40.0, knee1=32)
    b = synthetic_profile("b", per_item_sm_ms=b_item_ms, knee1=32)
    only_a = plan([Demand("a", rate=300, slo_ms=10)], ProfileStore(profiles=[a, b]))
    w = Workload((ModelSpec("a", 10.0, arrival=Arrival("poisson", rate=300)),
                  ModelSpec("b", 100.0, arrival=Arrival("poisson", rate=5))), duration_s=10)
    profiles = {"a": a, "b": b}
    rng = np.random.default_rng(seed)
    times = [("a", t, 10.0) for t in np.cumsum(rng.exponential(1000 / 300, 3000)) if t < 9990]
    times += [("b", t, 100.0) for t in 3000 + np.cumsum(rng.exponential(1000 / b_rate, int(b_rate * 7))) if t < 9990]
    times.sort(key=lambda x: x[1])
    reqs = [Request(i, m, float(t), float(t) + slo) for i, (m, t, slo) in enumerate(times)]
    policy = make_policy("dstack", schedule=only_a)
    record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(reqs, until_ms=10000.0, drain_ms=200.0)
    mb, ma = compute_metrics(record, models=["b", "a"]).models
    return {"b_rate": b_rate, "b_on_time": mb.on_time, "b_arrived": mb.arrived, "a_on_time": ma.on_time,
            "a_arrived": ma.arrived, "layouts_at_ms": [round(t) for t, _ in record.layouts],
            "b_planned_rps": next((mp.planned_rps for mp in policy.schedule.models if mp.model == "b"), 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="300,600", help="b's requests/s from 3 s, comma-separated")
    ap.add_argument("--b-item-ms", type=float, default=200.0,
                    help="b's synthetic profile: SM-ms per item (default 200: a batch of one 6.35 ms on the whole GPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [run(float(r), a.b_item_ms) for r in a.rate.split(",")]
    for r in rows:
        print(f"b at {r['b_rate']:g}/s from 3 s: b on time {r['b_on_time']} of {r['b_arrived']}, a {r['a_on_time']} of "
              f"{r['a_arrived']}; layouts at {r['layouts_at_ms']} ms; b planned {r['b_planned_rps']:.0f}/s at the end")
    if a.out:
        Path(a.out).write_text(json.dumps({"gpuloom": str(Path(gpuloom.__file__).parent), "runs": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
