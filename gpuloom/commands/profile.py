"""``gpuloom profile``: measure latency vs SM count for models, print the knee table, write JSON + PNG.

    gpuloom profile resnet50 inception_v3 --batch 1,2,4,8,16,32,64 --out out/profiles

Needs a CUDA GPU (it sweeps real SM partitions); on a machine without one it says so and points at
the shipped H200 profiles.
"""

from __future__ import annotations

import argparse

from ..engine.options import ENGINE_DEFAULTS  # torch-free: --help stays instant

NAME = "profile"
HELP = "measure latency vs SMs per batch (GPU), print the knee table, write JSON + PNG per model"


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 3x224x224, got {text!r}") from None


def _option(text: str) -> bool | str:
    """A command-line choice as gpuloom.compile takes it: "false" / "true" as bools, the rest as written
    (as the repository's YAML gives them)."""
    return {"false": False, "true": True}.get(text, text)


def _served(key: str) -> str:
    """A served model's default of engine option ``key`` as this command's choices spell it."""
    return str(ENGINE_DEFAULTS[key]).lower()


def fuse_epilogues(args: argparse.Namespace) -> bool:
    """``--fuse-epilogues`` as given, or as a served model compiles by default (gpuloom's kernels on;
    a plain graph of the eager model has none to turn on)."""
    if args.fuse_epilogues is None:
        return ENGINE_DEFAULTS["fuse_epilogues"] and args.runner != "graph"
    return bool(_option(args.fuse_epilogues))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", help="torchvision/timm names, bert_base, or module:factory")
    p.add_argument("--batch", type=_ints, default=(1, 2, 4, 8, 16, 32, 64), help="batch buckets (default 1..64)")
    p.add_argument("--sms", type=_ints, default=None, help="SM counts (default: 8, 16, ..., whole device)")
    p.add_argument("--eps", type=float, default=0.1, help="knee tolerance: within (1+eps) of the whole GPU")
    p.add_argument("--runner", choices=("auto", "engine", "graph"), default="auto",
                   help="engine: gpuloom.compile graphs; graph: single-stream CUDA graph of the eager model; "
                        "auto: engine, falling back to graph")
    p.add_argument("--input-shape", type=_shape, default=None, help="input shape without batch, e.g. 3x224x224")
    p.add_argument("--channels-last", choices=("false", "true", "auto"), default=_served("channels_last"),
                   help="compile as a served model with this channels_last would be (repository key "
                        "channels_last): true runs convolutions NHWC, auto times both layouts per bucket")
    p.add_argument("--fuse-convolutions", choices=("false", "true", "channels_last"),
                   default=_served("fuse_convolutions"),
                   help="compile as a served model with this fuse_convolutions would be (repository key "
                        "fuse_convolutions): channels_last fuses the NHWC graph's convolutions with their bias "
                        "and ReLU, true every graph's")
    p.add_argument("--split-gemms", choices=("false", "true"), default=_served("split_gemms"),
                   help="compile as a served model with this split_gemms would be (repository key split_gemms): "
                        "true splits float32 GEMMs' reduction where timed faster, on each partition")
    p.add_argument("--fuse-epilogues", choices=("false", "true"), default=None,
                   help="compile as a served model with this fuse_epilogues would be (repository key "
                        "fuse_epilogues): true runs each convolution's bias (+ add) + SiLU / sigmoid / ReLU6 "
                        "as one kernel, and each squeeze-excitation gate as two (default: true, as served; "
                        "false with --runner graph, which runs the model as written)")
    p.add_argument("--out", default="out/profiles", help="directory for <model>.json and <model>.png")
    p.add_argument("--store", default=None, help="also put the profiles into this ProfileStore directory")
    p.add_argument("--no-png", action="store_true", help="skip the plots")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from gpuloom.commands.output import table_console

    console = table_console(140)
    if args.fuse_convolutions == "channels_last" and args.channels_last == "false":
        console.print("[yellow]note[/yellow]: --fuse-convolutions channels_last fuses only a channels-last graph, "
                      "and --channels-last false makes none: this profile is unfused (as a served model with "
                      "these two keys would be)")
    if not torch.cuda.is_available():
        console.print("[red]gpuloom profile needs a CUDA GPU[/red]: it measures graph replays inside real SM "
                      "partitions, and torch.cuda.is_available() is False here. Profiles measured on an H200 "
                      "ship with gpuloom: gpuloom.profile.ProfileStore.builtin('h200').")
        return 2
    from ..gpu import PartitionError, device_facts
    from ..profile.profiler import check_sm_counts, load_model, profile_model, write_outputs
    from ..profile.store import ProfileStore

    store = ProfileStore(args.store) if args.store else None
    if args.sms:  # before any model is built: a size the device cannot carve is a usage error
        facts = device_facts(args.device)
        try:
            check_sm_counts(args.sms, facts.sm_count, facts.sm_granularity)
        except PartitionError as e:
            console.print(f"[red]error[/red]: --sms: {e}")
            return 2
    for name in args.models:
        try:
            spec = load_model(name, device=f"cuda:{args.device}", input_shape=args.input_shape)
        except (ValueError, TypeError) as e:  # an unknown name or a factory that returns no module
            console.print(f"[red]error[/red]: {e}")
            return 2
        prof_run = profile_model(spec, batches=args.batch, sms=args.sms, runner=args.runner, device=args.device,
                                 eps=args.eps, log=console.print,
                                 channels_last=_option(args.channels_last),
                                 fuse_convolutions=_option(args.fuse_convolutions),
                                 split_gemms=_option(args.split_gemms),
                                 fuse_epilogues=fuse_epilogues(args))
        paths = write_outputs(prof_run, args.out, eps=args.eps, png=not args.no_png)
        if store is not None:
            store.put(prof_run.profile)
        t = Table(title=f"{spec.name} ({prof_run.runner} graphs, {prof_run.seconds:.1f} s sweep)")
        for col in ("batch", "knee measured", "knee predicted", "latency at knee (ms)", "latency full (ms)"):
            t.add_column(col, justify="right")
        for r in prof_run.knee_rows(args.eps):
            t.add_row(str(r["batch"]), str(r["knee_measured"]), str(r["knee_predicted"] or "-"),
                      f"{r['latency_knee_ms']:.3f}", f"{r['latency_full_ms']:.3f}")
        console.print(t)
        console.print(f"wrote {', '.join(paths.values())}")
        del prof_run, spec
        torch.cuda.empty_cache()
    return 0
