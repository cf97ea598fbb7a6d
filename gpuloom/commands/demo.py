"""``gpuloom demo``: compile a few torchvision models and compare with eager (the default job)."""

from __future__ import annotations

import argparse

from .argtypes import int_between

NAME = "demo"
HELP = "compile a few torchvision models; print eager vs compiled latency and the stream plans"

DEFAULT_MODELS = ("resnet18", "googlenet", "mobilenet_v3_small")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), help="torchvision model names")
    p.add_argument("--batch", type=int_between(1, None, "a batch size"), default=1, help="batch size to time (default 1)")
    p.add_argument("--size", type=int_between(1, None, "a resolution in pixels"), default=None,
                   help="input resolution (default 224 on GPU, 112 on CPU)")
    p.add_argument("--iters", type=int_between(1, None, "a number of iterations"), default=None,
                   help="timed iterations (default 100 on GPU, 5 on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--draw", metavar="DIR", default=None, help="write each stream plan as a PNG into DIR")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    import torchvision
    from rich.markup import escape
    from rich.table import Table

    import gpuloom
    from gpuloom.commands.output import out_dir_error, print_error, table_console
    from gpuloom.engine.dag import CaptureError
    from gpuloom.gpu.timing import median_ms

    console = table_console(120)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        print_error(console, f"--device: expected cuda, cuda:N or cpu, found {args.device!r}")
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print_error(console, f"--device {args.device}: no CUDA GPU here (torch.cuda.is_available() is False); "
                             f"--device cpu runs the CPU path")
        return 2
    problem = out_dir_error(args.draw, "--draw") if args.draw else None
    if problem:
        print_error(console, problem)
        return 2
    known = set(torchvision.models.list_models(module=torchvision.models))  # classification builders
    for name in args.models:  # before any compile: "Weights", an attribute but no model, was a TypeError
        if name not in known:
            print_error(console, f"unknown torchvision model {name!r}; torchvision.models.list_models("
                                 f"module=torchvision.models) names the {len(known)} known")
            return 2
    on_gpu = device.type == "cuda"
    if not on_gpu:
        console.print("[yellow]No CUDA GPU here: running the CPU path (the operator DAG in stream-plan "
                      "order, no CUDA graphs). Latencies are CPU latencies.[/]")
    size = args.size if args.size is not None else (224 if on_gpu else 112)
    iters = args.iters if args.iters is not None else (100 if on_gpu else 5)

    def timed(fn, x) -> float:
        return median_ms(lambda: fn(x), warmup=20 if on_gpu else 3, iters=iters, cuda=on_gpu)

    table = Table(title=f"gpuloom demo on {torch.cuda.get_device_name(device) if on_gpu else 'CPU'} "
                        f"(batch {args.batch}, {size}x{size}, median of {iters})")
    table.add_column("model", no_wrap=True)
    for col in ("ops", "streams", "syncs", "kept", "eager ms", "gpuloom ms", "speedup", "compile s"):
        table.add_column(col, justify="right")
    cached_any = False
    for name in args.models:
        factory = getattr(torchvision.models, name)
        kwargs = {"weights": None}
        if name in ("googlenet", "inception_v3"):
            kwargs.update(aux_logits=False, init_weights=False)
        model = factory(**kwargs).eval().to(device)
        x = torch.randn(args.batch, 3, size, size, device=device)
        with console.status(f"compiling {name} ..."):
            try:
                cm = gpuloom.compile(model, (x,), max_batch=max(args.batch, 1), streams="auto")
            except CaptureError as e:
                print_error(console, f"{name}: {e}")
                continue
        with torch.no_grad():
            eager = timed(model, x)
            ours = timed(cm, x)
        # what streams="auto" kept for this batch's bucket: single / multi / forward, "_cl" for NHWC
        kept = cm.stream_choice.get(cm.bucket_for(args.batch), "-") if on_gpu else "-"
        table.add_row(name, str(len(cm.graph.ops)), str(cm.plan.num_streams), str(cm.plan.num_syncs), kept,
                      f"{eager:.2f}", f"{ours:.2f}", f"{eager / ours:.2f}x",
                      f"{cm.compile_seconds:.1f}" + (" *" if cm.graph.graph_from_cache else ""))
        cached_any = cached_any or cm.graph.graph_from_cache
        console.print(f"[bold]{name}[/]: {escape(repr(cm))}")
        console.print(str(cm.plan).splitlines()[0], markup=False)
        if args.draw:
            Path(args.draw).mkdir(parents=True, exist_ok=True)
            cm.plan.draw(Path(args.draw) / f"{name}_plan.png")
    if cached_any:
        from gpuloom.engine.graph_cache import cache_dir

        table.caption = f"* export's functional graph from the graph cache ({cache_dir()}; GPULOOM_GRAPH_CACHE=0: none)"
    console.print(table)
    return 0
