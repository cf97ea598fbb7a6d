#!/usr/bin/env python
"""Does slowing shared lanes unevenly (``ContentionModel.share_weights``) simulate triton past its
edge better, on reports the weights did not come from?

The weights come from one report's points of ``--policy`` at or past its edge (attainment below
``--below``): each model's share is 1 over its measured slowdown there (device time over profile,
``diag_sim_per_model.measured_slowdowns``), averaged over those points after scaling each point's to a
geometric mean of 1 (only ratios matter); or, with ``--weights-from-pairs``, from a
``scripts/diag_pair_slowdown.py`` measurement (each model's slowdown with all the others replayed beside it,
no scheduler in the way). Every report given is then simulated at each of its points
of that policy with the bench's preset (``--contention h200``) and with the preset plus the weights;
the goodput errors side by side, and how many points are within 10% each way. Pure Python; any machine.

    python scripts/sim_share_weights.py --weights-from docs/results/runtime/bench_mix6_h100_run167_edge.json \\
        docs/results/runtime/bench_mix6_h100_run164_mb16_profiles.json --out /tmp/weights.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diag_sim_per_model import measured_slowdowns  # noqa: E402
from sim_measured_hold import load_report, simulate_at  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402

TARGET = 0.10  # issue 5's goodput error bound


def unit_shares(slowdowns: dict[str, float]) -> dict[str, float]:
    """model -> 1 over its slowdown, scaled to a geometric mean of 1 (only the ratios matter)."""
    g = math.exp(sum(math.log(1.0 / s) for s in slowdowns.values()) / len(slowdowns))
    return {m: 1.0 / s / g for m, s in slowdowns.items()}


def weights_from(points: list[dict], below: float) -> dict[str, float]:
    """model -> share weight: 1 / its measured slowdown at each point whose attainment is under
    ``below``, each point's scaled to a geometric mean of 1, averaged over those points."""
    acc: dict[str, list[float]] = {}
    for p in points:
        if p["slo_attainment"] >= below:
            continue
        slow = {m: v["slowdown"] for m, v in measured_slowdowns(p).items()}
        if not slow:
            continue
        for m, w in unit_shares(slow).items():
            acc.setdefault(m, []).append(w)
    return {m: sum(v) / len(v) for m, v in sorted(acc.items())}


def weights_from_pairs(pairs: dict, batch: int) -> dict[str, float]:
    """model -> share weight from ``scripts/diag_pair_slowdown.py``'s largest set at ``batch`` (every
    model's graph replayed back to back beside all the others): 1 over its slowdown there, scaled to a
    geometric mean of 1. With none of the weighted lanes capped at its demand, a lane's slowdown under
    the water-filling is proportional to 1 over its weight, so these weights give back the measured spread."""
    sets = [s for s in pairs["sets"] if s["batch"] == batch]
    if not sets:
        raise SystemExit(f"no set at batch {batch} in the pairs file (batches: {sorted({s['batch'] for s in pairs['sets']})})")
    return dict(sorted(unit_shares(max(sets, key=lambda s: len(s["models"]))["slowdown"]).items()))


def errors(report: dict, wl0, profs: dict, policy: str, models: dict[str, ContentionModel]) -> list[dict]:
    """Per point of ``policy``: measured goodput and each contention model's simulated goodput error."""
    out = []
    for p in report["policies"][policy]["points"]:
        row = {"scale": p["scale"], "attainment": round(p["slo_attainment"], 4), "measured": round(p["goodput_rps"], 1)}
        for label, cm in models.items():
            g = simulate_at(report, wl0, profs, policy, p["scale"], cm, p.get("plan")).goodput_rps
            row[label] = round(g / p["goodput_rps"] - 1.0, 4) if p["goodput_rps"] > 0 else None
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", nargs="+", help="gpuloom bench JSON files to simulate")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights-from", help="the bench JSON whose points give the weights")
    src.add_argument("--weights-from-pairs", help="a diag_pair_slowdown.py JSON whose all-models set gives them")
    ap.add_argument("--pair-batch", type=int, default=8, help="with --weights-from-pairs: the set's batch")
    ap.add_argument("--policy", default="triton")
    ap.add_argument("--below", type=float, default=0.99, help="points under this attainment give the weights")
    ap.add_argument("--demand", choices=("knee", "area"), default="knee",
                    help="the preset's demand (area: with demand_fraction 1 and --efficiency)")
    ap.add_argument("--efficiency", type=float, default=None, help="the preset's efficiency (default: the preset's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    store = ProfileStore.builtin("h200")
    if a.weights_from_pairs:
        weights = weights_from_pairs(json.loads(Path(a.weights_from_pairs).read_text()), a.pair_batch)
    else:
        source, _, _ = load_report(a.weights_from, store, a.policy)
        weights = weights_from(source["policies"][a.policy]["points"], a.below)
        if not weights:
            print(f"{a.weights_from}: no {a.policy} point under attainment {a.below}", file=sys.stderr)
            return 2
    print("weights: " + ", ".join(f"{m} {w:.2f}" for m, w in weights.items()))
    preset = ContentionModel.h200_runs()
    if a.demand == "area":
        preset = dataclasses.replace(preset, demand="area", demand_fraction=1.0)
    if a.efficiency is not None:
        preset = dataclasses.replace(preset, efficiency=a.efficiency)
    models = {"preset": preset, "weighted": dataclasses.replace(preset, share_weights=tuple(weights.items()))}
    origin = a.weights_from_pairs or a.weights_from
    result = {"weights_from": Path(origin).name, **({"pair_batch": a.pair_batch} if a.weights_from_pairs else {}),
              "policy": a.policy, "below": a.below, "weights": weights,
              "preset": dataclasses.asdict(preset), "reports": {}}
    within = {k: 0 for k in models}
    n = 0
    for path in a.bench:
        report, wl, profs = load_report(path, store, a.policy)
        rows = errors(report, wl, profs, a.policy, models)
        result["reports"][Path(path).name] = rows
        print(Path(path).name)
        for r in rows:
            print(f"  x{r['scale']:<8g} attainment {r['attainment']:.3f} measured {r['measured']:7.0f}/s   "
                  + "   ".join(f"{k} {r[k]:+.3f}" for k in models if r[k] is not None))
            n += 1
            for k in models:
                within[k] += r[k] is not None and abs(r[k]) <= TARGET
    result["within_10pct"] = {k: within[k] for k in models}
    result["points"] = n
    print("within 10%: " + ", ".join(f"{k} {within[k]} of {n}" for k in models))
    if a.out:
        save_json(a.out, result)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
