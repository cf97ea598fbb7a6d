"""How long a finished GPU batch takes to reach the runtime's thread, by mechanism (issue 5: the gap).

A kernel of known length (``torch.cuda._sleep``) is enqueued with a completion signal; the main
thread (the runtime's, in gpuloom) notes when it learns that the kernel is done. Latency = that
moment - the moment the enqueue returned; each mechanism's figure less the spin-wait's is its
wake-up cost. Mechanisms:

* ``spin``: the main thread polls ``cuEventQuery`` (the floor; burns a core, not an option);
* ``watcher``: a watcher thread sleeps in a blocking-sync event's ``synchronize()``, then notifies
  the main thread through a ``threading.Condition`` (complete_on="watcher": two wake-ups);
* ``hostfunc``: ``cuLaunchHostFunc(sem_post)`` behind the kernel; the main thread sleeps on the
  semaphore and checks the event (complete_on="loop": one wake-up, no Python thread in between).

Each under three loads of the process: ``quiet``; ``busy`` (another thread runs Python without
pause, the worst case for the GIL); ``bursty`` (another thread wakes every 0.2 ms for 0.1 ms of
Python, like a load generator).

    python3 scripts/diag_wake.py --out docs/results/runtime/diag_wake_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--kernel-us", type=float, default=300.0, help="length of the waited-for kernel, us")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from gpuloom.gpu.launch import Driver
    from gpuloom.runtime.waker import SemaphoreWaker

    assert torch.cuda.is_available(), "needs a GPU"
    drv = Driver(0)
    drv.ensure_context()
    stream = torch.cuda.Stream()
    st = int(stream.cuda_stream)
    # cycles for the kernel: calibrate torch.cuda._sleep against events
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        e0.record()
        torch.cuda._sleep(1_000_000)
        e1.record()
    e1.synchronize()
    cycles = int(1_000_000 * args.kernel_us / 1000.0 / e0.elapsed_time(e1))

    done = torch.cuda.Event(blocking=True)
    waker = SemaphoreWaker()
    fn, arg = waker.c_post

    def enqueue(hostfunc: bool) -> float:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            done.record()
        if hostfunc:
            drv.host_func(st, fn, arg)
        return time.perf_counter()

    def spin() -> float:
        t = enqueue(False)
        while not drv.done(done.cuda_event):
            pass
        return time.perf_counter() - t

    cv = threading.Condition()
    box: list = []
    jobs: list = []
    job_cv = threading.Condition()

    def watcher() -> None:
        while True:
            with job_cv:
                while not jobs:
                    job_cv.wait()
                job = jobs.pop()
            if job is None:
                return
            done.synchronize()
            with cv:
                box.append(1)
                cv.notify()

    wt = threading.Thread(target=watcher, daemon=True)
    wt.start()

    def via_watcher() -> float:
        with job_cv:
            t = enqueue(False)
            jobs.append(1)
            job_cv.notify()
        with cv:
            while not box:
                cv.wait()
            box.clear()
        return time.perf_counter() - t

    def via_hostfunc() -> float:
        t = enqueue(True)
        while True:
            waker.wait(1.0)
            if drv.done(done.cuda_event):
                return time.perf_counter() - t

    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(200))

    def bursty() -> None:
        while not stop.is_set():
            time.sleep(0.0002)
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0001:
                sum(range(50))

    result = {"kernel_us": args.kernel_us, "trials": args.trials, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "loads": {}}
    for load, target in (("quiet", None), ("busy", busy), ("bursty", bursty)):
        stop.clear()
        th = threading.Thread(target=target, daemon=True) if target else None
        if th:
            th.start()
        row = {}
        for name, fn_ in (("spin", spin), ("watcher", via_watcher), ("hostfunc", via_hostfunc)):
            for _ in range(20):
                fn_()
            us = sorted(fn_() * 1e6 for _ in range(args.trials))
            row[name] = {"p50_us": statistics.median(us), "p90_us": us[int(0.9 * len(us))],
                         "p99_us": us[int(0.99 * len(us))], "mean_us": statistics.fmean(us)}
        for name in ("watcher", "hostfunc"):
            row[name]["wake_p50_us"] = row[name]["p50_us"] - row["spin"]["p50_us"]
            row[name]["wake_mean_us"] = row[name]["mean_us"] - row["spin"]["mean_us"]
        stop.set()
        if th:
            th.join()
        result["loads"][load] = row
        print(load, {k: (round(v["p50_us"]), round(v["mean_us"]), round(v["p99_us"])) for k, v in row.items()}, flush=True)
    with job_cv:
        jobs.append(None)
        job_cv.notify()
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
