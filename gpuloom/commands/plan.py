"""``gpuloom plan``: plan a workload on one GPU; print the schedule and draw it as a Gantt chart."""

from __future__ import annotations

import argparse

from .argtypes import int_between, nonnegative_number

NAME = "plan"
HELP = "plan a workload (YAML/JSON) on one GPU: SM partitions, batch sizes, slot cycles; writes a Gantt PNG"
#: the most cycles ``--cycles`` draws (100 of mix6's take 2 s; 100000 drew for minutes)
MAX_CYCLES = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (.yaml/.yml/.json), e.g. examples/mix6.yaml")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profiles", metavar="DIR", default=None, help="directory of profile JSON files")
    src.add_argument("--gpu", default=None, help="shipped profiles to use (default: the workload's gpu, e.g. h200)")
    src.add_argument("--synthetic", action="store_true", help="plan against the synthetic profile zoo")
    p.add_argument("--out", metavar="DIR", default=".", help="where to write <name>.schedule.json and <name>.gantt.png")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every arrival rate (default 1)")
    p.add_argument("--headroom", type=nonnegative_number("a headroom"), default=0.0, help="plan capacity for rate x (1 + headroom) (default 0)")
    p.add_argument("--peak", action="store_true", help="plan for each model's peak rate instead of its mean")
    p.add_argument("--min-sms", type=int, default=None, metavar="N",
                   help="smallest partition to plan, SMs (default: dstack's, 16 or the whole GPU if it has fewer: "
                        "the plan dstack would serve; 0 lets the planner go down to the granularity)")
    p.add_argument("--batch-overhead-ms", type=nonnegative_number("a hold in ms"), default=None, metavar="MS",
                   help="each batch's hold beyond its GPU time, planned into its slot (default: dstack's, "
                        "1.125 ms: the plan dstack would serve; 0 plans none)")
    p.add_argument("--cycles", type=int_between(1, MAX_CYCLES, "a number of cycles"), default=1,
                   help=f"cycles to draw in the Gantt chart, 1 to {MAX_CYCLES} (default 1)")
    p.add_argument("--no-png", action="store_true", help="do not draw the Gantt chart")


