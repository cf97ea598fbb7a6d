"""CPU time the submitting thread spends per request in ``InferenceService.submit``.

Why: under load the runtime is GIL-bound. On the H200 at 3,400 requests/s the thread calling
``submit`` used 0.49 CPU-s per s (~145 us per request), and every microsecond of Python on the
submit path is a microsecond the runtime's loop thread may wait for the GIL. This measures that
cost on its own: a service on ``device="cpu"`` with a tiny model (``torch.nn.Linear(16, 4)``), a
warm-up, then ``--reps`` repetitions of ``--requests`` submissions each, with a short sleep every
``--burst`` submissions so the queue drains (the sleeps and the final wait for the futures are not
timed). Reported: the submitting thread's CPU time (``time.thread_time``) per request, median and
spread over the repetitions, and the wall time per ``submit`` call.

    /work/main/.venv/bin/python scripts/diag_submit_cost.py
    /work/main/.venv/bin/python scripts/diag_submit_cost.py --rows 4 --out /tmp/submit.json
    /work/main/.venv/bin/python scripts/diag_submit_cost.py --profile   # top cProfile entries

To compare two versions of the code, run it on each (e.g. a worktree per commit) back to back,
several times: the figures move by a few us between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom, not an installed one


def make_service(launch_on: str, queue_limit: int):
    """A started service serving one tiny float32 model "lin" (16 -> 4, max_batch 32)."""
    import torch

    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    torch.manual_seed(0)
    svc = InferenceService(policy="dstack", device="cpu", launch_on=launch_on, queue_limit=queue_limit)
    svc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no profile on CPU: a crude one is measured
        svc.load(ModelConfig("lin", (TensorSpec("x", (16,), "float32"),), max_batch=32, slo_ms=1000),
                 torch.nn.Linear(16, 4).eval())
    return svc


def run_once(svc, x, n: int, burst: int, pause_s: float) -> tuple[float, float]:
    """Submit ``n`` requests; returns (thread CPU us, wall us) per request, submit calls only."""
    inputs = {"x": x}
    futs = []
    cpu = wall = 0.0
    for start in range(0, n, burst):
        k = min(burst, n - start)
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(k):
            futs.append(svc.submit("lin", inputs))
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - w0
        time.sleep(pause_s)  # let the runtime drain the queue (untimed)
    for f in futs:
        f.result(timeout=60)
    return cpu / n * 1e6, wall / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="submissions per repetition")
    p.add_argument("--reps", type=int, default=7, help="repetitions (median and spread over them)")
    p.add_argument("--warmup", type=int, default=1000, help="submissions before the first repetition")
    p.add_argument("--burst", type=int, default=50, help="submissions between two pauses")
    p.add_argument("--pause-ms", type=float, default=2.0, help="pause after each burst, ms")
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument("--launch-on", default="auto", help="InferenceService launch_on")
    p.add_argument("--profile", action="store_true",
                   help="also profile one repetition (cProfile timed by this thread's CPU time)")
    p.add_argument("--top", type=int, default=25, help="cProfile entries to print")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = p.parse_args()

    import numpy as np

    x = np.random.default_rng(0).standard_normal((args.rows, 16)).astype(np.float32)
    # a profiled repetition slows this thread's submits less than it starves the runtime's thread of
    # the GIL, so its queue can grow to the whole repetition: room for it, never an Overloaded
    svc = make_service(args.launch_on, queue_limit=max(1024, 4 * args.burst, args.requests if args.profile else 0))
    try:
        run_once(svc, x, args.warmup, args.burst, args.pause_ms / 1000)
        cpu_us, wall_us = [], []
        for _ in range(args.reps):
            c, w = run_once(svc, x, args.requests, args.burst, args.pause_ms / 1000)
            cpu_us.append(c)
            wall_us.append(w)
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile(time.thread_time)  # CPU time of this thread, not wall (lock waits, sleeps)
            prof.enable()
            run_once(svc, x, args.requests, args.burst, args.pause_ms / 1000)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        st = svc.stats()["models"]["lin"]
    finally:
        svc.close()
    result = {
        "requests": args.requests, "reps": args.reps, "rows": args.rows, "burst": args.burst,
        "pause_ms": args.pause_ms, "launch_on": args.launch_on,
        "cpu_us_per_request": {"median": statistics.median(cpu_us), "min": min(cpu_us), "max": max(cpu_us),
                               "all": [round(v, 2) for v in cpu_us]},
        "wall_us_per_submit": {"median": statistics.median(wall_us), "min": min(wall_us), "max": max(wall_us)},
        "books": {k: st[k] for k in ("accepted", "success", "failure", "rejected", "in_flight")},
    }
    c = result["cpu_us_per_request"]
    print(f"submit thread CPU per request: median {c['median']:.2f} us (min {c['min']:.2f}, max {c['max']:.2f}) "
          f"over {args.reps} x {args.requests}; wall per submit: median {result['wall_us_per_submit']['median']:.2f} us")
    print(f"books: {result['books']}")
    print(f"gpuloom from {Path(sys.modules['gpuloom'].__file__).parent}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
