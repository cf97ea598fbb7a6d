"""Does the measured per-batch hold explain dstack's loss on the H200? (issue 5, tenth session)

For each measured point of a ``gpuloom bench`` report, the simulator runs the same workload and load
with the hold the point measured (each batch's time on its partition beyond its device time,
averaged over the partitions: ``layouts[].gap_ms``) as ``ContentionModel.batch_overhead_ms``, and
with the device slowdown the point measured (device time over profile, ``profile_check``) applied to
every profiled latency. If the simulated attainment matches the measured one, the mean hold and
slowdown explain the loss; if the simulator stays higher, something the mean hides does (a tail, a
burst). A fourth variant gives each model its own mean hold and slowdown
(``ContentionModel.model_overhead_ms``: from each model's own ``hold_ms`` where the report has it,
else approximately, see :func:`per_model`), since one model's batches may hold far longer. Two more
(forty-third session) draw every batch's hold from a lognormal around those means
(``ContentionModel.hold_spread``), its sigma from the point's hold median and p99
(``layouts[].hold_p50_ms`` / ``hold_p99_ms``, see :func:`measured_spread`), with no slowdown: the
point's device slowdown on shared lanes is already the simulator's own sharing model. Where the
point ran on shared lanes (triton), two more (fifty-first session) tell the simulator the point's
slowdown in place of its sharing model (no shared-lane slowdown of its own, so nothing is counted
twice), with each model's own hold: one factor for every model (``told_uniform``), or each model its
own (``told_per_model``). Past triton's edge the card slows the small CNNs far more than bert
(``diag_sim_per_model.py``); the two say how much of the simulator's error that spread explains.
The last (fifty-sixth session, ``told_per_model_idle``) adds to every hold the lanes' idle time per
batch (``busy_ratio``, over the point's batches): where work always waits, as at overload, that is
the host's turnaround from a batch's return to the next launch, which the hold (submit to return)
leaves out; on nexus's overloaded point it was 0.36-1.15 ms a batch and explained most of the error.

    python scripts/sim_measured_hold.py docs/results/runtime/bench_mix6_h200_run25_high_load.json \\
        --policy dstack:min_sms=16 --out docs/results/runtime/sim_measured_hold_session10.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.e2e import planned_profiles, save_json  # noqa: E402
from gpuloom.bench.experiment import simulate  # noqa: E402
from gpuloom.bench.resimulate import simulate_report_point  # noqa: E402
from gpuloom.bench.workload import workload_from_dict  # noqa: E402
from gpuloom.bench.variants import sim_policy  # noqa: E402
from gpuloom.plan.slowdown import device_over_profile, mean_by, slowed  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402


def slowdown(rows: list[dict]) -> float | None:
    """Device time over profile of ``profile_check`` rows, weighted by their batches; None without a profile."""
    rows = [r for r in rows if r.get("profile_ms")]
    prof = sum(r["profile_ms"] * r["batches"] for r in rows)
    return sum(r["measured_ms"] * r["batches"] for r in rows) / prof if prof else None


def measured(point: dict) -> tuple[float, float, int]:
    """(mean hold beyond device time per batch ms, device time over profile, exclusive partitions)."""
    lanes = [q for q in point["layouts"] if q["batches"]]
    hold = mean_by(("all", q["gap_ms"] or 0.0, q["batches"]) for q in lanes).get("all", 0.0)
    slow = slowdown(point.get("profile_check") or [])
    return hold, (1.0 if slow is None else slow), sum(1 for q in point["layouts"] if not q["shared"])


#: a standard normal's 99th percentile: a lognormal's p99 / median is exp(Z99 * sigma)
Z99 = 2.3263


def measured_spread(point: dict) -> float | None:
    """The lognormal sigma of one point's holds, ``ln(p99 / p50) / Z99`` per lane, weighted by its
    batches; None when no lane has both figures (reports before the eleventh session's runs)."""
    return mean_by(("all", math.log(q["hold_p99_ms"] / q["hold_p50_ms"]) / Z99, q["batches"]) for q in point["layouts"]
                   if q["batches"] and (q.get("hold_p50_ms") or 0) > 0
                   and (q.get("hold_p99_ms") or 0) >= q["hold_p50_ms"]).get("all")


def per_model(point: dict) -> tuple[dict[str, float], dict[str, float], bool]:
    """({model: mean hold ms per batch}, {model: device time over profile}, exact) of one point.

    Exact from each (model, SMs, batch)'s own ``hold_ms`` (reports since the eleventh session's
    runs). Before that, approximate: a partition's mean hold goes to the model that ran as many
    batches on that many SMs, else the most; dstack also runs other models on a partition, so this
    mixes their holds."""
    rows = point.get("profile_check") or []
    slow = device_over_profile(rows)
    if rows and all("hold_ms" in r for r in rows):
        return mean_by((r["model"], r["hold_ms"], r["batches"]) for r in rows), slow, True
    ran: dict[tuple[int, str], int] = {}
    for r in rows:
        ran[(r["sms"], r["model"])] = ran.get((r["sms"], r["model"]), 0) + r["batches"]
    held = []
    for q in point["layouts"]:
        if q["shared"] or not q["batches"] or q["gap_ms"] is None:
            continue
        cands = {m: n for (sms, m), n in ran.items() if sms == q["sms"]}
        if not cands:
            continue
        exact = [m for m, n in cands.items() if n == q["batches"]]
        owner = exact[0] if len(exact) == 1 else max(cands, key=cands.get)
        held.append((owner, q["gap_ms"], q["batches"]))
    return mean_by(held), slow, False


def load_report(path: str | Path, store: ProfileStore, policy: str | None = None) -> tuple[dict, object, dict]:
    """A bench report, its workload, and the profiles its points (``policy``'s) were planned with: those
    it recorded (since the fiftieth session), else the H200 ``store``'s cut to the report's max batch."""
    d = json.loads(Path(path).read_text())
    return d, workload_from_dict(d["workload"]), planned_profiles(d, store, policy)


#: the point as ``gpuloom bench`` simulates it (``gpuloom.bench.resimulate``; the scripts' old name)
simulate_at = simulate_report_point


def idle_per_batch(point: dict) -> float:
    """The lanes' idle time per batch (ms), weighted by their batches: at overload, the turnaround."""
    lanes = [q for q in point["layouts"] if q["batches"] and q.get("busy_ratio") is not None]
    return mean_by(("all", (1.0 - q["busy_ratio"]) * point["duration_s"] * 1000.0 / q["batches"], q["batches"])
                   for q in lanes).get("all", 0.0)


#: a demand fraction this small makes shared lanes demand no SMs: ``shared_factor`` stays 1, so the
#: told worlds slow batches only by the point's measured slowdowns
NO_SHARING = 1e-9


def measured_world(point: dict, profiles: dict, demand_fraction: float):
    """The simulated GPU of one measured point: ``(ContentionModel, device profiles, slowdowns, holds)``,
    running each model as slowly, and holding each batch's partition as long, as that point measured
    (a model without its own figure gets the point's mean)."""
    hold, slow, _ = measured(point)
    holds, slows, _ = per_model(point)
    factors = {m: slows.get(m, slow) for m in profiles}
    cm = ContentionModel(demand_fraction=demand_fraction, batch_overhead_ms=hold,
                         model_overhead_ms=tuple(sorted(holds.items())))
    return cm, {m: slowed(pr, factors[m]) for m, pr in profiles.items()}, factors, holds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="a gpuloom bench JSON measured on the GPU")
    ap.add_argument("--policy", default="dstack", help="the measured variant to replay (exclusive partitions)")
    ap.add_argument("--demand-fraction", type=float, default=0.89)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    d, wl, profs = load_report(a.bench, ProfileStore.builtin("h200"), a.policy)
    name, options = sim_policy(a.policy, d["meta"])
    rows = []
    for p in d["policies"][a.policy]["points"]:
        hold, slow, _ = measured(p)
        w = dataclasses.replace(wl.scaled(p["scale"]), duration_s=float(d["meta"]["duration_s"]))
        slower = {m: slowed(pr, slow) for m, pr in profs.items()}
        row = {"scale": p["scale"], "measured_attainment": round(p["slo_attainment"], 4),
               "hold_ms": round(hold, 3), "device_over_profile": round(slow, 3)}
        plain, held = (ContentionModel(demand_fraction=a.demand_fraction),
                       ContentionModel(demand_fraction=a.demand_fraction, batch_overhead_ms=hold))
        holds, slows, exact = per_model(p)
        mine = ContentionModel(demand_fraction=a.demand_fraction, batch_overhead_ms=hold,
                               model_overhead_ms=tuple(sorted(holds.items())))
        slower_each = {m: slowed(pr, slows.get(m, slow)) for m, pr in profs.items()}
        row["hold_ms_by_model"] = {m: round(v, 3) for m, v in sorted(holds.items())}
        row["hold_by_model_exact"] = exact
        row["device_over_profile_by_model"] = {m: round(v, 3) for m, v in sorted(slows.items())}
        row["measured_attainment_by_model"] = {m["model"]: round(m["slo_attainment"], 4) for m in p["models"]}
        spread = measured_spread(p)
        row["hold_spread"] = None if spread is None else round(spread, 3)
        row["measured_goodput"] = round(p["goodput_rps"], 1)
        worlds = [("plain", plain, profs), ("hold", held, profs), ("hold_and_slowdown", held, slower),
                  ("per_model", mine, slower_each)]
        if spread is not None:
            worlds += [("hold_spread", dataclasses.replace(held, hold_spread=spread), profs),
                       ("per_model_spread", dataclasses.replace(mine, hold_spread=spread), profs)]
        if any(q["shared"] and q["batches"] for q in p["layouts"]):
            told = dataclasses.replace(mine, demand_fraction=NO_SHARING)
            idle = idle_per_batch(p)
            row["idle_ms_per_batch"] = round(idle, 3)
            told_idle = dataclasses.replace(told, batch_overhead_ms=hold + idle,
                                            model_overhead_ms=tuple((m, h + idle) for m, h in told.model_overhead_ms))
            worlds += [("told_uniform", told, slower), ("told_per_model", told, slower_each),
                       ("told_per_model_idle", told_idle, slower_each)]
        for label, cm, pr in worlds:
            met = simulate(w, pr, name, contention=cm, options=options).metrics
            row[f"simulated_{label}"] = round(met.slo_attainment, 4)
            row[f"simulated_{label}_goodput"] = round(met.goodput_rps, 1)
            if label == "per_model":
                row["simulated_per_model_by_model"] = {m.model: round(m.slo_attainment, 4) for m in met.models}
        rows.append(row)
        print(f"{a.policy} x{p['scale']:g}: measured {row['measured_attainment']:.3f} | hold {hold:.2f} ms/batch, device "
              f"{slow:.2f}x profile | simulated: plain {row['simulated_plain']:.3f}, with the hold "
              f"{row['simulated_hold']:.3f}, with the hold and the slowdown {row['simulated_hold_and_slowdown']:.3f}, "
              f"each model its own {row['simulated_per_model']:.3f}"
              + (f" | holds spread (sigma {spread:.2f}, no slowdown): mean {row['simulated_hold_spread']:.3f}, "
                 f"each model its own {row['simulated_per_model_spread']:.3f}" if spread is not None else "")
              + (f" | told the slowdowns instead of sharing: goodput measured {row['measured_goodput']:.0f}/s, "
                 f"one factor {row['simulated_told_uniform_goodput']:.0f}/s, each model its own "
                 f"{row['simulated_told_per_model_goodput']:.0f}/s, and with the lanes' idle "
                 f"{row['idle_ms_per_batch']:.2f} ms/batch {row['simulated_told_per_model_idle_goodput']:.0f}/s"
                 if "simulated_told_uniform" in row else ""))
    if a.out:
        save_json(a.out, {"method": __doc__.split("\n\n")[1].replace("\n", " "), "bench": a.bench,
                          "policy": a.policy, "points": rows})
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