def _min_sms(asked: int | None, demands: list, profiles) -> int:
    """``--min-sms``, or dstack's floor on the profiles' GPU (``DStackPolicy.floor_sms``), so that the
    plan printed is the plan dstack serves (it once planned with no smallest partition, and light3's
    came out 60/40/32 SMs where dstack serves 84/48)."""
    if asked is not None:
        return asked
    from gpuloom.policy.dstack import DStackPolicy

    gpu_sms = max(profiles.get(d.model).gpu.sm_count for d in demands)
    return DStackPolicy().floor_sms(gpu_sms)


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    from gpuloom.bench.workload import WorkloadError, load_workload, validate
    from gpuloom.commands.output import open_profiles, out_dir_error, print_error, print_warning, table_console
    from gpuloom.plan import PlanError, plan, render_gantt
    from gpuloom.policy.dstack import DEFAULT_HOLD_MS

    console = table_console(120)
    err = Console(stderr=True)
    problem = out_dir_error(args.out)
    if problem:
        print_error(err, problem)
        return 2
    try:
        workload = load_workload(args.workload)
        if args.scale != 1.0:
            workload = workload.scaled(args.scale)
        profiles, warnings = open_profiles(
            workload, profiles_dir=args.profiles, gpu=args.gpu, synthetic=args.synthetic
        )
        for w in warnings:
            print_warning(err, w)
        validate(workload, profiles)
        demands = workload.demands(peak=args.peak)
        min_sms = _min_sms(args.min_sms, demands, profiles)
        hold_ms = DEFAULT_HOLD_MS if args.batch_overhead_ms is None else args.batch_overhead_ms
        schedule = plan(demands, profiles, headroom=args.headroom, min_sms=min_sms, batch_overhead_ms=hold_ms)
    except (WorkloadError, PlanError) as e:
        print_error(err, e)
        return 2

    title = (
        f"{escape(Path(args.workload).name)}: {escape(schedule.gpu)} ({schedule.gpu_sms} SMs, granularity {schedule.granularity}), "
        f"partitions of {min_sms} SMs or more, a hold of {hold_ms:g} ms per batch, "
        f"cycle {schedule.cycle_ms:.2f} ms, planned SM utilization {schedule.utilization():.0%}, "
        f"planned in {schedule.meta.get('plan_ms', 0):.1f} ms"
    )
    t = Table(title=title, title_justify="left", caption="times in ms; k slots of batch b per period; "
              "worst = period + k x L", caption_justify="left")
    # k: back-to-back slots of batch b per period; worst = period + k * L (ms); see gpuloom.plan.planner
    t.add_column("model", no_wrap=True)
    for col in ("part", "SMs", "b", "k", "period", "L", "worst", "SLO", "demand/s", "plan/s", "served"):
        t.add_column(col, justify="right", no_wrap=True)
    for m in schedule.models:
        served = f"{m.served_fraction:.0%}"
        if m.short:
            served = f"[red]{served}[/]"
        t.add_row(
            escape(m.model), str(m.partition), str(m.sms), str(m.batch), str(m.slots_per_cycle), f"{m.period_ms:.2f}",
            f"{m.latency_ms:.2f}", f"{m.worst_ms:.2f}", f"{m.slo_ms:g}", f"{m.demand_rps:.1f}",
            f"{m.planned_rps:.1f}", served,
        )
    console.print(t)
    pt = Table(title="partitions", title_justify="left")
    for col in ("#", "SMs", "range", "period ms", "busy", "slots per period"):
        pt.add_column(col, justify="left" if col == "slots per period" else "right")
    for p in schedule.partitions:
        period = p.period(schedule.cycle_ms)
        reps = max(1, round(schedule.cycle_ms / period))
        groups: list[list] = []
        for s in p.slots[: len(p.slots) // reps]:
            if groups and groups[-1][0] == (s.model, s.batch):
                groups[-1][1] += 1
            else:
                groups.append([(s.model, s.batch), 1])
        pt.add_row(
            str(p.index), str(p.sms), f"{p.sm_offset}..{p.sm_offset + p.sms - 1}", f"{period:.2f}",
            f"{p.busy_ms / schedule.cycle_ms:.0%}",
            ", ".join(f"{escape(m)} b{b}" + (f" x{n}" if n > 1 else "") for (m, b), n in groups),
        )
    console.print(pt)
    free = schedule.gpu_sms - schedule.used_sms
    if free:
        console.print(f"{free} SMs left unassigned (no partition would get faster with them)")
    if schedule.short:
        console.print(
            "[red]short:[/] " + ", ".join(f"{escape(m)} misses {f:.0%} of its demand" for m, f in schedule.short)
            + " (weighted max-min fair on served fraction)"
        )
    else:
        console.print("[green]every model gets its demand within its SLO[/]")
    from gpuloom.policy.dstack import AUTO_SHARED_ABOVE, DEFAULT_TURNAROUND_MS, auto_lanes, turnaround_share

    share = turnaround_share(schedule)
    where = {"shared": "shared lanes", "partitions": "partitions"}[auto_lanes(share)]
    console.print(
        f"turnaround share {share:.3f}: the partitions would idle that much of the GPU's SM-time through "
        f"{DEFAULT_TURNAROUND_MS:g} ms batch turnarounds; dstack (lanes=auto, its default) would run a plan "
        f"with this share on {where} (shared above {AUTO_SHARED_ABOVE:g})"
    )

    out = Path(args.out)
    stem = Path(args.workload).stem
    try:
        out.mkdir(parents=True, exist_ok=True)
        js = schedule.save(out / f"{stem}.schedule.json")
        console.print(f"wrote {escape(str(js))}")
        if not args.no_png:
            png = out / f"{stem}.gantt.png"
            render_gantt(schedule, str(png), cycles=args.cycles)
            console.print(f"wrote {escape(str(png))}")
    except OSError as e:
        print_error(err, f"cannot write into --out {args.out}: {e}")
        return 2
    sys.stdout.flush()
    return 0
