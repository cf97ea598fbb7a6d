#!/usr/bin/env python
"""Who the simulator lets suffer, model by model, at a bench report's points: per model the measured
and simulated SLO attainment, p50 and mean batch, and how many times its profiled time (alone on the
whole GPU) the card's batches took.

Also each model's *effective SMs* (the SM count at which its profile gives its batches' measured
time) and their sum weighted by each model's device time per second: how many SMs the lanes kept
busy as the profiles count them.

Why: past triton's edge the simulated goodput stays high while the card's falls (run 167: +67% at
x1.125). The simulator slows every shared batch by one factor at any instant; if the card slows some
models far more than others, the two lose different models' requests, and with different SLOs that
is a different goodput. Pure Python (the simulator on the profiles the report was planned with, as
``gpuloom bench`` simulates each point, the ``h200`` preset); any machine.

    python scripts/diag_sim_per_model.py docs/results/runtime/bench_mix6_h100_run167_edge.json \\
        --policy triton --out /tmp/per_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.plan.slowdown import device_over_profile, mean_by  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402
from sim_measured_hold import load_report, simulate_at  # noqa: E402


def measured_slowdowns(point: dict) -> dict[str, dict]:
    """model -> its batches' measured device time over their profiled time, and their mean batch,
    both weighted by batches (``profile_check``: one row per model, SMs and batch size)."""
    rows = [r for r in point.get("profile_check", ()) if r["batches"]]
    batch = mean_by((r["model"], r["batch"], r["batches"]) for r in rows)
    return {m: {"slowdown": s, "mean_batch": batch[m]} for m, s in device_over_profile(rows).items()}


def effective_sms(profile, batch: int, ms: float) -> float:
    """The SM count at which ``profile`` gives a batch of ``batch`` rows ``ms`` (linear between its
    measured counts; past its fewest, inversely with the count): how many SMs the batch ran as if it
    had to itself."""
    pts = [(s, profile.latency(batch, s)) for s in profile.sms]
    if ms <= pts[-1][1]:
        return float(pts[-1][0])
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l0 >= ms >= l1:
            return s0 + (s1 - s0) * (l0 - ms) / (l0 - l1) if l0 > l1 else float(s0)
    return pts[0][0] * pts[0][1] / ms


def effective_shares(point: dict, profiles: dict) -> dict[str, dict]:
    """model -> its batches' mean effective SMs (weighted by batches) and its device time per second
    of the point: their products summed is how many SMs the lanes kept busy, as the profiles count."""
    rows = [r for r in point.get("profile_check", ()) if r["model"] in profiles and r["batches"]]
    eff = mean_by((r["model"], effective_sms(profiles[r["model"]], r["batch"], r["measured_ms"]), r["batches"])
                  for r in rows)
    busy: dict[str, float] = {}
    for r in rows:  # device ms per ms of the point
        busy[r["model"]] = busy.get(r["model"], 0.0) + r["batches"] * r["measured_ms"] / (1000.0 * point["duration_s"])
    return {m: {"effective_sms": e, "busy": busy[m]} for m, e in eff.items()}


def per_model(report: dict, wl0, profs: dict, policy: str, cm: ContentionModel) -> list[dict]:
    """Per point of ``policy``: the measured and simulated figures of each model side by side."""
    slo = {ms.name: ms.slo_ms for ms in wl0.models}
    out = []
    for point in report["policies"][policy]["points"]:
        m = simulate_at(report, wl0, profs, policy, point["scale"], cm, point.get("plan"))
        measured = {x["model"]: x for x in point["models"]}
        slow = measured_slowdowns(point)
        shares = effective_shares(point, profs)
        rows = []
        for sm in m.models:
            x = measured.get(sm.model)
            if x is None:
                continue
            s = slow.get(sm.model, {})
            rows.append({"model": sm.model, "slo_ms": slo[sm.model],
                         "attainment": {"measured": round(x["slo_attainment"], 4), "simulated": round(sm.slo_attainment, 4)},
                         "p50_ms": {"measured": round(x["p50_ms"], 2), "simulated": round(sm.p50_ms, 2)},
                         "mean_batch": {"measured": round(s["mean_batch"], 2) if s else None,
                                        "simulated": round(sm.mean_batch, 2)},
                         "measured_slowdown": round(s["slowdown"], 3) if s else None,
                         "effective_sms": round(shares[sm.model]["effective_sms"], 1) if sm.model in shares else None,
                         "busy": round(shares[sm.model]["busy"], 3) if sm.model in shares else None})
        slows = [r["measured_slowdown"] for r in rows if r["measured_slowdown"]]
        out.append({"scale": point["scale"], "goodput": {"measured": round(point["goodput_rps"], 1),
                                                         "simulated": round(m.goodput_rps, 1)},
                    "slowdown_spread": round(max(slows) / min(slows), 3) if slows else None,
                    "busy_sms": round(sum(v["effective_sms"] * v["busy"] for v in shares.values()), 1),
                    "models": rows})
    return out


def print_table(path: str, policy: str, points: list[dict]) -> None:
    print(f"{Path(path).name}  {policy}")
    for p in points:
        g = p["goodput"]
        print(f"  x{p['scale']:<7g} goodput measured {g['measured']:7.0f}/s simulated {g['simulated']:7.0f}/s"
              f"   measured slowdown spread {p['slowdown_spread']}, busy SMs {p['busy_sms']}")
        for r in p["models"]:
            a, l, b = r["attainment"], r["p50_ms"], r["mean_batch"]
            mb = f"{b['measured']:5.1f}" if b["measured"] is not None else "    -"
            print(f"    {r['model']:16s} SLO {r['slo_ms']:4g} ms  attainment {a['measured']:.2f} / {a['simulated']:.2f}"
                  f"  p50 {l['measured']:5.1f} / {l['simulated']:5.1f} ms  batch {mb} / {b['simulated']:5.1f}"
                  f"  measured slowdown {r['measured_slowdown']}, as if on {r['effective_sms']} SMs, busy {r['busy']}")
    print("  (measured / simulated; slowdown: the card's device time per batch over the profile alone; as if on:\n"
          "   the SMs at which the profile gives that time; busy SMs: those times each model's device time per second)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", nargs="+", help="gpuloom bench JSON files")
    ap.add_argument("--policy", default="triton")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    store = ProfileStore.builtin("h200")
    cm = ContentionModel.h200_runs()
    result = {"policy": a.policy, "contention": dataclasses.asdict(cm), "reports": {}}
    for path in a.bench:
        report, wl, profs = load_report(path, store, a.policy)
        if a.policy not in report["policies"]:
            print(f"{path}: no policy {a.policy!r} (has {sorted(report['policies'])})", file=sys.stderr)
            return 2
        points = per_model(report, wl, profs, a.policy, cm)
        print_table(path, a.policy, points)
        result["reports"][Path(path).name] = points
    if a.out:
        save_json(a.out, result)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
