#!/usr/bin/env python
"""How much device memory does a build of the CUDA device layer hold outside torch's allocator?

Why: a build's memory (``Lanes.memory_bytes``, what the graph-memory budget bounds) is the rise of
``torch.cuda.memory_reserved``: the graph pools and static buffers. The instantiated graphs (the
captured ones, and since the thirty-third session a launch graph per (model, bucket, slot)) are held
by the driver, which torch's allocator does not see. Is that memory per build, and how large?

Run 106 (H200, resnet50 + mobilenet_v2 + googlenet, buckets 1-8, 24 launch graphs): the free memory
fell 12 and 30 MiB beyond the reserved rise in the first build without and the first with launch
graphs, and 0 in the two builds after; none of it came back when the layer was closed. So it behaves
as memory grown once per process and kept (the driver's, by all signs), not a cost of each build: the
layer does not count it in a build (evicting one could not free it).

This compiles ``--models`` (NCHW, as served), then builds one shared lane over the whole GPU with
them, ``--rounds`` times, launch graphs off and on in turn (A B A B). Per build: the rise of
``memory_reserved``, the fall of the device's free memory, what the layer counted, how many launch
graphs it made; after the layer is closed and torch's cache emptied, how much of the free memory
came back (a leak check). Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_build_memory.py --models resnet50,mobilenet_v2,googlenet --out /tmp/mem.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom

MIB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2,googlenet")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="builds, launch graphs off and on in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    import gpuloom
    from gpuloom.policy.types import Layout, Partition
    from gpuloom.profile.profiler import load_model
    from gpuloom.runtime.cuda_device import CudaDeviceLayer

    compiled = {}
    for name in args.models.split(","):
        ms = load_model(name, device="cuda")
        ex = tuple(torch.randn((1, *s), device="cuda").to(dt) for s, dt in zip(ms.input_shapes, ms.input_dtypes))
        compiled[name] = gpuloom.compile(ms.module, ex, max_batch=args.max_batch, device="cuda", channels_last=False)
        print(f"compiled {name}: graph memory {compiled[name].memory_bytes / MIB:.1f} MiB", flush=True)

    def free() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    builds = []
    for r in range(args.rounds):
        launch_graphs = r % 2 == 1
        gc.collect()
        torch.cuda.empty_cache()
        free0, res0 = free(), torch.cuda.memory_reserved()
        layer = CudaDeviceLayer(0, launch_graphs=launch_graphs)
        for name, cm in compiled.items():
            layer.add_model(name, cm)
        lanes = layer.build(Layout((Partition(0, 0, layer.gpu_sms, shared=True),), layer.gpu_sms))
        free1, res1 = free(), torch.cuda.memory_reserved()
        made = sum(g is not None for ln in lanes.state["lanes"] for g in ln.launch_graphs.values())
        row = {"round": r, "launch_graphs": launch_graphs, "launch_graphs_made": made,
               "reserved_rise_mib": round((res1 - res0) / MIB, 2), "free_fall_mib": round((free0 - free1) / MIB, 2),
               "counted_mib": round(lanes.memory_bytes / MIB, 2)}
        layer.release(lanes)
        layer.close()
        del lanes, layer
        gc.collect()
        torch.cuda.empty_cache()
        row["not_back_after_close_mib"] = round((free0 - free()) / MIB, 2)
        builds.append(row)
        print(json.dumps(row), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "models": list(compiled),
           "max_batch": args.max_batch, "builds": builds}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
