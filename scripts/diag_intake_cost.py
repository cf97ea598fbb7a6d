#!/usr/bin/env python
"""CPU the runtime's loop thread spends per HTTP request on the bridge's side: taking a worker's
compact ring record in (``InferBridge._take_compact`` -> ``ServeCore.submit`` ->
``InferenceService.submit``) and answering it (``Runtime._answer_due``: the booking, the future, the
bridge's reply record). CPU only, on a fake device; no worker processes.

Why: on an H100 host at mix6 x1 over HTTP (run 209) the runtime's loop thread ran 0.60 CPU-s/s against
0.33-0.36 in process: the ring intake 63 us per request and the answers 50 (14.6 in process), while a
finished batch waits for that thread to launch the next. This isolates both costs so a change to
either can be timed back to back on one machine (run it on each version of the code).

The service serves the mix6 models on ``gpuloom.bench.fake``'s device (each request one 4-float
row). ``--burst`` records at a time are taken through the bridge's own ``_take_compact`` on the
runtime loop's thread (``call_on_loop_at``), as the server's ring intake takes them, their thread
CPU timed (``time.thread_time``), then a pause lets the runtime answer them; their replies are
encoded as the ring path encodes them (``_ReplyEncoder``) into a list. The answers' cost is the loop's
own accounting (``InferenceService.loop_cpu``: ``Runtime._answer_due``'s CPU per request answered).
A record taken alone costs about twice what one of a burst of eight does (the code path is cold
after the loop's other work and a pause): at the H100's x1 over HTTP the loop took 0.7 a poll.

    PYTHONPATH=. python scripts/diag_intake_cost.py --requests 3000 --repeat 5 --out /tmp/intake.json
    PYTHONPATH=. python scripts/diag_intake_cost.py --profile     # the loop thread's top cProfile entries
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def build(policy: str, workload_path: str):
    """A started fake service with the workload's models, its ServeCore and an InferBridge on it."""
    from gpuloom.bench.fake import fake_models, fake_service, fake_world
    from gpuloom.bench.workload import load_workload
    from gpuloom.serve.bridge import InferBridge
    from gpuloom.serve.core import ServeCore

    workload, profiles = fake_world(load_workload(workload_path),
                                    1.0, 16)
    svc = fake_service(policy, profiles, queue_limit=100_000)
    svc.start()
    svc.load_many(list(fake_models(workload, 16).values()))
    core = ServeCore(svc, None)
    path = tempfile.mktemp(prefix="gpuloom-diag-", suffix=".sock")
    return svc, core, InferBridge(core, path)


def records(model: str, n: int, shared: memoryview) -> list[memoryview]:
    """``n`` compact ring records of ``model``, each a 4-float row at its own place in ``shared``."""
    from gpuloom.serve.wire import _describe, ring_request

    out = []
    for i in range(n):
        row = np.full((1, 4), float(i), np.float32)
        off = (i * 16) % (len(shared) - 16)
        shared[off:off + 16] = row.tobytes()
        tensors, _ = _describe(["x"], [row])
        meta = {"model": model, "version": None, "outputs": None}
        try:  # written ahead: no hand-off time, so the bridge counts no time in the ring against the deadline
            parts = ring_request(i + 1, meta, tensors, off, None, 0.0, math.nan)
        except TypeError:  # a checkout from before the hand-off time (diag_intake_ab.py --base)
            parts = ring_request(i + 1, meta, tensors, off, None, 0.0)
        out.append(memoryview(b"".join(bytes(p) for p in parts)))
    return out


