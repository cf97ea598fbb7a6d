"""Merge engine benchmark runs into docs/results/engine_h200.json and print the markdown tables.

    python scripts/merge_engine_results.py docs/results/engine_runs/run5_fp32.json ... \
        --out docs/results/engine_h200.json

Each (model, dtype) comes from exactly one run (the last file that has it), so every ratio in a row
is measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

NIMBLE_V100 = {"resnet50": 4.3, "resnet101": 4.6, "inception_v3": 5.2, "mobilenet_v2": 10.0,
               "efficientnet_b0": 9.0, "efficientnet_b5": 3.8, "nasnetalarge": 5.5}
BRANCHY = ("inception_v3", "googlenet", "nasnetalarge", "efficientnet_b0")


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="docs/results/engine_h200.json")
    args = p.parse_args()
    merged: dict[tuple[str, str], dict] = {}
    meta = None
    for path in args.runs:
        data = json.loads(Path(path).read_text())
        meta = meta or {k: v for k, v in data.items() if k not in ("results", "summary")}
        for rec in data["results"]:
            if "rows" in rec and rec["rows"]:
                rec["run"] = Path(path).name
                merged[(rec["model"], rec["dtype"])] = rec
    results = sorted(merged.values(), key=lambda r: (r["dtype"] != "float32", r["model"]))
    summary = {}
    for dtype in ("float32", "float16"):
        for b in (1, 8):
            rows = [(r["model"], row) for r in results if r["dtype"] == dtype for row in r["rows"] if row["batch"] == b]
            if not rows:
                continue
            summary[f"{dtype}_b{b}"] = {
                "models": len(rows),
                "geomean_speedup_auto_over_eager": round(geomean([row["speedup_gpuloom_auto"] for _, row in rows]), 3),
                "geomean_multi_over_cuda_graph_branchy": round(geomean(
                    [row["multi_over_single_graph"] for m, row in rows if m in BRANCHY]), 3),
                "auto_over_cuda_graph_worst": min((round(row["auto_over_single_graph"], 3), m) for m, row in rows),
                "auto_slower_than_cuda_graph_by_more_than_2pct": sorted(
                    m for m, row in rows if row["auto_over_single_graph"] < 0.98),
            }
    out = {**meta, "runs": sorted({r["run"] for r in results}), "results": results, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1))

    print("| model | dtype | batch | eager | cuda graph | gpuloom 1 stream | gpuloom multi | gpuloom auto "
          "| auto vs eager | multi vs graph | streams / syncs | critical path | multi / crit. | compile s | graph MiB |")
    print("|" + "---|" * 15)
    for r in results:
        for row in r["rows"]:
            cp = row.get("critical_path_ms")
            print(f"| {r['model']} | {r['dtype'].replace('float', 'fp')} | {row['batch']} | {row['eager_ms']:.3f} "
                  f"| {row['cuda_graph_ms']:.3f} | {row['gpuloom_single_ms']:.3f} | {row['gpuloom_multi_ms']:.3f} "
                  f"| {row['gpuloom_auto_ms']:.3f} | {row['speedup_gpuloom_auto']:.2f}x "
                  f"| {row['multi_over_single_graph']:.2f}x | {r['streams']} / {r['syncs']} "
                  f"| {cp:.3f} | {row['multi_over_critical_path']:.2f} " if cp else
                  f"| {r['model']} | {r['dtype'].replace('float', 'fp')} | {row['batch']} | {row['eager_ms']:.3f} "
                  f"| {row['cuda_graph_ms']:.3f} | {row['gpuloom_single_ms']:.3f} | {row['gpuloom_multi_ms']:.3f} "
                  f"| {row['gpuloom_auto_ms']:.3f} | {row['speedup_gpuloom_auto']:.2f}x "
                  f"| {row['multi_over_single_graph']:.2f}x | {r['streams']} / {r['syncs']} | - | - ", end="")
            print(f"| {r['compile_s']:.1f} | {r['graph_memory_mib']:.0f} |")
    print()
    print("| model (fp32, batch 1) | Nimble V100 target | gpuloom auto vs eager, H200 |")
    print("|---|---|---|")
    for r in results:
        if r["dtype"] == "float32" and r["model"] in NIMBLE_V100:
            row = next(row for row in r["rows"] if row["batch"] == 1)
            ok = "met" if row["speedup_gpuloom_auto"] >= NIMBLE_V100[r["model"]] else "missed"
            print(f"| {r['model']} | {NIMBLE_V100[r['model']]}x | {row['speedup_gpuloom_auto']:.2f}x ({ok}) |")
    print()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
