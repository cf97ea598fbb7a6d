"""Where a one-row CPU batch's time goes after the process idled, leg by leg (issue 6, fiftieth session).

At 100 requests/s (the protocol benchmark's fixed rate) every request finds the server idle for about
10 ms, and on the build VM code that runs after such a gap runs several times slower than back to
back. This times each leg of ``CpuDeviceLayer.finish`` for one row of a compiled ``nn.Linear(16, 4)``
after ``--gap-ms`` of sleep: the inputs as tensors (``host_device.batch_inputs``), taking the model's
lock and entering inference mode, the call, leaving, and the outputs to numpy
(``device.cpu_numpy_outputs``). It also times the inputs and the outputs as the CPU layer made them
before the fiftieth session (``np.stack`` then ``torch.from_numpy``; ``device.numpy_outputs``:
``t[:n].detach().cpu().numpy()`` per output) against the current ways, alternating which goes first.

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

LEGS = ("inputs", "enter", "call", "exit", "outputs")


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
    from gpuloom.runtime.host_device import batch_inputs

    cm = gpuloom.compile(torch.nn.Linear(16, 4).eval(), torch.zeros(1, 16))
    lock = threading.Lock()
    rows = [[np.random.default_rng(0).random(16, dtype=np.float32)]]
    legs: dict[str, list[float]] = {k: [] for k in (*LEGS, "total")}
    for _ in range(a.reps):  # the legs as CpuDeviceLayer.finish runs them
        time.sleep(a.gap_ms / 1000.0)
        t = [time.perf_counter()]
        (x,) = batch_inputs(torch, np, rows)
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

    def stacked(rs):  # the inputs before the fiftieth session
        return [torch.from_numpy(np.stack([r[j] for r in rs])) for j in range(len(rs[0]))]

    pairs = {"inputs": (("np.stack", stacked), ("batch_inputs", lambda rs: batch_inputs(torch, np, rs))),
             "outputs": (("numpy_outputs", lambda o: numpy_outputs(o, 1)),
                         ("cpu_numpy_outputs", lambda o: cpu_numpy_outputs(o, 1)))}
    ab: dict[str, dict[str, list[float]]] = {}
    for leg, ways in pairs.items():
        arg = rows if leg == "inputs" else out
        ab[leg] = {name: [] for name, _ in ways}
        for i in range(a.reps):
            for name, way in (ways if i % 2 else ways[::-1]):
                time.sleep(a.gap_ms / 1000.0)
                t0 = time.perf_counter()
                way(arg)
                ab[leg][name].append((time.perf_counter() - t0) * 1e6)
    report = {"gap_ms": a.gap_ms, "reps": a.reps, "torch": torch.__version__,
              "legs": {k: summary(v) for k, v in legs.items()},
              "before_after": {leg: {k: summary(v) for k, v in ways.items()} for leg, ways in ab.items()}}
    for k, s in report["legs"].items():
        print(f"{k:12s} median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}")
    for leg, ways in report["before_after"].items():
        for k, s in ways.items():
            print(f"{leg}, {k:18s} median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
