"""``gpuloom bench``: drive the real runtime with an open-loop load generator; sweep the rate."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from ..bench.variants import DEVICE_KEYS, SERVICE_KEYS, parse_policy_spec
from .argtypes import int_between, positive_number
from .output import print_error, print_warning
from .simulate import CONTENTION_PRESETS, _attainment, preset_model

NAME = "bench"
HELP = "end-to-end benchmark: serve a workload for real under each policy, find the highest load within the SLO"

DEFAULT_POLICIES = "dstack,triton,clipper,nexus,gslice,temporal"
DEFAULT_STEPS = 5  # --sweep's doubling and bisection steps


def _scales(text: str) -> list[float]:
    """argparse type: comma-separated load factors, each a positive finite number."""
    try:
        scales = [float(s) for s in text.split(",")]
    except ValueError:
        scales = []
    if not scales or not all(0 < s < math.inf for s in scales):
        raise argparse.ArgumentTypeError(f"expected comma-separated load factors > 0, e.g. 0.5,1,2; found {text!r}")
    return scales


def _device(text: str) -> str:
    """argparse type: a device the service runs on (``make_device_layer``'s spellings)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, found {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (.yaml/.json), e.g. examples/mix6.yaml")
    p.add_argument("--policy", default=DEFAULT_POLICIES,
                   help=f"comma-separated policies (default {DEFAULT_POLICIES}); a variant is NAME:KEY=VALUE[:...], "
                        f"e.g. dstack:lookahead_ms=0 (the service's launch-ahead) or dstack:replan=false (a policy "
                        f"option), reported under that spelling next to the plain policy. Service keys: "
                        f"{', '.join(SERVICE_KEYS)} (pinned_inputs=false: the load generator's inputs are plain "
                        f"arrays, copied at submit; by default they lie in page-locked memory and are launched in "
                        f"place, as the server's worker arenas are; arrivals=loop: the runtime's own thread "
                        f"submits the requests, as if the clients ran in other processes; cpus=0-1: the whole "
                        f"process on those CPUs while the variant runs, '+' for ',' as in cpus=0+4)")
    p.add_argument("--device", type=_device, default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--tiny", action="store_true",
                   help="serve small MLPs named like the workload's models (CPU smoke runs, CI)")
    p.add_argument("--max-batch", type=int_between(1, what="a batch size"), default=32,
                   help="max batch each model is compiled for (default 32)")
    p.add_argument("--duration", type=positive_number("seconds"), default=5.0,
                   help="seconds of arrivals per load point (default 5)")
    p.add_argument("--scale", type=_scales, default=None,
                   help="comma-separated load factors to measure (default 1 without --sweep)")
    p.add_argument("--sweep", action="store_true", help="find each policy's highest load factor at the target")
    p.add_argument("--target", type=_attainment, default=0.99, help="SLO attainment a load must keep (default 0.99)")
    p.add_argument("--steps", type=int_between(1, what="a number of steps"), default=None,
                   help=f"doubling and bisection steps of --sweep (default {DEFAULT_STEPS})")
    p.add_argument("--profiles", metavar="DIR", default=None,
                   help="profile directory (default: shipped H200 profiles on CUDA; crude ones measured at load "
                        "with --tiny)")
    p.add_argument("--engine", metavar="KEY=VALUE[,...]", default="",
                   help="engine options for every model, as a repository's keys: channels_last, fuse_convolutions, "
                        "split_gemms, fuse_epilogues (e.g. fuse_epilogues=true); a model whose graph they change "
                        "is profiled at its load (once; cached)")
    p.add_argument("--queue-limit", type=int_between(1, what="a number of requests"), default=1024,
                   help="per-model queue bound (default 1024)")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="seconds of unmeasured load before each policy's first point, at most --duration "
                        "(default 2; 0: none): on the H200 the first policy of a process lost to itself run later")
    p.add_argument("--no-simulate", action="store_true",
                   help="skip running each point through the simulator too (simulated vs measured goodput, p99; "
                        "sim and sim_host)")
    p.add_argument("--contention", choices=CONTENTION_PRESETS, default=None,
                   help="the simulated GPU each point is run through: h200 (fitted to the H200 bench runs, as "
                        "gpuloom simulate --contention h200; the default on CUDA), h100-fast-host (the same with a "
                        "0.35 ms hold and 0.04 ms of host per request dropped) or plain (the knee model; the default "
                        "on the CPU and with --tiny). Once every policy ran, each point is simulated again with "
                        "this host's own hold, read at the lowest load held (sim_host; the report's "
                        "host_calibration says how many higher loads each column put within 10%%)")
    p.add_argument("--share-device", action="store_true",
                   help="one device layer for every policy with the same device options (raw_launch, workqueues, "
                        "lane_streams, outputs): a layout captured for one policy is served to the next without "
                        "capturing it again (captures are never part of a point; this saves device time)")
    p.add_argument("--out", metavar="FILE", default=None, help="write the JSON report here")


