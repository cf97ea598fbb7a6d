"""``gpuloom simulate``: run a workload under several policies on the simulated GPU and compare."""

from __future__ import annotations

import argparse

from .argtypes import positive_number

NAME = "simulate"
HELP = "simulate a workload under scheduling policies (dstack and baselines); compare, sweep the load"

DEFAULT_POLICIES = "dstack,triton,clipper,nexus,gslice,temporal,ideal"
#: ``--contention``'s choices: the sharing model a simulation starts from
CONTENTION_PRESETS = ("plain", "h200", "h100-fast-host")
#: the flags that change one parameter of it (``ContentionModel`` field names)
CONTENTION_FLAGS = ("demand_fraction", "efficiency", "interference", "batch_overhead_ms", "host_launch_ms", "hold_spread",
                    "hold_per_ms", "host_drop_ms")


def _attainment(text: str) -> float:
    """argparse type: an SLO attainment in (0, 1] (a traceback from the sweep before)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"an attainment is a fraction in (0, 1], e.g. 0.99; found {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (.yaml/.yml/.json), e.g. examples/mix6.yaml")
    p.add_argument("--policy", default=DEFAULT_POLICIES,
                   help=f"comma-separated policies (default {DEFAULT_POLICIES}); a variant is NAME:KEY=VALUE[:...] with "
                        f"the policy's options, as in gpuloom bench, e.g. dstack:min_sms=0 (dstack planning 8-SM "
                        f"partitions, as before its 16-SM floor); reported under that spelling")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profiles", metavar="DIR", default=None, help="directory of profile JSON files")
    src.add_argument("--synthetic", action="store_true", help="use the synthetic profile zoo")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every arrival rate (default 1)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default: the workload's)")
    p.add_argument("--sweep-rate", action="store_true",
                   help="find each policy's highest load factor keeping the target SLO attainment (bisection)")
    p.add_argument("--target", type=_attainment, default=0.99, help="SLO attainment the sweep must keep (default 0.99)")
    p.add_argument("--sweep-duration", type=positive_number("seconds"), default=10.0,
                   help="seconds of arrivals per sweep point (default 10; at most the workload's)")
    p.add_argument("--contention", choices=CONTENTION_PRESETS, default="plain",
                   help="the simulated GPU's sharing model: plain (the knee model, no host terms; the default) or h200 "
                        "(fitted to the H200 bench runs: each batch holds its lane 0.75 ms + 0.1 ms per ms of its "
                        "GPU time, 0.15 ms of one launching host thread per batch, demand fraction 0.89; "
                        "docs/reports/runtime.md), or h100-fast-host (the same with a 0.35 ms hold: an H100 on a "
                        "host that turns batches around quickly, runs 171-175; and 0.04 ms of that host per request "
                        "dropped, runs 173 and 183). The flags below change one parameter of it")
    p.add_argument("--demand-fraction", type=float, default=None,
                   help="contention model: share of its knee a shared batch occupies (plain: 1)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="contention model: fraction of shared SMs delivered when oversubscribed (plain: 1)")
    p.add_argument("--interference", type=float, default=None,
                   help="contention model: slowdown per co-running batch (plain: 0)")
    p.add_argument("--batch-overhead-ms", type=float, default=None,
                   help="contention model: ms each batch holds its lane beyond its GPU work (plain: 0)")
    p.add_argument("--host-launch-ms", type=float, default=None,
                   help="contention model: ms of the one host thread that launches every batch, one after another "
                        "(plain: 0)")
    p.add_argument("--hold-spread", type=float, default=None,
                   help="contention model: each batch's hold drawn from a lognormal of that mean with this sigma "
                        "(plain: 0, every hold the mean; the H200's lanes measured 0.46-0.69)")
    p.add_argument("--hold-per-ms", type=float, default=None,
                   help="contention model: more hold per ms of the batch's GPU time (plain: 0; the H200's holds grow "
                        "with the batch)")
    p.add_argument("--host-drop-ms", type=float, default=None,
                   help="contention model: ms of that one host thread per request a policy drops, after the "
                        "decision's launches (plain: 0; nexus at overload drops ten for each it serves)")
    p.add_argument("--yield-answers", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate the runtime as it runs by default (GPULOOM_YIELD_ANSWERS): a dropped request's "
                        "answer (0.01 ms of --host-drop-ms) yields to launches, each waiting behind at most 0.2 ms of "
                        "answers; it matters only where a per-drop host time is set (--host-drop-ms, the presets). "
                        "--no-yield-answers: as a runtime run with GPULOOM_YIELD_ANSWERS=0, or before the sixty-fifth "
                        "session (default: on)")
    p.add_argument("--queue-limit", type=int, default=None, metavar="N",
                   help="refuse a request while N of its model's are queued or running, as gpuloom serve and "
                        "gpuloom bench do (their default: 1024); default: refuse none")
    p.add_argument("--slowdowns", metavar="PATH", default=None,
                   help="simulate a GPU on which each model runs this much slower than its profile, while the "
                        "policies plan with the profiles: a JSON {model: factor} or a gpuloom bench report whose "
                        "dstack points measured them (on the H200, 1.00-1.6x on dstack's partitions)")
    p.add_argument("--out", metavar="DIR", default=None, help="write <name>.simulate.json and <name>.simulate.png here")


def preset_model(name: str):
    """The :class:`~gpuloom.runtime.sim.ContentionModel` a ``--contention`` preset names."""
    from gpuloom.runtime.sim import FITTED_PRESETS, ContentionModel

    return FITTED_PRESETS.get(name, ContentionModel)()


def contention_model(args: argparse.Namespace):
    """``--contention``'s model with every parameter flag given on the command line in place of its own."""
    import dataclasses

    from gpuloom.bench.resimulate import as_the_runtime_ran

    base = preset_model(args.contention)
    given = {k: getattr(args, k) for k in CONTENTION_FLAGS if getattr(args, k, None) is not None}
    model = dataclasses.replace(base, **given)
    return as_the_runtime_ran(model, {"GPULOOM_YIELD_ANSWERS": "1" if getattr(args, "yield_answers", True) else "0"})


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from gpuloom.bench.experiment import fluid_bound, simulate, sweep_rate
    from gpuloom.bench.plots import comparison_chart
    from gpuloom.bench.workload import WorkloadError, load_workload, validate
    from gpuloom.bench.variants import parse_policy_spec
    from gpuloom.commands.output import (finite_json, open_profiles, out_dir_error, print_error, print_warning,
                                         table_console)
    from gpuloom.plan.slowdown import load_slowdowns, slowed
    from gpuloom.policy import make_policy, policy_names

    console = table_console(170)
    err = Console(stderr=True)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        print_error(err, f"--policy: expected comma-separated policy names, e.g. {DEFAULT_POLICIES}; found {args.policy!r}")
        return 2
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:  # each would run again and print a second row of the same numbers
        print_error(err, f"--policy: each policy once, found {', '.join(twice)} more than once")
        return 2
    if args.queue_limit is not None and args.queue_limit < 1:
        print_error(err, f"--queue-limit: expected a positive number of requests, got {args.queue_limit}")
        return 2
    problem = out_dir_error(args.out) if args.out else None
    if problem:
        print_error(err, problem)
        return 2
    try:
        specs = {p: parse_policy_spec(p) for p in policies}
    except ValueError as e:
        print_error(err, e)
        return 2
    unknown = [p for p, (name, _, _) in specs.items() if name not in policy_names()]
    if unknown:
        print_error(err, f"unknown policies {unknown}; known policies: {', '.join(policy_names())}")
        return 2
    for p, (name, options, service) in specs.items():
        if service:
            print_error(err, f"{p}: {sorted(service)} configure the real runtime's service (gpuloom bench), "
                             f"not the simulated GPU; give policy options only")
            return 2
        try:
            make_policy(name, **options)  # a bad option fails here, before any run
        except (TypeError, ValueError) as e:
            print_error(err, f"{p}: {e}")
            return 2
    try:
        workload = load_workload(args.workload)
        if args.scale != 1.0:
            workload = workload.scaled(args.scale)
        if args.duration is not None:
            workload = dataclasses.replace(workload, duration_s=float(args.duration))
        profiles, warnings = open_profiles(workload, profiles_dir=args.profiles, synthetic=args.synthetic)
        for w in warnings:
            print_warning(err, w)
        validate(workload, profiles)
        contention = contention_model(args)
        slow = load_slowdowns(args.slowdowns) if args.slowdowns else {}
        device = {m.name: slowed(profiles.get(m.name), slow.get(m.name, 1.0)) for m in workload.models} if slow else None
    except (WorkloadError, ValueError) as e:
        print_error(err, e)
        return 2

    t0 = time.perf_counter()
    runs = []
    for p in policies:  # a variant's metrics carry its spelling, so two dstacks stay apart in the table
        name, options, _ = specs[p]
        r = simulate(workload, profiles, name, contention=contention, options=options, device_profiles=device,
                     queue_limit=args.queue_limit)
        runs.append(dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, policy=p)))
    sweeps = {}
    if args.sweep_rate:
        sweep_w = dataclasses.replace(workload, duration_s=min(workload.duration_s, args.sweep_duration))
        for i, p in enumerate(policies, 1):
            name, options, _ = specs[p]
            t_p = time.perf_counter()
            with console.status(f"sweeping {escape(p)} ({i}/{len(policies)}) ..."):
                sweeps[p] = sweep_rate(sweep_w, profiles, name, target=args.target, contention=contention,
                                       options=options, device_profiles=device, queue_limit=args.queue_limit)
            # a line per policy: the spinner shows nothing where the output goes to a pipe or a log
            err.print(f"swept {escape(p)} ({i}/{len(policies)}): highest load x{sweeps[p].max_factor:.3g} in "
                      f"{time.perf_counter() - t_p:.1f} s")
    bound = fluid_bound(workload, device or profiles, knee_eps=contention.knee_eps) if args.sweep_rate else None
    elapsed = time.perf_counter() - t0

    by = {r.metrics.policy: r.metrics for r in runs}
    ref = by.get("dstack")
    ideal = by.get("ideal")
    name = Path(args.workload).stem
    t = Table(
        title=f"{escape(name)}: {workload.total_rate():.0f} req/s over {workload.duration_s:g} s, "
        f"{len(workload.models)} models, simulated (contention: demand_fraction {contention.demand_fraction:g}, "
        f"efficiency {contention.efficiency:g}, interference {contention.interference:g}, batch overhead "
        f"{contention.batch_overhead_ms:g} ms"
        f"{f' + {contention.hold_per_ms:g} per GPU ms' if contention.hold_per_ms else ''}"
        f"{f', spread {contention.hold_spread:g}' if contention.hold_spread else ''}"
        f"{f', host launch {contention.host_launch_ms:g} ms' if contention.host_launch_ms else ''}"
        f"{f', host per drop {contention.host_drop_ms:g} ms' if contention.host_drop_ms else ''}"
        f"{'; models slowed as measured' if slow else ''})",
        title_justify="left",
    )
    cols = ["policy"]
    if sweeps:
        cols += [f"max load @{args.target:.0%}", "max req/s", "vs dstack", "vs ideal"]
    cols += ["SLO att.", "goodput/s", "vs dstack", "vs ideal", "p50 ms", "p99 ms", "drops", "SM util", "fairness"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}" if b else "-"

    for r in runs:
        m = r.metrics
        row = [escape(m.policy)]
        if sweeps:
            s = sweeps[m.policy]
            row += [f"{s.max_factor:.2f}x", f"{s.max_rps:.0f}", ratio(s.max_factor, sweeps["dstack"].max_factor if "dstack" in sweeps else None),
                    ratio(s.max_factor, sweeps["ideal"].max_factor if "ideal" in sweeps else None)]
        row += [
            f"{m.slo_attainment:.2%}", f"{m.goodput_rps:.0f}", ratio(m.goodput_rps, ref.goodput_rps if ref else None),
            ratio(m.goodput_rps, ideal.goodput_rps if ideal else None), f"{m.p50_ms:.1f}", f"{m.p99_ms:.1f}",
            str(m.dropped), f"{m.sm_utilization:.0%}", f"{m.fairness:.3f}",
        ]
        t.add_row(*row)
    console.print(t)
    if bound is not None:
        line = f"fluid capacity bound (gpuloom.bench.experiment.fluid_bound): {bound:.2f}x ({workload.total_rate() * bound:.0f} req/s)"
        if "dstack" in sweeps:
            line += f"; dstack reaches {sweeps['dstack'].max_factor / bound:.0%} of it"
        console.print(line)
    console.print(f"[dim]simulated in {elapsed:.1f} s[/]")

    if args.out:
        out = Path(args.out)
        data = {
            "schema": "gpuloom.simulate/1",
            "workload": str(args.workload),
            "workload_spec": workload.to_dict(),  # the rates actually simulated (after --scale/--duration)
            "scale": args.scale,
            "duration_s": workload.duration_s,
            "profiles": "synthetic" if (args.synthetic or any("SYNTHETIC" in w for w in warnings)) else (args.profiles or f"builtin:{workload.gpu}"),
            "sweep_duration_s": min(workload.duration_s, args.sweep_duration) if args.sweep_rate else None,
            "contention": dataclasses.asdict(contention), "contention_preset": args.contention,
            "queue_limit": args.queue_limit,
            "slowdowns": {"path": args.slowdowns, "factors": slow} if slow else None,
            "runs": [{"policy_config": r.policy, "metrics": r.metrics.to_json(), "wall_s": r.wall_s} for r in runs],
            "fluid_bound": bound,
            "sweep": {p: {"target": s.target, "max_factor": s.max_factor, "max_rps": s.max_rps, "points": s.points,
                          "at_max": s.at_max.to_json() if s.at_max else None} for p, s in sweeps.items()},
        }
        jpath = out / f"{name}.simulate.json"
        try:
            out.mkdir(parents=True, exist_ok=True)
            jpath.write_text(finite_json(data, indent=1) + "\n")  # null, not NaN: a run that served nothing
            ppath = comparison_chart([r.metrics for r in runs], out / f"{name}.simulate.png",
                                     sweep={p: s.max_factor for p, s in sweeps.items()} or None,
                                     title=f"{name} (simulated)")
        except OSError as e:
            print_error(err, f"cannot write into --out {args.out}: {e}")
            return 2
        console.print(f"wrote {escape(str(jpath))} and {escape(str(ppath))}")
    return 0
