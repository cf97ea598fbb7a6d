#!/usr/bin/env python
"""What cuDNN's autotuning costs a compile, and what it buys: compile time and replay latency per
bucket with the autotuner (``cudnn.benchmark``, PyTorch's default limit of 10 algorithms), with a
limit of ``--limit`` algorithms, and with cuDNN's heuristics alone (``capture.cudnn_heuristics``).

Why: run 121 split a service-style compile on the H200 (NCHW, unfused, buckets 1-8): the capture
warm-ups, where cuDNN autotunes every convolution at every bucket, took 11.2 s of mobilenet_v3_small's
18.5 s (resnet50 6.2 of 12.1, efficientnet_b0 8.3 of 15.2); a second compile on the same thread,
autotuning cached, 0.1-0.3 s. PyTorch keeps that cache per thread and per process only.

Each (model, mode) compiles on a fresh thread (an empty autotuning cache), modes in the order
A B C C B A, the graph cache warm (filled by a first compile) so that export costs the same in every
row. Latency: the median of 200 replays of each bucket's kept graph, CUDA events. One JSON line per
compile. Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_autotune.py --models mobilenet_v3_small:64,resnet50
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet_v3_small:64,resnet50,efficientnet_b0,mobilenet_v2")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--limit", type=int, default=1, help="the limited mode's cudnn.benchmark_limit")
    ap.add_argument("--modes", default="autotune,limited,heuristics",
                    help="comma-separated, run in this order and then reversed")
    ap.add_argument("--fill", choices=("heuristics", "none"), default="heuristics",
                    help="a first compile of each model before the modes (printed as round -1): with cuDNN's "
                         "heuristics (it fills the graph cache, so that export costs the same in every row), or none")
    a = ap.parse_args(argv)
    import torch
    import torchvision

    import gpuloom
    from gpuloom.engine import capture

    warnings.simplefilter("ignore")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def compile_in_thread(model, x, mode):
        box = {}

        def run():
            saved = torch.backends.cudnn.benchmark_limit
            try:
                if mode == "limited":
                    torch.backends.cudnn.benchmark_limit = a.limit
                t0 = time.perf_counter()
                if mode == "heuristics":
                    with capture.cudnn_heuristics():
                        cm = gpuloom.compile(model, (x,), max_batch=a.max_batch, channels_last=False,
                                             fuse_convolutions=False)
                else:
                    cm = gpuloom.compile(model, (x,), max_batch=a.max_batch, channels_last=False,
                                         fuse_convolutions=False)
                box["seconds"] = time.perf_counter() - t0
                box["cm"] = cm
            except BaseException as e:  # noqa: BLE001 - reported in the row
                box["error"] = f"{type(e).__name__}: {e}"
            finally:
                torch.backends.cudnn.benchmark_limit = saved

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return box

    modes = a.modes.split(",")
    order = modes + modes[::-1]
    for item in a.models.split(","):
        name, _, size = item.partition(":")
        side = int(size or 224)
        model = getattr(torchvision.models, name)(weights=None).eval().cuda()
        x = torch.randn(1, 3, side, side, device="cuda")
        runs = ([(-1, "heuristics")] if a.fill == "heuristics" else []) + list(enumerate(order))
        for rep, mode in runs:
            box = compile_in_thread(model, x, mode)
            row = {"model": name, "side": side, "mode": mode, "round": rep, "limit": a.limit if mode == "limited" else None}
            if "error" in box:
                row["error"] = box["error"]
            else:
                cm = box["cm"]
                gs = cm._graphs
                row["compile_s"] = round(box["seconds"], 3)
                row["kept"] = {b: e.kind for b, e in sorted(gs.buckets.items())}
                row["latency_ms"] = {b: round(capture.time_replays(e.graph, gs.streams[0], warmup=20, iters=200), 4)
                                     for b, e in sorted(gs.buckets.items())}
                del cm, gs
            box.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
