"""How long an HTTP handler waits on its request's future after the runtime resolves it (issue 6).

On the CPU the runtime's loop runs on the HTTP server's event loop (``--runtime-on http``, the
default where batches are short), so a request's ``concurrent.futures.Future`` is resolved on the
loop's own thread. ``asyncio.wrap_future`` still wakes the loop through its self-pipe
(``call_soon_threadsafe``) and resumes the handler iterations later; ``serve.core.until_done`` does
not where no thread is crossed. This resolves a future on the loop's thread after ``--gap-ms`` of idle
(a timer, as a batch's completion event does), ``--reps`` times each way, alternating, and reports the
time from the result to the awaiting coroutine running again; ``--from-thread`` resolves it from another
thread instead (both ways then cross threads).

    PYTHONPATH=. python scripts/diag_future_hop.py --reps 300 --out /tmp/hop.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diag_cpu_batch_cold import summary  # noqa: E402 - the same median and p90 of microseconds
from gpuloom.serve.core import until_done  # noqa: E402


async def measure(reps: int, gap_ms: float, from_thread: bool) -> dict:
    loop = asyncio.get_running_loop()
    ways = (("wrap_future", asyncio.wrap_future), ("until_done", until_done))
    waits: dict[str, list[float]] = {name: [] for name, _ in ways}
    for i in range(reps):
        for name, way in (ways if i % 2 else ways[::-1]):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            mark: dict[str, float] = {}

            def resolve(fut=fut, mark=mark) -> None:
                mark["t"] = time.perf_counter()
                fut.set_result(None)

            if from_thread:
                threading.Timer(gap_ms / 1000.0, resolve).start()
            else:
                loop.call_later(gap_ms / 1000.0, resolve)
            await way(fut)
            waits[name].append((time.perf_counter() - mark["t"]) * 1e6)
    return {name: summary(v) for name, v in waits.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=10.0, help="idle before each result (default 10: 100 req/s)")
    ap.add_argument("--from-thread", action="store_true", help="resolve from another thread (the runtime's own)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = asyncio.run(measure(a.reps, a.gap_ms, a.from_thread))
    for name, s in res.items():
        print(f"{name:12s} result to handler: median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"gap_ms": a.gap_ms, "reps": a.reps, "from_thread": a.from_thread,
                                           "python": sys.version.split()[0], "waits": res}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
