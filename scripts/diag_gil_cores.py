#!/usr/bin/env python
"""Does a GIL-bound pipeline of threads run worse on many cores than on one or two? (no GPU)

Why: on the H200's 16-core host the bench's client thread used about 260 us of CPU per request under
load, against 22 us alone on the same host, and fell seconds behind its schedule; on the 2-core build
VM it kept to it (``docs/reports/runtime.md``, eighth session). One suspect is the GIL on many cores:
a thread woken on another core finds the GIL taken, sleeps again, and the hand-offs cost CPU.

This mimics the runtime process's threads with pure Python and no torch: a client thread submits
requests at ``--rate`` per second (``--submit-us`` of Python each) to a loop thread, which does
``--loop-us`` of Python and ``--releases`` calls that drop the GIL per request and hands every
request to one of ``--watchers`` threads; each watcher waits for the request's "device time"
(``--device-ms``, slept), then does ``--watch-us`` of Python. Per CPU set (``--cpu-sets``, e.g.
``all,0-1,0``) it reports the client's lateness behind schedule, CPU per request of each thread
role, and the process's CPU-s per s.

    python3 scripts/diag_gil_cores.py --cpu-sets all,0-1,0 --rate 3000 --out /tmp/gil_cores.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.runtime.affinity import parse_cpus, pinned  # noqa: E402


def spin(us: float) -> None:
    """Python work (holds the GIL) for about ``us`` microseconds."""
    end = time.perf_counter() + us / 1e6
    x = 0
    while time.perf_counter() < end:
        x += 1


def release() -> None:
    """A call that drops the GIL and returns at once (as a CUDA driver call or a numpy copy does)."""
    select.select([], [], [], 0)


def run_once(a: argparse.Namespace) -> dict:
    n = int(a.rate * a.duration)
    to_loop: queue.SimpleQueue = queue.SimpleQueue()
    to_watch = [queue.SimpleQueue() for _ in range(a.watchers)]
    done = threading.Semaphore(0)
    cpu: dict[str, float] = {}
    lock = threading.Lock()

    def account(role: str) -> None:
        with lock:
            cpu[role] = cpu.get(role, 0.0) + time.thread_time()

    def loop() -> None:
        i = 0
        while True:
            item = to_loop.get()
            if item is None:
                for q in to_watch:
                    q.put(None)
                break
            spin(a.loop_us)
            for _ in range(a.releases):
                release()
            to_watch[i % a.watchers].put(time.perf_counter() + a.device_ms / 1000.0)
            i += 1
        account("loop")

    def watcher(q: queue.SimpleQueue) -> None:
        while True:
            due = q.get()
            if due is None:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            spin(a.watch_us)
            release()
            done.release()
        account("watchers")

    threads = [threading.Thread(target=loop)] + [threading.Thread(target=watcher, args=(q,)) for q in to_watch]
    for t in threads:
        t.start()
    late = []
    c0 = time.thread_time()
    p0 = time.process_time()
    t0 = time.perf_counter()
    for k in range(n):
        at = t0 + k / a.rate
        delay = at - time.perf_counter()
        if delay > 0.0005:
            time.sleep(delay)
        late.append((time.perf_counter() - at) * 1000.0)
        spin(a.submit_us)
        to_loop.put(k)
    client_cpu = time.thread_time() - c0
    for _ in range(n):
        done.acquire()
    wall = time.perf_counter() - t0
    to_loop.put(None)
    for t in threads:
        t.join()
    late.sort()
    return {"late_ms_p50": late[n // 2], "late_ms_p99": late[int(n * 0.99)], "late_ms_max": late[-1],
            "cpu_us_per_request": {"client": client_cpu / n * 1e6, "loop": cpu["loop"] / n * 1e6,
                                   "watchers": cpu["watchers"] / n * 1e6},
            "process_cpu_s_per_s": (time.process_time() - p0) / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-sets", default="all,0-1,0", help="comma-separated: 'all' or a CPU list with '+' for ','")
    ap.add_argument("--rate", type=float, default=3000.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--submit-us", type=float, default=20.0)
    ap.add_argument("--loop-us", type=float, default=60.0)
    ap.add_argument("--releases", type=int, default=6, help="GIL-dropping calls per request on the loop thread")
    ap.add_argument("--watchers", type=int, default=6)
    ap.add_argument("--watch-us", type=float, default=40.0)
    ap.add_argument("--device-ms", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for rep in range(a.repeat):
        for spec in a.cpu_sets.split(","):
            cpus = None if spec == "all" else parse_cpus(spec)
            with pinned(cpus):
                r = run_once(a)
            r.update(cpus=spec, repeat=rep, cores=len(os.sched_getaffinity(0)) if cpus is None else len(cpus))
            rows.append(r)
            c = r["cpu_us_per_request"]
            print(f"cpus {spec:>6}: client late p50 {r['late_ms_p50']:8.2f} p99 {r['late_ms_p99']:8.2f} ms | CPU us per "
                  f"request: client {c['client']:6.1f} loop {c['loop']:6.1f} watchers {c['watchers']:6.1f} | process "
                  f"{r['process_cpu_s_per_s']:.2f} CPU-s/s", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "cpu_count": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
