#!/usr/bin/env python
"""Does simulating the service's queue limit bring the simulator closer to the card? (issue 5, CPU,
sixty-third session)

Why: ``gpuloom bench`` serves with a bound of 1024 requests per model queued or running; past it the
service refuses a request (``Overloaded``, the report's ``rejected``). At the overloaded mix the card's
runs refused 47-72% of what was offered. The simulator refused none until the sixty-third session, so
its queues grew without bound: at run 197's gslice point (in collapse) its median latency read 1.2 s
against the card's 0.39 s. Each point of the given reports is simulated twice with the preset it was
simulated with (its ``meta.sim_contention``, as the runtime's settings ran it): without a limit and
with the report's own (``resimulate.report_queue_limit``); the errors of goodput, p50 and p99 against
the measured are printed and written side by side.

    python scripts/sim_queue_limit.py docs/results/runtime/bench_overload_h100_run1[789]*.json \\
        --out docs/results/runtime/sim_queue_limit_session63.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sim_measured_hold import load_report  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.resimulate import (MIN_ATTAINMENT, WITHIN, as_the_runtime_ran, report_queue_limit,  # noqa: E402
                                      simulate_report_point)
from gpuloom.commands.simulate import preset_model  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.core import OVERLOADED  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402


def report_contention(meta: dict) -> ContentionModel:
    """The simulated GPU the report's points were simulated with, as the runtime's settings ran it."""
    preset = (meta.get("sim_contention") or {}).get("preset") or "h200"
    return as_the_runtime_ran(preset_model(preset), meta.get("gpuloom_settings") or {})


def rel(sim: float | None, measured: float | None) -> float | None:
    if sim is None or not measured:
        return None
    return round(sim / measured - 1.0, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSONs measured on the GPU")
    ap.add_argument("--policy", default="", help="comma-separated policies (default: every one in a report)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    store = ProfileStore.builtin("h200")  # for reports that did not record their profiles
    wanted = [p for p in args.policy.split(",") if p]
    rows = []
    for path in args.reports:
        d, wl, _ = load_report(path, store)
        meta = d["meta"]
        contention, limit = report_contention(meta), report_queue_limit(meta)
        for policy, res in d["policies"].items():
            if wanted and policy not in wanted:
                continue
            _, _, profiles = load_report(path, store, policy)
            for p in res.get("points", []):
                row = {"report": Path(path).name, "policy": policy, "scale": p["scale"],
                       "attainment": round(p["slo_attainment"], 4), "goodput": p["goodput_rps"],
                       "p50_ms": p["p50_ms"], "p99_ms": p["p99_ms"],
                       "rejected": sum(m.get("rejected", 0) for m in p["models"]),
                       "submitted": sum(m["submitted"] for m in p["models"]), "queue_limit": limit}
                for key, bounded in (("unbounded", False), ("limited", True)):
                    m = simulate_report_point(d, wl, profiles, policy, p["scale"], contention, p.get("plan"),
                                              bounded=bounded)
                    row[key] = {"goodput": round(m.goodput_rps, 1), "goodput_error": rel(m.goodput_rps, p["goodput_rps"]),
                                "p50_error": rel(m.p50_ms, p["p50_ms"]), "p99_error": rel(m.p99_ms, p["p99_ms"]),
                                "refused": m.drops.get(OVERLOADED, 0)}
                rows.append(row)
                u, lim = row["unbounded"], row["limited"]
                print(f"{row['report'][:44]:44s} {policy[:22]:22s} x{p['scale']:<7g} att {row['attainment']:.3f} "
                      f"rejected {row['rejected'] / max(1, row['submitted']):.2f} (sim {lim['refused']}): "
                      f"goodput {u['goodput_error']:+.3f} -> {lim['goodput_error']:+.3f}  "
                      f"p50 {u['p50_error']:+.3f} -> {lim['p50_error']:+.3f}  p99 {u['p99_error']:+.3f} -> {lim['p99_error']:+.3f}")
    scored = [r for r in rows if r["attainment"] >= MIN_ATTAINMENT and r["unbounded"]["goodput_error"] is not None]
    for key in ("unbounded", "limited"):
        ok = sum(abs(r[key]["goodput_error"]) <= WITHIN for r in scored)
        print(f"{key}: {ok} of {len(scored)} scored points (attainment >= {MIN_ATTAINMENT}) within {WITHIN:.0%} in goodput")
    if args.out:
        save_json(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
