#!/usr/bin/env python
"""Policies simulated on the profiles a bench report was planned with: each one's attainment and
goodput at the given loads, and its highest load at >= 99%.

Why: the `ideal` oracle of issue 5's ">= 90% of the simulated ideal" was simulated with the shipped
H200 profiles; a run on another card (an H100) or with gpuloom's kernels (mobilenet_v2 and
efficientnet_b0 profiled at load) plans with others, which its report records. This puts `ideal`
(or any policy) on those, with the bench's preset (``--contention h200``). Pure Python; any machine.

    python scripts/sim_report_policies.py docs/results/runtime/bench_mix6_h100_run167_edge.json \\
        --policies ideal,dstack:batch_overhead_ms=1.125 --scales 1.0625,1.125,1.1875,1.25
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_measured_hold import load_report, simulate_at  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402


def highest_held(points: list[dict], target: float) -> float:
    """The highest load measured at ``target`` (0 if none), as ``gpuloom bench`` reads its points."""
    return max((p["scale"] for p in points if p["slo_attainment"] >= target), default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="a gpuloom bench JSON (its workload, duration and recorded profiles)")
    ap.add_argument("--policies", default="ideal,dstack")
    ap.add_argument("--scales", required=True, help="comma-separated load factors")
    ap.add_argument("--profiles-of", default=None,
                    help="the report's policy whose recorded profiles to use (default: the report's shared ones)")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    report, wl0, profs = load_report(a.bench, ProfileStore.builtin("h200"), a.profiles_of)
    cm = ContentionModel.h200_runs()
    out = {"bench": Path(a.bench).name, "contention": dataclasses.asdict(cm), "target": a.target, "policies": {}}
    for policy in a.policies.split(","):
        points = []
        for scale in (float(s) for s in a.scales.split(",")):
            m = simulate_at(report, wl0, profs, policy, scale, cm)
            points.append({"scale": scale, "slo_attainment": round(m.slo_attainment, 4),
                           "goodput_rps": round(m.goodput_rps, 1)})
            print(f"{policy:32s} x{scale:<8g} attainment {m.slo_attainment:.4f} goodput {m.goodput_rps:7.0f}/s", flush=True)
        held = highest_held(points, a.target)
        out["policies"][policy] = {"points": points, "max_scale": held}
        print(f"{policy:32s} highest load at {a.target:.0%}: x{held:g}")
    if a.out:
        save_json(a.out, out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
