#!/usr/bin/env python
"""Can a host's per-drop time be read off its runtime loop's own CPU? (issue 5, CPU, sixtieth session)

Why: the simulator charges the one host ``host_drop_ms`` per request a decision drops
(``ContentionModel``), and at the overloaded mix that term decides nexus's goodput (it drops about ten
requests for each it serves). It was fitted per kind of host: 0.04 ms on the fast H100 hosts (runs 173,
183, 186, 187), 0.05-0.06 on the slow ones (runs 189, 194-198), and the Python loop probe does not tell
the two apart (runs 183-198). Every bench point records the runtime loop thread's CPU seconds per second
(``host.thread_cpu["gpuloom-runtime"]``); per request that entered, it is the host's intake, decision
and answer work, which a dropped request costs in full.

For each measured point of ``--policy`` in the given reports (points whose load generator fell behind are
left out, as the calibration leaves them out), this finds by bisection the ``host_drop_ms`` at which the
``h100-fast-host`` preset simulates the measured goodput, and the loop's CPU per request entered. It fits
``host_drop_ms = k * loop us per request`` (least squares through the origin) on the reports named by
``--fit`` and scores the rest held out: the simulated goodput with the fitted k against the measured,
beside the preset's fixed 0.04 ms and the slow hosts' 0.05. ``--cpu process`` fits on the whole process's CPU
per request instead (the rows' ``loop_us_per_request`` and ``loop`` errors are then that CPU's): on the same
16 points it tracked the zero-error times more closely (correlation 0.94 against the loop's 0.90), a
reading, not yet held out. Reports run with ``GPULOOM_YIELD_ANSWERS`` (their ``meta.gpuloom_settings``, or
named by ``--yield-reports`` for those before the key) are simulated with the option's model
(``ContentionModel.drop_yield_ms``) unless ``--no-yield-model``.

    python scripts/sim_host_drop_from_loop.py docs/results/runtime/bench_overload_h100_run1*.json \\
        --fit run173,run183,run188,run189 --out docs/results/runtime/sim_host_drop_from_loop_session60.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_sim import client_late  # noqa: E402
from sim_measured_hold import load_report, simulate_at  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.bench.labels import spec_of  # noqa: E402
from gpuloom.bench.host_hold import loop_us_per_request  # noqa: E402
from gpuloom.bench.resimulate import as_the_runtime_ran  # noqa: E402
from gpuloom.bench.variants import parse_policy_spec  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import FITTED_PRESETS  # noqa: E402

PRESET = "h100-fast-host"
FIXED = (0.04, 0.05)  # the preset's fitted value and the slow hosts' (sim_host_drop_sweep_session58/59)


def zero_error_drop_ms(goodput_at, measured: float, lo: float = 0.0, hi: float = 0.15, steps: int = 12) -> float:
    """The ``host_drop_ms`` in [lo, hi] at which ``goodput_at(host_drop_ms)`` meets ``measured`` (the
    simulated goodput falls as the host's per-drop time grows); an end of the range where it never does."""
    if goodput_at(lo) <= measured:
        return lo
    if goodput_at(hi) >= measured:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if goodput_at(mid) > measured else (lo, mid)
    return (lo + hi) / 2


def through_origin(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``y = k x``."""
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSONs of the overloaded mix measured on the GPU")
    ap.add_argument("--policy", default="nexus", help="the policy (plain, its in-process arrivals) to score")
    ap.add_argument("--fit", default="", help="comma-separated substrings naming the reports to fit k on")
    ap.add_argument("--k", type=float, default=None,
                    help="ms of host per drop for each us of loop CPU per request: apply this k (fitted before, "
                         "e.g. on nexus) to every point instead of fitting one; all points are then held out")
    ap.add_argument("--cpu", default="gpuloom-runtime",
                    help="whose CPU per request to fit on: a host.thread_cpu entry (default gpuloom-runtime, the "
                         "loop thread; process: the whole process, loop and in-process load generator sharing "
                         "one interpreter)")
    ap.add_argument("--yield-reports", default="",
                    help="comma-separated substrings naming the reports run with GPULOOM_YIELD_ANSWERS=1 that do "
                         "not record it (before meta.gpuloom_settings: runs 192-203)")
    ap.add_argument("--yield-model", action=argparse.BooleanOptionalAction, default=True,
                    help="simulate those reports with the option's model (drop_yield_ms; --no-yield-model: as a "
                         "FIFO, as before the sixty-second session)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    fit_names = [s for s in a.fit.split(",") if s]
    yield_names = [s for s in a.yield_reports.split(",") if s]
    store = ProfileStore.builtin("h200")
    base = FITTED_PRESETS[PRESET]()
    policy = parse_policy_spec(a.policy)[0]
    rows = []
    for path in a.reports:
        d, wl, profs = load_report(path, store, a.policy)
        settings = dict(d["meta"].get("gpuloom_settings") or {})
        if any(s in Path(path).name for s in yield_names):
            settings["GPULOOM_YIELD_ANSWERS"] = "1"
        ran = as_the_runtime_ran(base, settings) if a.yield_model else base
        for label, run in d["policies"].items():
            name, _, service = parse_policy_spec(spec_of(label))
            if name != policy or service.get("arrivals", "thread") != "thread" or run.get("error"):
                continue  # arrivals=loop: the loop thread also generates the load, its CPU says another thing
            for p in run.get("points", []):
                x = loop_us_per_request(p, a.cpu)
                if x is None or not p["goodput_rps"]:
                    continue

                def goodput_at(hd: float, p=p, label=label, d=d, wl=wl, profs=profs, ran=ran) -> float:
                    return simulate_at(d, wl, profs, label, p["scale"],
                                       dataclasses.replace(ran, host_drop_ms=hd,
                                                           drop_answer_ms=min(ran.drop_answer_ms, hd)),
                                       p.get("plan")).goodput_rps

                row = {"report": Path(path).name, "policy": label, "scale": p["scale"],
                       "fit": any(s in Path(path).name for s in fit_names),
                       "drop_yield_ms": ran.drop_yield_ms, "drop_answer_ms": ran.drop_answer_ms,
                       "client_late": client_late(p),
                       "measured_goodput": round(p["goodput_rps"], 1), "loop_us_per_request": round(x, 2),
                       # a request's own host work apart from its batches', for the next fit (points
                       # record the answers since runs 199-200, the intake since the runs after them)
                       "answer_us_per_request": p["host"].get("answer_us_per_request"),
                       "intake_us_per_request": p["host"].get("intake_us_per_request"),
                       "zero_error_drop_ms": round(zero_error_drop_ms(goodput_at, p["goodput_rps"]), 4)}
                row["goodput_at"] = goodput_at  # (dropped before saving)
                rows.append(row)
                print(f"{row['report']} {label} x{p['scale']:g}: measured {p['goodput_rps']:.0f}/s, loop "
                      f"{x:.1f} us/request, zero-error host_drop_ms {row['zero_error_drop_ms']:.4f}"
                      + (" (client late: left out)" if row["client_late"] else ""), flush=True)
    if a.k is not None:
        k = a.k
        for r in rows:
            r["fit"] = False
        print(f"given: host_drop_ms = {k:.5f} x loop us per request")
    else:
        fitted = [r for r in rows if r["fit"] and not r["client_late"]]
        if not fitted:
            print(f"no usable point in the reports named by --fit {a.fit!r} (or give --k)", file=sys.stderr)
            return 2
        k = through_origin([r["loop_us_per_request"] for r in fitted], [r["zero_error_drop_ms"] for r in fitted])
        print(f"fitted on {len(fitted)} points: host_drop_ms = {k:.5f} x loop us per request "
              f"({k * 1000:.2f} us of host per drop for each us of loop CPU per request)")
    summary: dict = {}
    for r in rows:
        goodput_at = r.pop("goodput_at")
        told = {"loop": k * r["loop_us_per_request"], **{f"fixed_{v:g}": v for v in FIXED}}
        r["errors"] = {key: round(goodput_at(hd) / r["measured_goodput"] - 1.0, 4) for key, hd in told.items()}
        r["loop_drop_ms"] = round(told["loop"], 4)
        if r["fit"] or r["client_late"]:
            continue
        for key, err in r["errors"].items():
            s = summary.setdefault(key, {"points": 0, "within_10pct": 0, "within_20pct": 0, "mean_abs_error": 0.0})
            s["points"] += 1
            s["within_10pct"] += abs(err) <= 0.10
            s["within_20pct"] += abs(err) <= 0.20
            s["mean_abs_error"] += abs(err)
        print(f"  held out {r['report']} {r['policy']}: loop k -> {told['loop']:.4f} ms "
              + "; ".join(f"{key} {err:+.1%}" for key, err in r["errors"].items()))
    for key, s in summary.items():
        s["mean_abs_error"] = round(s["mean_abs_error"] / max(1, s["points"]), 4)
        print(f"{key}: {s['within_10pct']} of {s['points']} held-out points within 10%, {s['within_20pct']} within "
              f"20%, mean |error| {s['mean_abs_error']:.1%}")
    if a.out:
        save_json(a.out, {"method": __doc__.split("\n\n")[1].replace("\n", " "), "policy": a.policy, "preset": PRESET,
                          "cpu": a.cpu, "yield_model": a.yield_model, "yield_reports": yield_names,
                          "fit_reports": fit_names, "k_ms_per_loop_us": round(k, 6), "held_out": summary, "points": rows})
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