def check_out(path: str) -> None:
    """ValueError unless ``path`` can be the report's file: not a directory, and no file where a
    directory above it should be (missing directories are made when the report is written)."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--out {path!r} is a directory; give the report's file, e.g. {str(out / 'bench.json')!r}")
    above = next((d for d in out.parents if d.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"--out {path!r}: {str(above)!r} is a file, not a directory")


def check_cpus(text: object) -> set[int]:
    """A variant's ``cpus=`` as a set of CPU numbers, or ValueError unless each is one this process
    may run on (pinning it to others fails only when the variant's turn comes)."""
    from gpuloom.runtime.affinity import parse_cpus

    cpus = parse_cpus(str(text))
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if not cpus <= usable:
        raise ValueError(f"cpus={text}: CPU {', '.join(map(str, sorted(cpus - usable)))} not available; this "
                         f"process may run on CPUs {', '.join(map(str, sorted(usable)))}")
    return cpus


def check_service_options(opts: dict) -> None:
    """ValueError (naming the key) unless each of a variant's service keys has a value the service and
    the load generator take, by their own checks: the service runs them only when the variant's turn
    comes, after every model was compiled."""
    from gpuloom.bench.e2e import check_arrivals
    from gpuloom.gpu.partition import check_workqueues
    from gpuloom.runtime.cuda_lane import check_lane_streams, check_outputs
    from gpuloom.runtime.exec_backend import check_complete_on, check_launch_on, check_lookahead
    from gpuloom.runtime.gilswitch import check_interval_ms

    for key in ("tune_gc", "early_answer", "raw_launch", "pinned_inputs"):
        if key in opts and not isinstance(opts[key], bool):
            raise ValueError(f"{key}: expected true or false, found {opts[key]!r}")
    v = opts.get("lookahead_ms", 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)):  # check_lookahead compares it with 0
        raise ValueError(f"lookahead_ms: expected a number of ms >= 0, found {v!r}")
    check_lookahead(v)
    if opts.get("switch_interval_ms") is not None:  # None: the interpreter's own
        check_interval_ms(opts["switch_interval_ms"])
    if opts.get("launch_on", "auto") != "auto":
        check_launch_on(opts["launch_on"])
    checks = {"workqueues": check_workqueues, "lane_streams": check_lane_streams, "complete_on": check_complete_on,
              "arrivals": check_arrivals, "cpus": check_cpus}
    for key, check in checks.items():
        if key in opts:
            check(opts[key])
    check_outputs(opts.get("outputs", "copies"), opts.get("raw_launch", True))


def max_load_cells(r) -> tuple[str, str]:
    """The table's "max load x" and "max req/s" of a policy's result ``r``: "none" where no load held
    the target, "at least" where no point above its highest held load missed (a lower bound)."""
    if r.max_scale <= 0:
        return "none", "-"
    least = "" if r.max_scale_bounded else "at least "
    return f"{least}{r.max_scale:.4g}", f"{least}{r.max_load_rps:.0f}"


def attainment_cell(point) -> str:
    """A point's SLO attainment for the table: "-" where no request was submitted (the metric reads 1.0
    there: nothing missed, but nothing was served either)."""
    return f"{point.slo_attainment:.3f}" if sum(m.submitted for m in point.models) else "-"