def one_rep(svc, bridge, model: str, n: int, burst: int, pause_s: float) -> dict:
    """Take ``n`` records in bursts; the intake's CPU per request, the answers' (loop accounting)."""
    from gpuloom.serve.bridge import _Outstanding
    from gpuloom.serve.wire import _ReplyEncoder

    shared = memoryview(bytearray(1 << 20))
    recs = records(model, n, shared)
    encoder, replies, errors = _ReplyEncoder(), [], []

    def ok(rid, names, arrays, service_ms):
        replies.append(encoder.record(rid, names, arrays, service_ms))

    in_arena = _Outstanding()
    cpu0 = svc.loop_cpu(True)
    t_wall = time.monotonic()
    used = 0.0
    for i in range(0, n, burst):

        def take(i: int = i) -> None:  # on the runtime loop's thread, as the ring intake runs
            nonlocal used
            t = time.thread_time()
            for rec in recs[i:i + burst]:
                bridge._take_compact(errors.append, ok, rec, shared, in_arena)
            used += time.thread_time() - t

        on_loop(svc, take)
        time.sleep(pause_s)
    deadline = time.monotonic() + 30
    while len(replies) + len(errors) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    loop = svc.loop_cpu()  # read before charging stops (a stop forgets the books)
    svc.loop_cpu(False)
    wall = time.monotonic() - t_wall
    answers = None
    for name, row in loop["callbacks"].items():
        if name.endswith("_answer_due"):
            before = cpu0["callbacks"].get(name, {"cpu_s": 0.0})
            answers = (row["cpu_s"] - before["cpu_s"]) / n * 1e6
    return {"intake_us_per_request": used / n * 1e6, "answer_us_per_request": answers,
            "replies": len(replies), "errors": len(errors), "wall_s": wall}


def on_loop(svc, fn) -> None:
    """``fn()`` on the runtime loop's thread, waited for."""
    done = threading.Event()
    svc.call_on_loop_at(0.0, lambda: (fn(), done.set()))
    if not done.wait(30):
        raise RuntimeError("the runtime's loop did not run a call within 30 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=str(Path(__file__).resolve().parent.parent / "examples" / "mix6.yaml"),
                    help="the models served (default: examples/mix6.yaml)")
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--policy", default="dstack")
    ap.add_argument("--requests", type=int, default=3000, help="requests per repetition (default 3000)")
    ap.add_argument("--burst", type=int, default=1, help="records taken per wake (run 211: 0.7 a poll on average)")
    ap.add_argument("--pause-ms", type=float, default=1.0, help="pause after each burst (default 1 ms)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="print the runtime loop thread's top cProfile entries instead (the intake, the answers, "
                         "the loop's own)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    svc, core, bridge = build(args.policy, args.workload)
    try:
        one_rep(svc, bridge, args.model, 200, args.burst, args.pause_ms / 1000)  # warm-up
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile(time.thread_time)  # the loop thread's CPU, the intake's and the answers'
            on_loop(svc, prof.enable)  # a profiler watches the thread that enables it
            one_rep(svc, bridge, args.model, args.requests, args.burst, args.pause_ms / 1000)
            on_loop(svc, prof.disable)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return 0
        reps = [one_rep(svc, bridge, args.model, args.requests, args.burst, args.pause_ms / 1000)
                for _ in range(args.repeat)]
    finally:
        bridge.close()
        svc.close(drain=False, timeout_s=10)
    intake = [r["intake_us_per_request"] for r in reps]
    answer = [r["answer_us_per_request"] for r in reps if r["answer_us_per_request"] is not None]
    out = {"schema": "gpuloom.diag_intake_cost/1", "model": args.model, "policy": args.policy,
           "requests": args.requests, "burst": args.burst, "pause_ms": args.pause_ms, "reps": reps,
           "intake_us_median": statistics.median(intake), "intake_us_min": min(intake), "intake_us_max": max(intake),
           "answer_us_median": statistics.median(answer) if answer else None,
           "answer_us_min": min(answer) if answer else None, "answer_us_max": max(answer) if answer else None,
           "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}}
    print(f"intake: median {out['intake_us_median']:.1f} us a request (min {out['intake_us_min']:.1f}, "
          f"max {out['intake_us_max']:.1f}) over {args.repeat} x {args.requests}")
    if answer:
        print(f"answers (the loop's _answer_due): median {out['answer_us_median']:.1f} us a request "
              f"(min {out['answer_us_min']:.1f}, max {out['answer_us_max']:.1f})")
    print(f"replies {sum(r['replies'] for r in reps)}, errors {sum(r['errors'] for r in reps)}")
    if args.out:
        from gpuloom.bench.e2e import save_json

        save_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
