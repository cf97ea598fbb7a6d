"""SLO attainment and goodput against offered load, one line per policy, from `gpuloom bench` JSONs.

    python scripts/plot_bench.py docs/results/runtime/bench_mix6_h200_*.json --out docs/results/runtime/mix6_h200.png

Points of one policy from several files are drawn together (labelled by file when a policy appears
in more than one), so runs made in different device calls stay distinguishable. ``--merge`` draws one
line per policy instead, through the points of every file (a sweep spread over several device
calls); files made with different ``CUDA_DEVICE_MAX_CONNECTIONS`` stay apart, labelled by it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpuloom.bench.labels import policy_of, spec_of  # noqa: E402


def short_name(policy: str) -> str:
    """``policy`` for a legend: an option naming a file (``holds=docs/.../bench_x_run54_warmup.json``)
    shows the run it came from (``holds=run54``), or the file's stem without its folders."""
    spec = spec_of(policy)
    repeat = policy[len(spec):]  # "#2" of a variant listed again, kept past the file-name shortening
    parts = []
    for part in spec.split(":"):
        key, sep, value = part.partition("=")
        if sep and ("/" in value or value.endswith(".json")):
            stem = Path(value).stem
            run = re.search(r"run\d+", stem)
            value = run.group(0) if run else stem
        parts.append(f"{key}{sep}{value}")
    return ":".join(parts) + repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--merge", action="store_true", help="one line per policy through the points of every file")
    ap.add_argument("--title", default="", help="a title over both panels")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list] = {}
    files = [(path, json.loads(Path(path).read_text())) for path in a.bench]
    queues = {path: int((d.get("meta") or {}).get("cuda_device_max_connections") or 8) for path, d in files}
    mixed = len(set(queues.values())) > 1  # label --merge lines by hardware queues only where files differ
    for path, d in files:
        for pol, res in d["policies"].items():
            pts = sorted(res["points"], key=lambda p: p["offered_rps"])
            if not pts:
                continue
            if not a.merge:
                series.setdefault(pol, []).append((Path(path).stem, pts))
                continue
            key = f"{pol}, {queues[path]} hw queues" if mixed else pol
            runs = series.setdefault(key, [(key, [])])
            runs[0] = (key, sorted(runs[0][1] + pts, key=lambda p: p["offered_rps"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for pol, runs in sorted(series.items()):
        for stem, pts in runs:
            label = short_name(pol) if len(runs) == 1 else f"{short_name(pol)} ({stem})"
            x = [p["offered_rps"] for p in pts]
            style = dict(marker="o", lw=2.5 if policy_of(pol.split(",")[0]) == "dstack" else 1.2,
                         ls=":" if pol.endswith(", 8 hw queues") else "-")
            ax1.plot(x, [p["slo_attainment"] for p in pts], label=label, **style)
            ax2.plot(x, [p["goodput_rps"] for p in pts], label=label, **style)
    ax1.axhline(a.target, color="grey", ls="--", lw=0.8)
    ax1.set(xlabel="offered load (requests/s)", ylabel="SLO attainment", title="attainment vs load")
    lim = max(p["offered_rps"] for r in series.values() for _, pts in r for p in pts)
    ax2.plot([0, lim], [0, lim], color="grey", ls=":", lw=0.8, label="goodput = offered")
    ax2.set(xlabel="offered load (requests/s)", ylabel="goodput (requests/s within SLO)", title="goodput vs load")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
