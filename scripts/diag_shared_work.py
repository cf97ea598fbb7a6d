"""What the whole GPU's shared lanes got through per second, counted two ways (issue 5, fiftieth session).

The simulator's shared lanes divide the SMs by each running batch's *demand* and, oversubscribed,
conserve the work measured in that unit. Which unit does the card conserve? For every point of a
bench report whose batches all ran on the whole GPU (shared lanes: triton, clipper, nexus, temporal,
dstack when it chose them), this sums the point's batches (``profile_check``) per second of the point,
with the profiles the point was planned with (``bench.e2e.planned_profiles``), in two units of the
GPU's SMs:

* ``knee``: ``demand_fraction x knee(b) x L(b, all SMs)``, what the default ``ContentionModel``
  conserves (the H200 preset's 0.89);
* ``area``: ``min over s >= min_sms of s x L(b, s)``, the batch's SM-time at its most efficient SM
  count, what ``ContentionModel(demand="area")`` conserves.

Past a policy's edge (attainment below the target) its queues grow until the lanes are saturated:
there a unit the card conserves reads about the same at every point, whatever the batch sizes.

    python scripts/diag_shared_work.py docs/results/runtime/bench_mix6_h100_run164_mb16_profiles.json \\
        docs/results/runtime/bench_mix6_h100_run164_mb4_profiles.json --policy triton --out /tmp/work.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.e2e import planned_profiles  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402


def point_work(point: dict, profiles: dict, gpu_sms: int, *, demand_fraction: float = 0.89,
               min_sms: int = 16) -> dict | None:
    """One point's batches per second in both units (fractions of the GPU), or None when some of its
    batches ran on fewer SMs than the whole GPU (partitions: nothing shared to count)."""
    cells = point.get("profile_check") or []
    if not cells or any(c["sms"] < gpu_sms for c in cells):
        return None
    per_ms = 1.0 / (gpu_sms * point["duration_s"] * 1000.0)
    batches = sum(c["batches"] for c in cells)
    knee = sum(c["batches"] * demand_fraction * profiles[c["model"]].knee(c["batch"])
               * profiles[c["model"]].full_latency(c["batch"]) for c in cells) * per_ms
    area = sum(c["batches"] * profiles[c["model"]].min_sm_time(c["batch"], min_sms) for c in cells) * per_ms
    return {"scale": point["scale"], "attainment": round(point["slo_attainment"], 4),
            "mean_batch": round(sum(c["batches"] * c["batch"] for c in cells) / batches, 2),
            "knee": round(knee, 4), "area": round(area, 4)}


def spread(values: list[float]) -> dict | None:
    """min, max and (max - min) / mean of ``values``: how far a unit is from being conserved."""
    if not values:
        return None
    lo, hi = min(values), max(values)
    return {"min": lo, "max": hi, "relative_range": round((hi - lo) / (sum(values) / len(values)), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSON reports")
    ap.add_argument("--policy", default="triton", help="the reports' policy (variant spelling) to read")
    ap.add_argument("--gpu-sms", type=int, default=132, help="the GPU's SMs (default 132: H100 and H200)")
    ap.add_argument("--demand-fraction", type=float, default=0.89, help="the knee unit's fraction (default 0.89)")
    ap.add_argument("--min-sms", type=int, default=16, help="the area unit's fewest SMs (default 16)")
    ap.add_argument("--target", type=float, default=0.99, help="points below this attainment are past the edge")
    ap.add_argument("--out", default=None, help="write the rows and the spreads as JSON here")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw both units against the mean batch here")
    ap.add_argument("--title", default="Shared lanes' work per second past the edge")
    a = ap.parse_args(argv)
    store = ProfileStore.builtin("h200")
    rows = []
    for path in a.reports:
        report = json.loads(Path(path).read_text())
        if a.policy not in report["policies"]:
            print(f"{path}: no policy {a.policy!r} (it has {sorted(report['policies'])}); skipped", file=sys.stderr)
            continue
        profiles = planned_profiles(report, store, a.policy)
        for p in report["policies"][a.policy]["points"]:
            w = point_work(p, profiles, a.gpu_sms, demand_fraction=a.demand_fraction, min_sms=a.min_sms)
            if w is not None:
                rows.append({"file": Path(path).name, **w})
    if not rows:
        print(f"no point of {a.policy!r} ran its batches on the whole GPU", file=sys.stderr)
        return 2
    for r in rows:
        edge = "past the edge" if r["attainment"] < a.target else ""
        print(f"{r['file'][:44]:44s} x{r['scale']:<8g} attainment {r['attainment']:.3f} mean batch {r['mean_batch']:5.2f}"
              f"  knee {r['knee']:.3f}  area {r['area']:.3f}  {edge}")
    past = [r for r in rows if r["attainment"] < a.target]
    summary = {u: spread([r[u] for r in past]) for u in ("knee", "area")}
    for u, s in summary.items():
        if s:
            print(f"{u}: {s['min']:.3f}-{s['max']:.3f} over the {len(past)} points past the edge "
                  f"(range {s['relative_range']:.0%} of the mean)")
    if a.out:
        Path(a.out).write_text(json.dumps({"policy": a.policy, "gpu_sms": a.gpu_sms, "demand_fraction": a.demand_fraction,
                                           "min_sms": a.min_sms, "target": a.target, "rows": rows,
                                           "past_the_edge": summary}, indent=1) + "\n")
        print(f"wrote {a.out}")
    if a.plot:
        plot(rows, a.target, a.plot, a.title)
        print(f"wrote {a.plot}")
    return 0


def plot(rows: list[dict], target: float, path: str, title: str) -> None:
    """Both units against the mean batch: filled past the edge (where a conserved unit is flat),
    hollow below it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for unit, color, label in (("knee", "#c0392b", "knee-work (the simulator's default)"),
                               ("area", "#2980b9", "SM-time at the most efficient SM count")):
        for past in (True, False):
            pts = [r for r in rows if (r["attainment"] < target) == past]
            ax.scatter([r["mean_batch"] for r in pts], [r[unit] for r in pts], s=28, color=color,
                       facecolors=color if past else "none", label=label if past else None)
    ax.set_xlabel("mean batch of the point")
    ax.set_ylabel("work per second, in GPUs")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, title=f"filled: attainment < {target:g}", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
