#!/usr/bin/env python
"""CPython's convoy effect, measured: how long a GIL-releasing call takes next to a busy thread.

The runtime's loop thread makes many short calls that release the GIL (torch copies, a graph's
replay, CUDA events). This times such a call (a torch CPU copy of ``--elements`` floats, one
thread, about 20 us) in a loop, alone and next to one thread spinning in pure Python, under each
switch interval (``sys.setswitchinterval``), and writes mean and worst microseconds per call.

    .venv/bin/python scripts/diag_gil_convoy.py --intervals-ms 5,1,0.5,0.2 --out docs/results/runtime/diag_gil_convoy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time


def time_calls(op, n: int) -> tuple[float, float]:
    """Mean and worst microseconds per call of ``op`` over ``n`` calls."""
    worst = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        op()
        worst = max(worst, time.perf_counter() - t)
    return (time.perf_counter() - t0) / n * 1e6, worst * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--elements", type=int, default=20000, help="floats copied per call (default 20000: ~20 us)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    dst, src = torch.zeros(a.elements), torch.ones(a.elements)

    def op():
        dst.copy_(src)

    def spin(stop: threading.Event) -> None:
        x = 0
        while not stop.is_set():
            x += 1

    saved = sys.getswitchinterval()
    rows = []
    try:
        for rep in range(a.repeat):
            for ms in (float(x) for x in a.intervals_ms.split(",")):
                sys.setswitchinterval(ms / 1000.0)
                time_calls(op, 50)  # warm
                alone = time_calls(op, a.calls)
                stop = threading.Event()
                th = threading.Thread(target=spin, args=(stop,), daemon=True)
                th.start()
                time.sleep(0.01)
                busy = time_calls(op, a.calls)
                stop.set()
                th.join()
                row = {"repeat": rep, "switch_interval_ms": ms, "alone_mean_us": alone[0], "alone_worst_us": alone[1],
                       "busy_mean_us": busy[0], "busy_worst_us": busy[1]}
                rows.append(row)
                print(f"interval {ms:>4g} ms: alone {alone[0]:7.1f} us (worst {alone[1]:8.1f}), next to a busy "
                      f"thread {busy[0]:7.1f} us (worst {busy[1]:8.1f})")
    finally:
        sys.setswitchinterval(saved)
    if a.out:
        meta = {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "elements": a.elements, "calls": a.calls}
        with open(a.out, "w") as f:
            json.dump({"schema": "gpuloom.diag_gil_convoy/1", "meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
