#!/usr/bin/env python
"""How long ``gpuloom.plan.servable`` takes on the shipped workloads (pure Python, any machine).

Why: dstack runs it once per layout, and the sixty-fifth session added a check of the whole set (one
``fits`` more where every SLO fits). Run with another tree first on ``PYTHONPATH`` to time that one.

    python scripts/time_servable.py --out docs/results/simulate/servable_time_session65.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # (a PYTHONPATH given first wins: another tree's planner)
    sys.path.append(str(ROOT))

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.workload import load_workload  # noqa: E402
from gpuloom.plan import Demand, servable  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402

WORKLOADS = ("mix6", "light3", "overload", "shift", "bursty", "mix6_deadlines")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    store = ProfileStore.builtin("h200")
    out = {}
    for name in WORKLOADS:
        wl = load_workload(ROOT / "examples" / f"{name}.yaml")
        demands = [Demand(m.name, m.arrival.rate_at(0.0) or 1.0, m.slo_ms) for m in wl.models]
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            servable(demands, store)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3)}
        print(f"{name}: servable median {out[name]['median_ms']:.2f} ms (min {out[name]['min_ms']:.2f})")
    if a.out:
        import gpuloom

        save_json(a.out, {"planner": str(Path(gpuloom.__file__).parent), "repeat": a.repeat, "workloads": out})
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
