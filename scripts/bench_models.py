#!/usr/bin/env python
"""Per-model figures of one or more `gpuloom bench` reports side by side (an A/B/A across processes).

A bench report's table gives each policy's whole-mix attainment; an option that changes some models
only (``--engine fuse_epilogues=true``: efficientnet_b0 and mobilenet_v2 on mix6) shows first in those
models' own rows. This prints, per report, policy and load: the mix's attainment, then per model its
attainment and mean compute time (dispatch to completion, ms). No torch: runs on any machine.

A served point's attainment and compute time move with the host (runs 147-148, 157); a batch's device
time on its partition does not. ``--batches`` compares that instead: per (model, SMs, batch size)
cell that every report served at least ``--min-batches`` times (pooled over its points), the mean
device ms per batch in each report and its ratio to the mean of the other reports.

    python3 scripts/bench_models.py docs/results/runtime/bench_mix6_h200_run148_kernels_aba_{0,1,2}.json \
        --models mobilenet_v2,efficientnet_b0 --out /tmp/aba.json
    python3 scripts/bench_models.py docs/results/runtime/bench_mix6_h100_run157_kernels_bab_{0,1,2}.json \
        --models mobilenet_v2,efficientnet_b0 --batches --out /tmp/bab_batches.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(report: dict, label: str, models: list[str] | None) -> list[dict]:
    """One row per (policy, load) of ``report``: the mix's attainment and the chosen models' figures."""
    out = []
    engine = report.get("meta", {}).get("engine") or {}
    for policy, entry in report["policies"].items():
        for point in entry.get("points", []):
            per_model = {m["model"]: {"attainment": round(m["slo_attainment"], 4),
                                      "compute_ms": round(m["compute_ms"]["mean"], 3)}
                         for m in point.get("models", []) if not models or m["model"] in models}
            out.append({"report": label, "engine": engine, "policy": policy, "scale": point["scale"],
                        "attainment": round(point["slo_attainment"], 4), "models": per_model})
    return out


def batch_times(report: dict, models: list[str] | None) -> dict[tuple[str, int, int], tuple[float, int]]:
    """``(model, SMs, batch size) -> (mean device ms per batch, batches)`` over every point of
    ``report`` (its ``profile_check`` rows, weighted by their batches)."""
    sums: dict[tuple[str, int, int], list[float]] = {}
    for entry in report["policies"].values():
        for point in entry.get("points", []):
            for r in point.get("profile_check", ()):
                if models and r["model"] not in models:
                    continue
                acc = sums.setdefault((r["model"], r["sms"], r["batch"]), [0.0, 0])
                acc[0] += r["measured_ms"] * r["batches"]
                acc[1] += r["batches"]
    return {k: (ms / n, n) for k, (ms, n) in sums.items() if n}


def compare_batches(tables: list[dict], min_batches: int) -> list[dict]:
    """The cells every table has with at least ``min_batches`` batches: each table's mean ms and its
    ratio to the mean of the others' (two or more tables)."""
    if len(tables) < 2:
        raise ValueError("--batches compares two or more reports")
    keys = set.intersection(*(set(k for k, (_, n) in t.items() if n >= min_batches) for t in tables))
    out = []
    for key in sorted(keys):
        ms = [t[key][0] for t in tables]
        ratios = [m / (sum(ms[:i] + ms[i + 1:]) / (len(ms) - 1)) for i, m in enumerate(ms)]
        out.append({"model": key[0], "sms": key[1], "batch": key[2], "ms": [round(m, 4) for m in ms],
                    "batches": [t[key][1] for t in tables], "ratio_to_others": [round(r, 4) for r in ratios]})
    return out


def print_batches(reports: list[dict], names: list[str], models: list[str] | None, min_batches: int,
                  out: str | None) -> int:
    """``--batches``: each cell's device ms per report, each report's ratio to the others, the JSON."""
    try:
        cells = compare_batches([batch_times(r, models) for r in reports], min_batches)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, name in enumerate(names):
        engine = ",".join(f"{k}={v}" for k, v in (reports[i].get("meta", {}).get("engine") or {}).items())
        print(f"[{i}] {name} [{engine or 'defaults'}]")
    for c in cells:
        figures = "  ".join(f"[{i}] {m:.3f} ms ({r:.3f})" for i, (m, r) in enumerate(zip(c["ms"], c["ratio_to_others"])))
        print(f"{c['model']} {c['sms']} SMs batch {c['batch']}: {figures}")
    for i in range(len(reports)):
        rs = sorted(c["ratio_to_others"][i] for c in cells)
        lowest = sum(c["ms"][i] == min(c["ms"]) for c in cells)
        if rs:
            print(f"[{i}] ratio to the others: median {rs[len(rs) // 2]:.3f}, range {rs[0]:.3f}-{rs[-1]:.3f}, "
                  f"lowest of all in {lowest} of {len(cells)} cells")
    if out:
        Path(out).write_text(json.dumps({"reports": names, "min_batches": min_batches, "cells": cells}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSON reports, in the order they ran")
    ap.add_argument("--models", default="", help="comma-separated model names (default: every model)")
    ap.add_argument("--batches", action="store_true",
                    help="compare device ms per batch per (model, SMs, batch size) instead (see above)")
    ap.add_argument("--min-batches", type=int, default=50,
                    help="with --batches: the fewest batches a cell needs in every report (default 50)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m] or None
    table, reports = [], []
    for path in a.reports:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        reports.append(report)
        table += rows(report, Path(path).name, models)
    if a.batches:
        return print_batches(reports, [Path(p).name for p in a.reports], models, a.min_batches, a.out)
    for r in table:
        figures = "; ".join(f"{m} {v['attainment']:.3f} / {v['compute_ms']:.2f} ms" for m, v in r["models"].items())
        engine = ",".join(f"{k}={v}" for k, v in r["engine"].items()) or "defaults"
        print(f"{r['report']} [{engine}] {r['policy']} x{r['scale']:g}: mix {r['attainment']:.3f}; {figures}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
