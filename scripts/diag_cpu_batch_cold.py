"""Where a one-row CPU batch's time goes after the process idled, leg by leg (issue 6, fiftieth session).

At 100 requests/s (the protocol benchmark's fixed rate) every request finds the server idle for about
10 ms, and on the build VM code that runs after such a gap runs several times slower than back to
back. This times each leg of ``CpuDeviceLayer.finish`` for one row of a compiled ``nn.Linear(16, 4)``
after ``--gap-ms`` of sleep: stacking the rows, ``torch.from_numpy``, taking the model's lock and
entering inference mode, the call, leaving, and the outputs to numpy (``device.cpu_numpy_outputs``).
It also times the outputs' conversion as the CPU layer did it before the fiftieth session
(``device.numpy_outputs``: ``t[:n].detach().cpu().numpy()`` for every output) against
``cpu_numpy_outputs``, alternating which goes first.

    PYTHONPATH=. python scripts/diag_cpu_batch_cold.py --reps 300 --out /tmp/cold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LEGS = ("stack", "from_numpy", "enter", "call", "exit", "outputs")


def summary(values: list[float]) -> dict:
    v = sorted(values)
    return {"median_us": round(statistics.median(v), 1), "p90_us": round(v[int(0.9 * (len(v) - 1))], 1),
            "n": len(v)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-ms", type=float, default=10.0, help="idle before each batch (default 10: 100 req/s)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    import gpuloom
    from gpuloom.runtime.device import cpu_numpy_outputs, numpy_outputs

    cm = gpuloom.compile(torch.nn.Linear(16, 4).eval(), torch.zeros(1, 16))
    lock = threading.Lock()
    rows = [[np.random.default_rng(0).random(16, dtype=np.float32)]]
    legs: dict[str, list[float]] = {k: [] for k in (*LEGS, "total")}
    for _ in range(a.reps):  # the legs as CpuDeviceLayer.finish runs them
        time.sleep(a.gap_ms / 1000.0)
        t = [time.perf_counter()]
        b = np.stack([r[0] for r in rows])
        t.append(time.perf_counter())
        x = torch.from_numpy(b)
        t.append(time.perf_counter())
        mode = torch.inference_mode()
        lock.acquire()
        mode.__enter__()
        t.append(time.perf_counter())
        out = cm(x)
        t.append(time.perf_counter())
        mode.__exit__(None, None, None)
        lock.release()
        t.append(time.perf_counter())
        cpu_numpy_outputs(out, 1)
        t.append(time.perf_counter())
        for k, t0, t1 in zip(LEGS, t, t[1:]):
            legs[k].append((t1 - t0) * 1e6)
        legs["total"].append((t[-1] - t[0]) * 1e6)

    ab: dict[str, list[float]] = {"numpy_outputs": [], "cpu_numpy_outputs": []}
    ways = (("numpy_outputs", numpy_outputs), ("cpu_numpy_outputs", cpu_numpy_outputs))
    for i in range(a.reps):
        for name, way in (ways if i % 2 else ways[::-1]):
            time.sleep(a.gap_ms / 1000.0)
            t0 = time.perf_counter()
            way(out, 1)
            ab[name].append((time.perf_counter() - t0) * 1e6)
    report = {"gap_ms": a.gap_ms, "reps": a.reps, "torch": torch.__version__,
              "legs": {k: summary(v) for k, v in legs.items()}, "outputs_ab": {k: summary(v) for k, v in ab.items()}}
    for k, s in report["legs"].items():
        print(f"{k:12s} median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}")
    for k, s in report["outputs_ab"].items():
        print(f"outputs, {k:14s} median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
