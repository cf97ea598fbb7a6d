#!/usr/bin/env python
"""What waking each HTTP worker once per batch saves the runtime's thread (CPU; x86-64 Linux).

Why: the eventfd ``write`` that wakes a worker was about half of the runtime thread's cost per reply
(59 of 125 py-spy samples, ``docs/reports/serving.md``); ``serve.ring.one_post_per_worker`` posts each
worker once per batch instead. This times the runtime's side alone: ``--workers`` worker processes each
sleep on their eventfd and drain their reply ring when woken, as the HTTP workers do; the runtime's
thread writes a batch of ``B`` one-row replies (the compact record a served request gets, each to a
random worker) with one post per reply or inside the scope, and the thread's CPU time per batch is
taken (``time.thread_time``), the two ways alternating batch by batch, with a pause between batches so
the workers are asleep again, as between batches in serving. Also: the posts per batch, and how long
after the batch's start its first reply's worker was woken (the scope delays it to the batch's end).

    PYTHONPATH=. python scripts/diag_reply_posts.py --batches 1,4,8,16 --rounds 400 --out /tmp/posts.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import select
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.serve import ring  # noqa: E402
from gpuloom.serve.wire import _ReplyEncoder  # noqa: E402

STOP = b"stop"


def _worker(w: ring.WorkerRings, done) -> None:
    """Sleep on the eventfd; drain the reply ring when woken; count what came; end at STOP."""
    got, wakes, stop = 0, 0, False

    def take(rec: memoryview) -> None:
        nonlocal got, stop
        if bytes(rec[:4]) == STOP:
            stop = True
        else:
            got += 1

    while not stop:
        select.select([w.event_fd], [], [], 1.0)
        wakes += 1
        w.take_replies(take)
    done.put((got, wakes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8, help="HTTP worker processes (gpuloom serve's --http-workers)")
    ap.add_argument("--batches", default="1,4,8,16", help="rows per batch, comma-separated")
    ap.add_argument("--rounds", type=int, default=400, help="batches per size and way")
    ap.add_argument("--pause-ms", type=float, default=1.0, help="between batches: the workers go back to sleep")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not ring.supported():
        print("shared rings need x86-64 Linux", file=sys.stderr)
        return 2
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    pairs = []
    for _ in range(a.workers):
        w = ring.WorkerRings(4 << 20)
        pairs.append((w, ring.RuntimeRings(os.dup(w.fd), os.dup(w.event_fd), w.size)))
    procs = [ctx.Process(target=_worker, args=(w, done), daemon=True) for w, _ in pairs]
    for p in procs:
        p.start()
    enc, rng = _ReplyEncoder(), random.Random(0)
    out = np.zeros((1, 1000), np.float32)  # one row of a classifier's logits
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        cpu = {"per_reply": [], "scope": []}
        posts = {"per_reply": [], "scope": []}
        first_wake_us = {"per_reply": [], "scope": []}
        for i in range(2 * a.rounds):
            way = "scope" if i % 2 else "per_reply"
            targets = [pairs[rng.randrange(a.workers)][1] for _ in range(b)]
            t0, c0 = time.perf_counter(), time.thread_time()
            if way == "scope":
                with ring.one_post_per_worker():
                    for j, r in enumerate(targets):
                        r.reply(enc.record(i * 64 + j, ["output0"], [out], 1.0))
                first = time.perf_counter()  # the first reply's worker is woken at the scope's end
            else:
                for j, r in enumerate(targets):
                    r.reply(enc.record(i * 64 + j, ["output0"], [out], 1.0))
                    if j == 0:
                        first = time.perf_counter()
            cpu[way].append((time.thread_time() - c0) * 1e6)
            first_wake_us[way].append((first - t0) * 1e6)
            posts[way].append(b if way == "per_reply" else len({id(r) for r in targets}))
            time.sleep(a.pause_ms / 1e3)
        row = {"batch": b, "workers": a.workers}
        for way in cpu:
            row[way] = {"cpu_us_per_batch": round(statistics.mean(cpu[way]), 2),
                        "cpu_us_per_batch_median": round(statistics.median(cpu[way]), 2),
                        "posts_per_batch": round(statistics.mean(posts[way]), 2),
                        "first_wake_us": round(statistics.median(first_wake_us[way]), 2)}
        row["scope_over_per_reply_cpu"] = round(row["scope"]["cpu_us_per_batch"] / row["per_reply"]["cpu_us_per_batch"], 3)
        rows.append(row)
        print(f"batch {b:2d}: CPU per batch {row['per_reply']['cpu_us_per_batch']:7.1f} us one post per reply, "
              f"{row['scope']['cpu_us_per_batch']:7.1f} us one per worker ({row['scope_over_per_reply_cpu']:.3f}x); "
              f"posts {row['per_reply']['posts_per_batch']:.1f} -> {row['scope']['posts_per_batch']:.2f}; "
              f"first worker woken after {row['per_reply']['first_wake_us']:.1f} -> {row['scope']['first_wake_us']:.1f} us")
    for _, r in pairs:
        r.reply([STOP])
    got = [done.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    for w, r in pairs:
        r.close()
        w.close()
    sent = sum(2 * a.rounds * r["batch"] for r in rows)
    print(f"workers received {sum(g for g, _ in got)} of {sent} replies, woke {sum(k for _, k in got)} times")
    result = {"cpu": os.cpu_count(), "rounds": a.rounds, "pause_ms": a.pause_ms, "rows": rows,
              "received": sum(g for g, _ in got), "sent": sent, "worker_wakes": sum(k for _, k in got)}
    if a.out:
        save_json(a.out, result)
        print(f"wrote {a.out}")
    return 0 if result["received"] == sent else 1


if __name__ == "__main__":
    sys.exit(main())
