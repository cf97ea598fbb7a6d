#!/usr/bin/env python
"""What does unloading a big model cost the models still served, and what does it give back? (issue 6)

An unload thaws the frozen heap; the unloaded model's objects (its FX graphs hold its weights) are then
freed by a full collection. With ``unload_collect_mib`` (default 256 MiB) an unload of a model at least
that big runs that collection at once: one pause of every thread, for memory back now. This loads
torchvision models (random weights) into a service on this machine's device, serves a small model
meanwhile, unloads the largest, and reports: the unload's wall time, the collection's pause (the
service's collector record), resident memory (and on CUDA torch's allocated memory) before and after,
and the small model's slowest answer during the unload. Run it once with the default and once with
``--unload-collect-mib inf`` (the behaviour before the forty-sixth session) to compare.

    PYTHONPATH=. .venv/bin/python scripts/diag_unload_pause.py --models resnet50,vgg16 --out F.json
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diag_unload_memory import rss_mib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,vgg16", help="torchvision models to load; the largest is unloaded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--unload-collect-mib", type=float, default=256.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    import numpy as np
    import torch
    import torchvision

    from gpuloom.runtime.gcpause import GcMonitor
    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    nets = {n: getattr(torchvision.models, n)(weights=None).eval() for n in names}
    size = {n: sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20 for n, m in nets.items()}
    big = max(size, key=size.get)
    svc = InferenceService(policy="dstack", device=a.device, unload_collect_mib=a.unload_collect_mib)
    svc.start()
    cuda = a.device.startswith("cuda")
    try:
        svc.load(ModelConfig("small", (TensorSpec("x", (16,), "float32"),), max_batch=4, slo_ms=1000),
                 torch.nn.Linear(16, 4).eval())
        for n in names:
            svc.load(ModelConfig(n, (TensorSpec("x", (3, 224, 224), "float32"),), max_batch=1, slo_ms=10000), nets[n])
        del nets  # the service's alone now
        x = np.ones((1, 16), np.float32)
        stop, slowest = threading.Event(), [0.0]

        def serve_small() -> None:  # the other models' view of the unload: a request every 2 ms
            while not stop.is_set():
                t0 = time.perf_counter()
                svc.infer("small", {"x": x}, timeout_s=30)
                slowest[0] = max(slowest[0], (time.perf_counter() - t0) * 1e3)
                time.sleep(0.002)

        before_rss = rss_mib()
        before_dev = torch.cuda.memory_allocated() / 2**20 if cuda else None
        t = threading.Thread(target=serve_small, daemon=True)
        t.start()
        time.sleep(0.5)
        slowest[0] = 0.0
        since = time.monotonic()
        t0 = time.perf_counter()
        svc.unload(big)
        unload_s = time.perf_counter() - t0
        time.sleep(0.5)
        stop.set()
        t.join(10)
        pauses = GcMonitor.installed().since(since)  # the collector's pauses from the unload on
        if cuda:
            torch.cuda.synchronize()
        report = {
            "device": a.device, "models": names, "unloaded": big, "unloaded_weights_mib": round(size[big], 1),
            "unload_collect_mib": a.unload_collect_mib, "unload_collections": svc.stats()["unload_collections"],
            "unload_s": round(unload_s, 3),
            "full_collections_during": pauses["collections"][2],
            "longest_pause_ms": round(pauses["max_ms"], 1),
            "small_slowest_answer_ms": round(slowest[0], 1),
            "rss_mib": [round(before_rss), round(rss_mib())],
            "device_mib": [round(before_dev), round(torch.cuda.memory_allocated() / 2**20)] if cuda else None,
        }
    finally:
        svc.close()
    print(json.dumps(report))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
