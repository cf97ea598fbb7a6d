#!/usr/bin/env python
"""The bench's ``sim_host`` at drop-dominated points, re-run over saved reports (issue 5, CPU, sixty-fifth session).

``gpuloom bench`` simulates a point where most requests that entered were dropped with the host's time
per drop read off the point's own runtime loop CPU (``resimulate.point_drop_ms``). This runs the bench's
re-simulation (``resimulate.host_resimulation``) over reports measured before that, and prints each such
point's measured goodput, the preset's error as the run printed it (``sim``) and the new ``sim_host``'s.

    python scripts/sim_host_drop_dominated.py docs/results/runtime/bench_overload_h100_run19[68]_yield[01].json \\
        docs/results/runtime/bench_overload_h100_run20[234]*.json --out docs/results/runtime/sim_host_drop_dominated_session65.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.resimulate import host_line, host_resimulation  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSONs measured on the GPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    store = ProfileStore.builtin("h200")
    rows = []
    for path in a.reports:
        d = json.loads(Path(path).read_text())
        res = host_resimulation(d, store)
        if res is None:
            print(f"{Path(path).name}: no held load and no drop-dominated point")
            continue
        for pol, sims in res["points"].items():
            for pt, sim in zip(d["policies"][pol]["points"], sims):
                if "host_drop_ms" not in sim:
                    continue
                row = {"report": Path(path).name, "policy": pol, "scale": pt["scale"],
                       "measured_goodput": round(pt["goodput_rps"], 1),
                       "sim_error": (pt.get("sim") or {}).get("goodput_error"),
                       "sim_host_error": round(sim["goodput_error"], 4), "host_drop_ms": sim["host_drop_ms"],
                       "yield_answers_recorded": res["calibration"]["yield_answers"]}
                rows.append(row)
                print(f"{row['report']} {pol} x{pt['scale']:g}: measured {row['measured_goodput']:.0f}/s, sim "
                      f"{row['sim_error']:+.1%}, sim_host {row['sim_host_error']:+.1%} (told {row['host_drop_ms']} ms "
                      f"a drop)", flush=True)
        print("  " + host_line(res, (d["meta"].get("sim_contention") or {}).get("preset", "h200")))
    if a.out:
        save_json(a.out, {"rows": rows, "within_10pct": sum(abs(r["sim_host_error"]) <= 0.10 for r in rows),
                          "within_20pct": sum(abs(r["sim_host_error"]) <= 0.20 for r in rows), "points": len(rows)})
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
