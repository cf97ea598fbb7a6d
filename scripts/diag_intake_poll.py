#!/usr/bin/env python
"""CPU cost of one runtime-loop wake-up's look at the HTTP workers' request rings, all empty.

Why: the loop polled each worker's ring through a poller of its own (a Python call chain per ring:
the poller, ``_RingTaker``, ``ByteRing.pending``), at every wake, whether or not the wake was for a
request. With 8 workers on the H200 that was 33,250 poller calls a second for 3,378 requests (run
84). ``bridge._LoopIntake`` is one poller that reads each ring's two index cells and calls into a
ring only when a request waits. This times both ways of looking at N empty rings, as the loop calls
its pollers (``RealtimeLoop``: ``due = min(due, poll())``), without the loop's CPU accounting.

    .venv/bin/python scripts/diag_intake_poll.py --rings 4,8,16 --out /tmp/intake_poll.json
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import platform
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.serve.bridge import _LoopIntake, _RingTaker  # noqa: E402
from gpuloom.serve.ring import ByteRing  # noqa: E402


class _Rings:
    def __init__(self) -> None:
        self.requests = ByteRing(memoryview(mmap.mmap(-1, 4096)))


class _Service:
    def add_intake(self, poll):
        return -1

    def remove_intake(self, poll):
        pass


class _Bridge:
    loop_requests = 0


def per_ring_pollers(n: int):
    """The code before: one poller per ring (``InferBridge._loop_poll`` as it was)."""
    pollers = []
    for _ in range(n):
        take = _RingTaker(_Rings(), lambda rec: None)

        def poll(take=take) -> float:
            try:
                take(True)
            except Exception:  # noqa: BLE001
                pass
            return math.inf

        pollers.append(poll)
    return tuple(pollers)


def one_poller(n: int):
    intake = _LoopIntake(_Bridge())
    for _ in range(n):
        rings = _Rings()
        intake.attach(rings.requests, _RingTaker(rings, lambda rec: None), _Service())
    return (intake.poll,)


def wake(pollers) -> float:
    due = math.inf
    for poll in pollers:
        due = min(due, poll())
    return due


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rings", default="4,8,16")
    p.add_argument("--number", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.rings.split(",")):
        row = {"rings": n}
        for name, make in (("per_ring_pollers", per_ring_pollers), ("one_poller", one_poller)):
            pollers = make(n)
            best = min(timeit.repeat(lambda: wake(pollers), number=args.number, repeat=args.repeat))
            row[f"{name}_us_per_wake"] = round(best / args.number * 1e6, 3)
        row["saved_us_per_wake"] = round(row["per_ring_pollers_us_per_wake"] - row["one_poller_us_per_wake"], 3)
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"diag": "intake_poll", "python": platform.python_version(),
                                              "cpu": platform.processor() or platform.machine(),
                                              "method": f"best of {args.repeat} x {args.number} wakes, all rings empty",
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
