"""Simulated against measured goodput, one dot per bench point, from `scripts/calibrate_sim.py` reports.

    python scripts/plot_sim_validation.py fit=docs/results/runtime/sim_calibration_session45_hold_per_ms.json \
        held-out=docs/results/runtime/sim_heldout_session45_preset45.json --out docs/results/runtime/sim_validation.png

Each ``LABEL=PATH`` is one calibration report; its best setting's points are drawn (a held-out check is a
report of one setting). Colour: the workload (from the bench file's name); marker: the report. The band
is issue 5's target, goodput within 10%; a point outside it is named in the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET = 0.10
WORKLOADS = ("mix6_deadlines", "mix6", "light3", "overload")  # in the order a bench file's name is read


def workload_of(file_name: str) -> str:
    """The workload a bench file measured, by its name (``bench_light3_h200_run54_warmup.json``: light3)."""
    for w in WORKLOADS:
        if w in file_name:
            return w
    return "other"


def read_points(spec: str) -> tuple[str, list[dict]]:
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = Path(spec).stem, spec
    d = json.loads(Path(path).read_text())
    if "best_points" not in d:
        raise SystemExit(f"plot_sim_validation: {path} is not a calibrate_sim.py report (no best_points)")
    return label, [p for p in d["best_points"] if p.get("goodput_error") is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", metavar="LABEL=PATH", help="calibrate_sim.py JSON reports")
    ap.add_argument("--title", default="Simulated vs measured goodput (H200 bench points)")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"mix6": "#2980b9", "mix6_deadlines": "#8e44ad", "light3": "#27ae60", "overload": "#c0392b",
              "other": "#7f8c8d"}
    markers = "os^Dv"
    fig, ax = plt.subplots(figsize=(7, 6.5))
    top = 0.0
    for i, spec in enumerate(a.reports):
        label, points = read_points(spec)
        inside = sum(abs(p["goodput_error"]) <= TARGET for p in points)
        print(f"{label}: {inside} of {len(points)} points within {TARGET:.0%}")
        for w in colors:
            pts = [p for p in points if workload_of(p["file"]) == w]
            if not pts:
                continue
            xs = [p["measured_goodput"] for p in pts]
            ys = [p["simulated_goodput"] for p in pts]
            top = max(top, *xs, *ys)
            ax.scatter(xs, ys, s=28, marker=markers[i % len(markers)], color=colors[w], alpha=0.75,
                       edgecolors="black" if i else "none", linewidths=0.5, label=f"{w} ({label})")
        for p in points:
            if abs(p["goodput_error"]) > TARGET:
                print(f"  outside: {p['file']} {p['policy']} x{p['scale']:g} {p['goodput_error']:+.1%}")
    top *= 1.08
    ax.plot([0, top], [0, top], color="black", linewidth=0.8)
    ax.fill_between([0, top], [0, top * (1 - TARGET)], [0, top * (1 + TARGET)], color="#bdc3c7", alpha=0.35,
                    label=f"within {TARGET:.0%}")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured goodput, req/s")
    ax.set_ylabel("simulated goodput, req/s")
    ax.set_title(a.title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
