#!/usr/bin/env python
"""How long a served model's requests wait while another model loads, with a large Python heap.

The layout-switch test in ``tests/test_service.py`` passed alone and failed late in the full suite:
its process then held millions of objects, and a step of each load that was O(heap) and held the
GIL (``gc.get_freeze_count()``) stopped every thread. This runs that test's body on a fake device
(a 0.4 s layout build) after allocating ``--heap`` dicts (each with a list: 2x that many tracked
objects), and prints, per repetition, the
load's time and every request that waited more than 30 ms (when it started, relative to the load,
and how long it waited). Under ``triton`` every request waits about 50 ms (its queue delay).

    python scripts/diag_switch_heap.py --policy triton --heap 3000000
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from gpuloom.runtime.host_device import FakeDeviceLayer, FakeModel  # noqa: E402
from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec  # noqa: E402

X4 = (TensorSpec("x", (4,), "float32"),)
Y4 = (TensorSpec("y", (4,), "float32"),)


def one(policy: str) -> str:
    dev = FakeDeviceLayer(build_delay_s=0.4)
    svc = InferenceService(policy=policy, device_layer=dev)
    svc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.load(ModelConfig("twice", X4, Y4, max_batch=8, slo_ms=500), FakeModel(lambda xs: [xs[0] * 2], 1.0))
        lat, stop = [], threading.Event()

        def serve_twice() -> None:
            while not stop.is_set():
                t = time.monotonic()
                svc.submit("twice", {"x": np.ones((1, 4), np.float32)}).result(5)
                lat.append((t, time.monotonic() - t))
                time.sleep(0.005)

        th = threading.Thread(target=serve_twice)
        th.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.load(ModelConfig("plus", X4, Y4, max_batch=8, slo_ms=500), FakeModel(lambda xs: [xs[0] + 1], 1.0))
        t1 = time.monotonic()
        svc.unload("plus")
        t2 = time.monotonic()
        time.sleep(0.05)
        stop.set()
        th.join()
    finally:
        svc.close()
    slow = [(round(t - t0, 3), round(d, 3)) for t, d in lat if d > 0.03]
    return (f"{policy}: load {t1 - t0:.3f} s, unload {t2 - t1:.3f} s, longest wait {max(d for _, d in lat):.3f} s; "
            f"waits over 30 ms (start - load start, wait): {slow}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="triton")
    ap.add_argument("--heap", type=int, default=0,
                    help="dicts to allocate first, each holding a list: twice as many tracked objects (default 0)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    heap = [{"a": [i]} for i in range(a.heap)]  # noqa: F841 - kept alive: the heap under test
    gc.collect()
    for _ in range(a.reps):
        print(one(a.policy), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
