"""``gpuloom demo``: compile a few torchvision models and compare with eager (the default job)."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "compile a few torchvision models; print eager vs compiled latency and the stream plans"

DEFAULT_MODELS = ("resnet18", "googlenet", "mobilenet_v3_small")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), help="torchvision model names")
    p.add_argument("--batch", type=int, default=1, help="batch size to time (default 1)")
    p.add_argument("--size", type=int, default=None, help="input resolution (default 224 on GPU, 112 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 100 on GPU, 5 on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--draw", metavar="DIR", default=None, help="write each stream plan as a PNG into DIR")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    import torchvision
    from rich.table import Table

    import gpuloom
    from gpuloom.commands.output import table_console
    from gpuloom.engine.dag import CaptureError
    from gpuloom.gpu.timing import median_ms

    console = table_console(120)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if not on_gpu:
        console.print("[yellow]No CUDA GPU here: running the CPU path (the operator DAG in stream-plan "
                      "order, no CUDA graphs). Latencies are CPU latencies.[/]")
    size = args.size or (224 if on_gpu else 112)
    iters = args.iters or (100 if on_gpu else 5)

    def timed(fn, x) -> float:
        return median_ms(lambda: fn(x), warmup=20 if on_gpu else 3, iters=iters, cuda=on_gpu)

    table = Table(title=f"gpuloom demo on {torch.cuda.get_device_name(device) if on_gpu else 'CPU'} "
                        f"(batch {args.batch}, {size}x{size}, median of {iters})")
    table.add_column("model", no_wrap=True)
    for col in ("ops", "streams", "syncs", "kept", "eager ms", "gpuloom ms", "speedup", "compile s"):
        table.add_column(col, justify="right")
    cached_any = False
    for name in args.models:
        try:
            factory = getattr(torchvision.models, name)
        except AttributeError:
            console.print(f"[red]unknown torchvision model {name!r}[/]")
            return 2
        kwargs = {"weights": None}
        if name in ("googlenet", "inception_v3"):
            kwargs.update(aux_logits=False, init_weights=False)
        model = factory(**kwargs).eval().to(device)
        x = torch.randn(args.batch, 3, size, size, device=device)
        with console.status(f"compiling {name} ..."):
            try:
                cm = gpuloom.compile(model, (x,), max_batch=max(args.batch, 1), streams="auto")
            except CaptureError as e:
                console.print(f"[red]{name}: {e}[/]")
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
        console.print(f"[bold]{name}[/]: {cm!r}")
        console.print(str(cm.plan).splitlines()[0])
        if args.draw:
            Path(args.draw).mkdir(parents=True, exist_ok=True)
            cm.plan.draw(Path(args.draw) / f"{name}_plan.png")
    if cached_any:
        from gpuloom.engine.graph_cache import cache_dir

        table.caption = f"* export's functional graph from the graph cache ({cache_dir()}; GPULOOM_GRAPH_CACHE=0: none)"
    console.print(table)
    return 0
