#!/usr/bin/env python
"""Per-model figures of one or more `gpuloom bench` reports side by side (an A/B/A across processes).

A bench report's table gives each policy's whole-mix attainment; an option that changes some models
only (``--engine fuse_epilogues=true``: efficientnet_b0 and mobilenet_v2 on mix6) shows first in those
models' own rows. This prints, per report, policy and load: the mix's attainment, then per model its
attainment and mean compute time (dispatch to completion, ms). No torch: runs on any machine.

    python3 scripts/bench_models.py docs/results/runtime/bench_mix6_h200_run148_kernels_aba_{0,1,2}.json \
        --models mobilenet_v2,efficientnet_b0 --out /tmp/aba.json
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSON reports, in the order they ran")
    ap.add_argument("--models", default="", help="comma-separated model names (default: every model)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m] or None
    table = []
    for path in a.reports:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        table += rows(report, Path(path).name, models)
    for r in table:
        figures = "; ".join(f"{m} {v['attainment']:.3f} / {v['compute_ms']:.2f} ms" for m, v in r["models"].items())
        engine = ",".join(f"{k}={v}" for k, v in r["engine"].items()) or "defaults"
        print(f"{r['report']} [{engine}] {r['policy']} x{r['scale']:g}: mix {r['attainment']:.3f}; {figures}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
