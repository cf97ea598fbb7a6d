"""Charts of simulated (and, later, measured) policy comparisons. matplotlib, imported lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .metrics import RunMetrics


def comparison_chart(
    runs: Sequence[RunMetrics],
    path: str | Path,
    *,
    sweep: dict[str, float] | None = None,
    title: str = "",
) -> Path:
    """Bar chart, one bar per policy: goodput (req/s), SLO attainment, SM utilization and, when
    ``sweep`` (policy -> highest load factor at the target attainment) is given, the sustained load.
    Writes a PNG to ``path`` and returns it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in runs]
    panels = [
        ("goodput (req/s within SLO)", [r.goodput_rps for r in runs], "{:.0f}"),
        ("SLO attainment", [r.slo_attainment for r in runs], "{:.1%}"),
        ("SM utilization", [r.sm_utilization for r in runs], "{:.0%}"),
    ]
    if sweep:
        panels.insert(0, ("highest load factor at target SLO attainment", [sweep.get(n, 0.0) for n in names], "{:.2f}x"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    colors = ["#c0392b" if n == "dstack" else "#7f8c8d" if n == "ideal" else "#2980b9" for n in names]
    for ax, (label, values, fmt) in zip(axes, panels):
        bars = ax.bar(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        for b, v in zip(bars, values):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