def summary_line(r: dict, target: float, name: str = "dstack") -> str:
    """The bench's last lines: dstack (or the variant ``name``) against the best baseline, at its
    highest load within ``target`` and in goodput at each load both measured."""
    ratio, bound = r["load_ratio"], "" if r["dstack_complete"] else f" (at least: {name}'s sweep was cut short)"
    if ratio is not None:
        head = f"highest load at {target:.0%}: {ratio:.2f}x ({r['baseline']}){bound}"
    elif r.get("dstack_max_scale"):
        head = f"{name} held {target:.0%} up to x{r['dstack_max_scale']:g}{bound}, no baseline at any load measured"
    else:
        head = f"no policy held {target:.0%} at any load measured"
    goodput = [f"x{g['scale']:g} " + (f"{g['ratio']:.2f}x" if g["ratio"] is not None else "n/a (baseline served none)")
               + f" ({g['baseline']})" for g in r.get("goodput_by_scale", ())]
    return f"{name} / best baseline: " + head + ("; goodput " + ", ".join(goodput) if goodput else "")


def sim_contention(preset: str | None, device: str, tiny: bool):
    """(preset name, ``ContentionModel``) each point is simulated with: ``preset``, else ``h200`` for
    real models on CUDA (the shipped profiles and the fit are the H200's) and ``plain`` otherwise."""
    name = preset or ("h200" if device.startswith("cuda") and not tiny else "plain")
    return name, preset_model(name)


