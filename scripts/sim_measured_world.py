"""dstack variants in a simulated GPU that runs as a measured point did (issue 5).

For each dstack point of the given ``gpuloom bench`` reports, the simulated GPU runs each model as
slowly as that point measured (device time over profile) and holds each batch's partition as long as
it measured, per model (``sim_measured_hold.per_model``): bert_base's batches, with 3-6 MB of
outputs, held theirs 2.6-4.4 ms beyond their device time on the H200, the others 0.6-1.6 ms. Each
variant (``--variant`` JSON: dstack options; ``"told": true`` adds the point's own slowdowns as
``slowdowns=``, ``"told_holds": true`` the report's measured holds as ``holds=``) plans from the
profiles as on the GPU, and runs in that world. The simulation is
circular (it takes the point's own holds and slowdowns), so it says what a variant may win on the
GPU, not what it wins.

    python scripts/sim_measured_world.py docs/results/runtime/bench_overload_h200_run54_warmup.json \\
        --variant '{}' --variant '{"adapt": true}' --variant '{"batch_overhead_ms": 1.0}' \\
        --out docs/results/runtime/sim_measured_world_session17.json

``--predict OTHER.json`` makes it a prediction instead (not circular): the world is measured in the
given reports, and each variant whose JSON names ``"measured_as": "<policy>"`` is compared with that
policy's goodput at the same load in OTHER, a later run on another machine (issue 5's simulator
validation: goodput error <= 10%).
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

from sim_measured_hold import load_report, measured_world  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.experiment import simulate  # noqa: E402
from gpuloom.bench.variants import sim_policy  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", help="gpuloom bench JSONs measured on the GPU")
    ap.add_argument("--variant", action="append", default=None,
                    help='dstack options as JSON, e.g. \'{"adapt": true}\' (repeatable; default: plain dstack)')
    ap.add_argument("--demand-fraction", type=float, default=0.89)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of arrivals per point")
    ap.add_argument("--predict", default=None, metavar="OTHER",
                    help="a later bench report: compare each variant with its \"measured_as\" policy there")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    later = json.loads(Path(a.predict).read_text()) if a.predict else {}
    other = later.get("policies", {})
    variants = [json.loads(v) for v in (a.variant or ["{}"])]
    store = ProfileStore.builtin("h200")
    rows = []
    for path in a.bench:
        d, wl, profs = load_report(path, store)
        if later and later.get("workload") != d.get("workload"):
            print(f"{path}: another workload than {a.predict}'s; skipped", flush=True)
            continue
        if "dstack" not in d["policies"]:
            print(f"{path}: no plain dstack points; skipped", flush=True)
            continue
        for p in d["policies"]["dstack"]["points"]:
            cm, device, factors, holds = measured_world(p, profs, a.demand_fraction)
            w = dataclasses.replace(wl.scaled(p["scale"]), duration_s=a.duration)
            row = {"file": Path(path).name, "scale": p["scale"], "measured_attainment": round(p["slo_attainment"], 4),
                   "measured_goodput_rps": round(p["goodput_rps"], 1),
                   "holds_ms": {m: round(h, 3) for m, h in sorted(holds.items())},
                   "slowdowns": {m: round(f, 3) for m, f in sorted(factors.items())}, "variants": []}
            print(f"{row['file'][:44]:44s} x{p['scale']:<6g} measured {p['slo_attainment']:.3f} "
                  f"({p['goodput_rps']:.0f}/s)", flush=True)
            for v in variants:
                opts = dict(v)
                measured_as = opts.pop("measured_as", None)
                if opts.pop("told", False):
                    opts["slowdowns"] = factors
                if opts.pop("told_holds", False):
                    opts["holds"] = path  # the report's own (every dstack point), as dstack:holds=PATH reads it
                # the variant's own options, with the report's defaults for the rest (an old report's
                # dstack did not shed, and adapt needs shedding: sim_policy sees to it)
                spec = ":".join(["dstack"] + [f"{k}={json.dumps(x) if not isinstance(x, str) else x}"
                                              for k, x in opts.items() if not isinstance(x, dict)])
                name, options = sim_policy(spec, d["meta"])
                options.update({k: x for k, x in opts.items() if isinstance(x, dict)})
                try:
                    run = simulate(w, profs, name, contention=cm, options=options, device_profiles=device)
                except ValueError as e:  # e.g. told_holds on a report without hold_ms rows
                    print(f"    {json.dumps(v):40s} skipped: {e}", flush=True)
                    continue
                m = run.metrics
                got = {"options": v, "slo_attainment": round(m.slo_attainment, 4),
                       "goodput_rps": round(m.goodput_rps, 1),
                       "admit_rps": run.policy.get("admit_rps"), "batch": run.policy.get("batch"),
                       "replans": run.policy.get("replans")}
                there = next((q for q in other.get(measured_as, {}).get("points", ())
                              if math.isclose(q["scale"], p["scale"])), None) if measured_as else None
                said = ""
                if measured_as and there is None:
                    said = f" | no {measured_as!r} point at x{p['scale']:g} in {a.predict}"
                if there is not None and there["goodput_rps"]:
                    got["predicted_run_goodput_rps"] = round(there["goodput_rps"], 1)
                    got["goodput_error"] = round((m.goodput_rps - there["goodput_rps"]) / there["goodput_rps"], 4)
                    said = f" | {Path(a.predict).name} measured {there['goodput_rps']:.0f}/s: error {got['goodput_error']:+.1%}"
                row["variants"].append(got)
                print(f"    {json.dumps(v):40s} attainment {m.slo_attainment:.3f} goodput {m.goodput_rps:7.0f}/s "
                      f"re-plans {run.policy.get('replans')}{said}", flush=True)
            rows.append(row)
    if a.out:
        method = __doc__.split("\n\n")[3 if a.predict else 1].replace("\n", " ")
        save_json(a.out, {"method": method, "bench": a.bench,
                          "predict": a.predict,
                          "demand_fraction": a.demand_fraction, "duration_s": a.duration, "points": rows})
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
