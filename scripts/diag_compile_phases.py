#!/usr/bin/env python
"""Where a model's compile time goes: torch.export's trace, its functionalization, the rest.

Why: a server's start is mostly its models' compiles (mobilenet_v3_small 10-15 s on the H200's
host, run 119), and run 119's cProfile showed torch.export's tracing under a symbolic batch size
on top. ``gpuloom.compile`` exports in two steps (``dag._export``): ``torch.export.export`` (the
training IR) and ``run_decompositions({})`` (functional ATen). This times the two steps apart, then
the whole ``gpuloom.compile`` (its export again, the DAG, the plan, the captures on a GPU), per
model, and prints one JSON line per model. A cache can only skip what it can key safely: the second
step is a function of the first's graph, the first is a function of the user's code. On a GPU it
also splits the captures' time (warm-up runs, where cuDNN autotunes; captures; timing replays of
``streams="auto"``) and compiles the model a second time on the same thread, where cuDNN's
autotuning is cached (``--service``: the options the service compiles with: NCHW, unfused). Both
compiles use the graph cache (``graph_cache``; ``GPULOOM_GRAPH_CACHE=off`` for neither): the second
takes its functional graph from there.

    PYTHONPATH=. python3 scripts/diag_compile_phases.py --models mobilenet_v3_small:64,resnet50,efficientnet_b0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet_v3_small:64,resnet50,efficientnet_b0",
                    help="torchvision names, each with ':SIZE' for its input's height and width (default 224)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    ap.add_argument("--cudnn", choices=("autotune", "heuristics"), default="autotune",
                    help="heuristics: the captures pick cuDNN's algorithms without timing them (capture.cudnn_heuristics)")
    ap.add_argument("--service", action="store_true",
                    help="compile as the service does (channels_last=False, fuse_convolutions=False)")
    a = ap.parse_args(argv)
    import torch
    import torchvision

    import gpuloom
    from gpuloom.engine import dag

    from gpuloom.engine import capture, graph_cache

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    warnings.simplefilter("ignore")
    spent = {"warmup_s": 0.0, "capture_s": 0.0, "timing_s": 0.0}
    real_capture_one, real_time_replays = capture._capture_one, capture.time_replays

    def capture_one(executor, streams, static_in, pool, warmup, **kw):  # warm-ups, then the capture
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            for _ in range(warmup):
                executor.run(static_in, streams)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = real_capture_one(executor, streams, static_in, pool, 0, **kw)
        spent["warmup_s"] += t1 - t0
        spent["capture_s"] += time.perf_counter() - t1
        return out

    def time_replays(*args, **kw):
        t0 = time.perf_counter()
        out = real_time_replays(*args, **kw)
        spent["timing_s"] += time.perf_counter() - t0
        return out

    if device == "cuda":
        capture._capture_one, capture.time_replays = capture_one, time_replays
    options = {"channels_last": False, "fuse_convolutions": False} if a.service else {}
    for item in a.models.split(","):
        name, _, size = item.partition(":")
        side = int(size or 224)
        model = getattr(torchvision.models, name)(weights=None).eval().to(device)
        x = torch.randn(1, 3, side, side, device=device)
        inputs = (dag.with_batch(x, 2),)
        batch = torch.export.Dim("batch", min=1, max=max(2, a.max_batch))
        t0 = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(model, inputs, dynamic_shapes=({0: batch},))
            t1 = time.perf_counter()
            ep.run_decompositions({})
        t2 = time.perf_counter()
        row = {"model": name, "side": side, "device": device, "torch": torch.__version__,
               "options": options or "default", "cudnn": a.cudnn, "export_s": round(t1 - t0, 3), "decompose_s": round(t2 - t1, 3)}
        for attempt in ("compile", "again"):  # the second: cuDNN's autotuning cached on this thread
            spent.update(dict.fromkeys(spent, 0.0))
            hits = graph_cache.Stats.hits
            t3 = time.perf_counter()
            with capture.cudnn_heuristics() if a.cudnn == "heuristics" else contextlib.nullcontext():
                cm = gpuloom.compile(model, (x,), max_batch=a.max_batch, device=device, **options)
            t4 = time.perf_counter()
            row[f"{attempt}_s"] = round(t4 - t3, 3)
            row[f"{attempt}_graph_from_cache"] = graph_cache.Stats.hits > hits
            if device == "cuda":
                row[attempt] = {k: round(v, 3) for k, v in spent.items()} | {"kept": dict(cm.stream_choice)}
            del cm
        row["compile_minus_export_s"] = round(row["compile_s"] - (t2 - t0), 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
