"""Draw a ``Schedule`` as a Gantt chart: time across, SMs up, one colour per model."""

from __future__ import annotations

from pathlib import Path

from .schedule import Schedule


def render_gantt(schedule: Schedule, path: str, *, cycles: int = 2, title: str | None = None) -> None:
    """Write a PNG of ``cycles`` repetitions of ``schedule`` to ``path`` (matplotlib, Agg backend).

    Each slot is a rectangle spanning its partition's SMs (vertical) for its duration (horizontal);
    dashed lines mark cycle boundaries; the legend gives each model's batch and slots per cycle.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if cycles < 1:
        raise ValueError(f"render_gantt: cycles must be >= 1, found {cycles}")
    names = [m.model for m in schedule.models]
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    C = schedule.cycle_ms
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for p in schedule.partitions:
        for c in range(cycles):
            for s in p.slots:
                ax.add_patch(
                    Rectangle(
                        (c * C + s.start_ms, p.sm_offset),
                        s.duration_ms,
                        p.sms,
                        facecolor=colour[s.model],
                        edgecolor="black",
                        linewidth=0.5,
                    )
                )
                if c == 0 and s.duration_ms > 0.06 * C and p.sms >= 8:
                    ax.text(
                        s.start_ms + s.duration_ms / 2,
                        p.sm_offset + p.sms / 2,
                        f"b{s.batch}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
        ax.axhline(p.sm_offset, color="grey", linewidth=0.4)
    for c in range(1, cycles):
        ax.axvline(c * C, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, cycles * C)
    ax.set_ylim(0, schedule.gpu_sms)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("SMs")
    handles = []
    for m in schedule.models:
        label = f"{m.model} (b{m.batch} x{m.slots_per_cycle}, {m.sms} SMs)" if m.partition >= 0 else f"{m.model} (not served)"
        if m.short:
            label += f", {m.served_fraction:.0%} served"
        handles.append(Patch(facecolor=colour[m.model], edgecolor="black", label=label))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(
        title
        or f"{schedule.gpu or 'GPU'}: cycle {C:.2f} ms, {len(schedule.partitions)} partitions, "
        f"planned utilization {schedule.utilization():.0%}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
