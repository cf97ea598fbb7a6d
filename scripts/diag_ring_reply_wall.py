#!/usr/bin/env python
"""Wall and CPU time of the runtime's ring replies (``RuntimeRings.reply``) and of their eventfd
posts, during a ``serve_e2e.py`` run in this process.

Why: over HTTP the loop thread's completions spent as much time off the CPU as on it (``--loop-cpu``'s
``off_cpu_us_per_call``), in-process almost none. A reply is written and its worker woken with the
GIL held (``ring.py``); if waking a sleeping worker gets the thread preempted, the post's wall time
shows it. This wraps both calls with a wall and a thread-CPU clock, runs ``serve_e2e.py`` with the
arguments given, and prints (and with ``--out``, writes) the per-call figures.

    .venv/bin/python scripts/diag_ring_reply_wall.py --out /tmp/reply.json -- examples/mix6.yaml --tiny \\
        --device cpu --scale 0.15 --duration 3 --http-workers 4 --clients 1
"""

from __future__ import annotations

import argparse
import json
import platform
import runpy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from gpuloom.serve import ring  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("e2e_args", nargs=argparse.REMAINDER, help="-- serve_e2e.py's arguments")
    args = p.parse_args()
    e2e_args = args.e2e_args[1:] if args.e2e_args[:1] == ["--"] else args.e2e_args
    acc = {"reply": [0, 0.0, 0.0], "post": [0, 0.0, 0.0]}  # calls, wall s, thread CPU s

    def timed(name, fn):
        def wrapper(*a, **k):
            t, c = time.monotonic(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                row = acc[name]
                row[0] += 1
                row[1] += time.monotonic() - t
                row[2] += time.thread_time() - c
        return wrapper

    ring.RuntimeRings.reply = timed("reply", ring.RuntimeRings.reply)
    ring._Eventfd.post = timed("post", ring._Eventfd.post)  # the reply's post is inside its figure too
    sys.argv = ["serve_e2e.py", *e2e_args]
    try:
        runpy.run_path(str(HERE / "serve_e2e.py"), run_name="__main__")
    except SystemExit:
        pass
    rows = {k: {"calls": n, "wall_us_per_call": wall / n * 1e6, "cpu_us_per_call": cpu / n * 1e6}
            for k, (n, wall, cpu) in acc.items() if n}
    for k, r in rows.items():
        print(f"{k}: {r['calls']} calls, wall {r['wall_us_per_call']:.1f} us/call, CPU {r['cpu_us_per_call']:.1f} us/call")
    if args.out:
        Path(args.out).write_text(json.dumps({"diag": "ring_reply_wall", "python": platform.python_version(),
                                              "serve_e2e_args": e2e_args, "calls": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
