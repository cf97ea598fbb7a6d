"""Does planning with the measured slowdowns help dstack? Simulated on the H200's measured points (issue 5).

On the H200 every model ran slower than its profile on dstack's partitions (bert_base 1.14x at
every load; ``profile_check`` in the bench reports). For each dstack point of the given ``gpuloom
bench`` reports, the simulated GPU runs each model as slowly as that point measured and holds each
batch's partition as long as it measured (``sim_measured_hold.per_model``), while dstack plans
(a) from the profiles alone, as on the GPU (``unaware``), (b) learning the slowdowns while serving
(``learn_slowdown=true``: one re-plan once they are known), (c) told them from the start
(``slowdowns=...``). The GPU measured (a); the difference between (a) and (c) in simulation is what
planning with the slowdowns may win there.

    python scripts/sim_learned_slowdown.py docs/results/runtime/bench_mix6_h200_run30_c32_high.json \\
        docs/results/runtime/bench_mix6_h200_run31_c32_dstack_x1.json \\
        --out docs/results/runtime/sim_learned_slowdown_session12.json

``--write-slowdowns PATH`` also writes the reports' dstack slowdowns taken together, as
``{model: factor}`` for ``gpuloom simulate --slowdowns`` and ``dstack:slowdowns=``
(``results/runtime/slowdowns_h200_mix6_runs29_31.json`` from runs 29-31).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_measured_hold import load_report, measured_world  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.experiment import simulate  # noqa: E402
from gpuloom.bench.variants import sim_policy  # noqa: E402
from gpuloom.plan.slowdown import device_over_profile, dstack_rows  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", help="gpuloom bench JSONs measured on the GPU")
    ap.add_argument("--policy", default="dstack", help="the measured variant to replay")
    ap.add_argument("--demand-fraction", type=float, default=0.89)
    ap.add_argument("--duration", type=float, default=None, help="seconds per point (default: as measured)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-slowdowns", metavar="PATH", default=None,
                    help="also write {model: device time over profile} of every dstack point of the reports, together")
    a = ap.parse_args()
    if a.write_slowdowns:
        rows = [r for path in a.bench for r in dstack_rows(json.loads(Path(path).read_text()))]
        factors = {m: round(f, 4) for m, f in device_over_profile(rows).items()}
        Path(a.write_slowdowns).write_text(json.dumps(factors, indent=1))
        print("wrote", a.write_slowdowns, factors)
    store = ProfileStore.builtin("h200")
    rows = []
    for path in a.bench:
        d, wl, profs = load_report(path, store)
        name, options = sim_policy(a.policy, d["meta"])
        for p in d["policies"][a.policy]["points"]:
            cm, device, factors, holds = measured_world(p, profs, a.demand_fraction)
            w = dataclasses.replace(wl.scaled(p["scale"]), duration_s=a.duration or float(d["meta"]["duration_s"]))
            row = {"file": Path(path).name, "scale": p["scale"], "measured_attainment": round(p["slo_attainment"], 4),
                   "slowdowns": {m: round(f, 3) for m, f in sorted(factors.items())},
                   "measured_by_model": {m["model"]: round(m["slo_attainment"], 4) for m in p["models"]}}
            learning = {"learn_slowdown": True, "lanes": "partitions"}  # learning reads a batch's own partition
            for label, extra in (("unaware", {}), ("learning", learning), ("told", {"slowdowns": factors})):
                run = simulate(w, profs, name, contention=cm, options={**options, **extra}, device_profiles=device)
                row[label] = round(run.metrics.slo_attainment, 4)
                row[f"{label}_by_model"] = {m.model: round(m.slo_attainment, 4) for m in run.metrics.models}
                row[f"{label}_replans"] = run.policy["replans"]
            rows.append(row)
            print(f"{row['file'][:40]:40s} x{p['scale']:<6g} measured {row['measured_attainment']:.3f} | simulated: "
                  f"unaware {row['unaware']:.3f}, learning {row['learning']:.3f} ({row['learning_replans']} re-plan), "
                  f"told {row['told']:.3f} | bert_base {row['unaware_by_model'].get('bert_base', float('nan')):.3f} "
                  f"{row['learning_by_model'].get('bert_base', float('nan')):.3f} "
                  f"{row['told_by_model'].get('bert_base', float('nan')):.3f}", flush=True)
    if a.out:
        save_json(a.out, {"method": __doc__.split("\n\n")[1].replace("\n", " "), "bench": a.bench, "policy": a.policy,
                          "demand_fraction": a.demand_fraction, "duration_s": a.duration, "points": rows})
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