def dstack_flag_defaults() -> dict:
    """What plain ``dstack``'s grow, shed and adapt were in this run, read off its constructor (a
    report's re-simulation takes them from here: a copy written by hand could drift)."""
    import inspect

    from gpuloom.policy.dstack import DStackPolicy

    d = {k: p.default for k, p in inspect.signature(DStackPolicy).parameters.items()}
    return {"dstack_grow_default": "auto" if d["grow"] is None else d["grow"], "dstack_shed_default": d["shed"],
            "dstack_adapt_default": d["adapt"]}


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import sys
    import time

    from rich.console import Console
    from rich.table import Table

    from gpuloom.engine.options import parse_engine_options
    from gpuloom.gpu.connections import connections_in_effect
    from gpuloom.policy.dstack import DEFAULT_HOLD_MS, DEFAULT_LANES, DEFAULT_MIN_SMS, DEFAULT_REMAINDER
    from gpuloom.bench.e2e import (bench_policy, build_models, resolve_device_and_profiles,
                                   save_json, to_json)
    from gpuloom.bench.labels import run_labels
    from gpuloom.bench.workload import WorkloadError, load_workload
    from gpuloom.commands.output import table_console
    from gpuloom.policy import make_policy, policy_names
    from gpuloom.runtime.affinity import parse_cpus, pinned

    console = Console(stderr=True)
    if args.steps is not None and not args.sweep:
        print_error(console, "--steps counts the rate sweep's doubling and bisection steps; it needs --sweep")
        return 2
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if args.out:
        try:
            check_out(args.out)
        except ValueError as e:
            print_error(console, e)
            return 2
    try:
        workload = load_workload(args.workload)
    except (OSError, WorkloadError) as e:
        print_error(console, e)
        return 2
    if not args.warmup >= 0:
        print_error(console, f"--warmup is seconds >= 0 (0: none), found {args.warmup}")
        return 2
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    try:
        specs = {p: parse_policy_spec(p) for p in policies}
    except ValueError as e:
        print_error(console, e)
        return 2
    bad = [p for p, (name, _, _) in specs.items() if name not in policy_names() or name == "ideal"]
    if bad:
        print_error(console, f"unknown or simulation-only policies {bad}; "
                             f"known: {[p for p in policy_names() if p != 'ideal']}")
        return 2
    for p, (name, opts, service_opts) in specs.items():
        try:
            make_policy(name, **opts)
            check_service_options(service_opts)
        except (TypeError, ValueError) as e:
            print_error(console, f"policy variant {p!r}: {e}")
            return 2
    scales = args.scale
    try:
        engine = parse_engine_options(args.engine)
    except ValueError as e:
        print_error(console, f"--engine: {e}")
        return 2
    import torch

    try:
        device, profiles, warns = resolve_device_and_profiles(workload, device=args.device,
                                                              profiles_dir=args.profiles, tiny=args.tiny)
    except ValueError as e:
        print_error(console, e)
        return 2
    for w in warns:
        print_warning(console, w)
    from gpuloom.bench.host_hold import hold_line, host_hold
    from gpuloom.bench.machine import describe_machine, gpuloom_settings, summary
    from gpuloom.bench.resimulate import as_the_runtime_ran

    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    machine = {"start": describe_machine(sync)}  # which host, how fast: figures from two machines differ
    console.print(summary(machine["start"]))
    t0 = time.monotonic()
    models = build_models(workload, tiny=args.tiny, device=device, max_batch=args.max_batch,
                          progress=lambda s: console.print(s), engine_options=engine)
    sim_preset, contention = sim_contention(args.contention, device, args.tiny)
    contention = as_the_runtime_ran(contention, gpuloom_settings())  # the runtime's options it simulates
    results = []

    def write_report() -> dict:
        meta = {"torch": torch.__version__, "tiny": args.tiny, "max_batch": args.max_batch, "engine": engine,
                "duration_s": args.duration, "warmup_s": min(args.warmup, args.duration),
                "seconds": round(time.monotonic() - t0, 1), "argv": sys.argv[1:],
                "queue_limit": args.queue_limit,  # the service's per-model bound, simulated too
                # what plain "dstack" meant in this run (reports before the key planned down to 8 SMs: 0)
                "dstack_min_sms_default": DEFAULT_MIN_SMS,
                "dstack_remainder_default": DEFAULT_REMAINDER,
                "dstack_lanes_default": DEFAULT_LANES, **dstack_flag_defaults(),
                # the hold it planned on a real device (reports before the key planned none: 0)
                "dstack_hold_default": DEFAULT_HOLD_MS,
                # hardware queues the driver opens for the process (8 by default; gpuloom asks for 32)
                **connections_in_effect().as_meta(),
                # the process-wide GPULOOM_* settings (an A/B's leg), empty where none is set
                "gpuloom_settings": gpuloom_settings(),
                # the host's CPU and speed probes at the start (and the end, once every policy ran)
                "machine": dict(machine),
                # the simulated GPU each point's "sim" comes from
                "sim_contention": {"preset": sim_preset, **dataclasses.asdict(contention)}}
        if device.startswith("cuda"):
            meta["gpu"] = torch.cuda.get_device_name(0)
        rep = to_json(workload, results, device=device, target=args.target, meta=meta)
        hold = host_hold(rep, args.target)
        if hold is not None:  # which kind of host this was, for the simulated column (host_hold.py)
            rep["host_lane_hold"] = hold
        if args.out:  # after every point: a run cut short keeps what it measured
            save_json(args.out, rep)
        return rep

    def save_partial(partial) -> None:  # this policy's points so far, next to the finished ones
        results.append(partial)
        try:
            write_report()
        finally:
            results.pop()

    layers: dict[tuple, object] = {}  # --share-device: device options -> the layer every such policy serves on

    def shared_layer(service_opts: dict):
        """The layer for these device options (spelled out or left to their defaults alike). The
        other layers give back their cached builds first: a policy never serves beside another
        layer's graphs and green contexts, and within a layer's own memory budget."""
        import inspect

        from gpuloom.runtime.device import make_device_layer
        from gpuloom.runtime.service import InferenceService

        defaults = inspect.signature(InferenceService).parameters  # what a service would make its layer with
        opts = {k: service_opts.get(k, defaults[k].default) for k in DEVICE_KEYS}
        key = tuple(sorted((k, repr(v)) for k, v in opts.items()))
        for other_key, other in layers.items():
            if other_key != key:
                other.trim()
        if key not in layers:
            layers[key] = make_device_layer(device, **opts)
        return layers[key]

    try:
        for pol, label in zip(policies, run_labels(policies)):
            name, opts, service_opts = specs[pol]
            service_opts = dict(service_opts)
            cpus = service_opts.pop("cpus", None)  # the whole process's CPUs while this variant runs
            layer = shared_layer(service_opts) if args.share_device else None
            with pinned(parse_cpus(str(cpus)) if cpus is not None else None):
                results.append(bench_policy(workload, name, models, device=device, profiles=profiles,
                                            duration_s=args.duration, scales=scales, sweep=args.sweep,
                                            target=args.target, steps=steps, queue_limit=args.queue_limit,
                                            simulate=not args.no_simulate, progress=lambda s: console.print(s),
                                            policy_options=opts or None, label=label, service_options=service_opts,
                                            on_point=save_partial if args.out else None,
                                            warmup_s=min(args.warmup, args.duration), device_layer=layer,
                                            contention=contention))
            write_report()
    finally:
        for layer in layers.values():
            try:
                layer.close()
            except Exception as e:  # noqa: BLE001 - close the others; the results are written already
                print_warning(console, f"closing a shared device layer: {e}")
    machine["end"] = describe_machine(sync)
    console.print(summary(machine["end"]) + " (at the end)")
    report = write_report()
    host_sim = None
    if not args.no_simulate:  # every point again with this host's own hold, measured at its lowest held load
        from gpuloom.bench.resimulate import add_host_resimulation
        from gpuloom.profile.store import ProfileStore

        try:
            host_sim = add_host_resimulation(report, ProfileStore.builtin("h200"), args.target)
        except Exception as e:  # noqa: BLE001 - the measurement and the preset's column stand without it
            print_warning(console, f"simulating the points with this host's hold: {type(e).__name__}: {e}")
        if host_sim is not None and args.out:
            save_json(args.out, report)

    table = Table(title=f"gpuloom bench {Path(args.workload).name} on {device}"
                        + (" (tiny models)" if args.tiny else ""),
                  caption=f"max load: the highest load factor held at >= {args.target:.0%} SLO attainment "
                          f"('at least': no load measured above it missed); the other columns: the highest load "
                          f"measured that held it ('at x'), or the highest measured where none did; sim: the "
                          f"simulated goodput's error there (--contention {sim_preset}), sim host: with this "
                          f"host's hold")

    def sim_error(policy: str, scale: float, key: str) -> str:
        """The simulated goodput's error at that point (``sim``: the preset; ``sim_host``: this host's hold)."""
        pts = report.get("policies", {}).get(policy, {}).get("points", [])
        err = next(((pt.get(key) or {}).get("goodput_error") for pt in pts if pt["scale"] == scale), None)
        return "-" if err is None else f"{err:+.1%}"

    for col in ("policy", "max load x", "max req/s", "at x", "goodput/s", "attain", "p50 ms", "p99 ms",
                "SM util", "idle(q)", "dispatch", "sim", "sim host"):
        # a variant's name in full (dstack:learn_holds=true:...): wrapped, never cut to "dsta…"
        table.add_column(col, justify="left" if col == "policy" else "right",
                         overflow="fold" if col == "policy" else "ellipsis")
    for r in results:
        last = max(r.points, key=lambda p: (p.ok(args.target), p.scale), default=None)
        if last is None:
            table.add_row(r.policy, "-", "-", "-", "-", "-", "-", "-", "-", "-", r.error[:30], "-", "-")
            continue
        name = f"{r.policy} (cut short)" if r.error else r.policy  # its max load is a lower bound
        table.add_row(name, *max_load_cells(r),
                      f"{last.scale:.4g}", f"{last.goodput_rps:.0f}",
                      attainment_cell(last), f"{last.p50_ms:.1f}", f"{last.p99_ms:.1f}",
                      f"{last.sm_utilization:.2f}", f"{last.gpu_idle_ratio:.2f}", f"{last.dispatch_overhead:.3f}",
                      sim_error(r.policy, last.scale, "sim"), sim_error(r.policy, last.scale, "sim_host"))
    out = table_console(160)  # a log or a pipe gets the width of a wide terminal, not rich's 80 columns
    out.print(table)
    for r in results:
        if r.error:
            print_error(console, r.error, label=f"{r.policy} stopped")
    if "dstack_vs_best_baseline" in report:
        out.print(summary_line(report["dstack_vs_best_baseline"], args.target))
    for name, r in report.get("variants_vs_best_baseline", {}).items():
        out.print(summary_line(r, args.target, name))
    if "host_lane_hold" in report and device.startswith("cuda") and not args.no_simulate:
        out.print(hold_line(report["host_lane_hold"], sim_preset))
    if host_sim is not None:
        from gpuloom.bench.resimulate import host_line

        out.print(host_line(host_sim, sim_preset))
    if args.out:
        console.print(f"wrote {args.out}")
    return 0 if not any(r.error for r in results) else 1


if __name__ == "__main__":  # ``python -m gpuloom.commands.bench ...`` (until the CLI lists the command)
    import sys

    from gpuloom.gpu.connections import prefer_all_connections

    prefer_all_connections()  # as the command line does, before CUDA starts
    _p = argparse.ArgumentParser(prog="gpuloom bench", description=HELP)
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
