#!/usr/bin/env python
"""Where the runtime's threads spend their time during ``gpuloom bench`` (a stack sampler).

Why: on the H200 the runtime's loop thread used 0.6 CPU-s per s at 2,258 requests/s of mix6 (about
275 us per request) when it also submitted the requests (``arrivals=loop``), against about 110 us
on the build VM with a fake device, and the host's Python is as fast as the VM's
(``docs/results/runtime/host_speed_h200_session8.json``). This runs a bench while a sampler thread
reads every thread's stack (``sys._current_frames``) ``--hz`` times a second, and prints per group of
threads (runtime loop, watchers, main, others) the functions most often on top of the stack (own
time) and anywhere on it (cumulative), as a share of that group's samples.

Samples are wall time, not CPU time: a thread blocked on a lock, the GIL, a semaphore or the GPU is
counted where it blocks (cProfile per thread would count CPU, but Python 3.12 allows one profiler
per process). The sampler takes the GIL ``--hz`` times a second: keep it at a few hundred.

    python3 scripts/profile_bench_threads.py --out prof.txt -- examples/mix6.yaml \\
        --policy dstack:pinned_inputs=true:arrivals=loop --scale 0.5 --duration 5 --no-simulate
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUPS = (("gpuloom-runtime", "runtime loop"), ("gpuloom-watch", "watchers"), ("MainThread", "main"))


def group_of(thread_name: str) -> str:
    for prefix, group in GROUPS:
        if thread_name.startswith(prefix):
            return group
    return "other"


class StackSampler:
    """Counts, per group of threads, the functions on top of each stack and anywhere on it."""

    def __init__(self, hz: float) -> None:
        self.period = 1.0 / hz
        self.samples: Counter = Counter()  # group -> samples taken
        self.own: dict[str, Counter] = defaultdict(Counter)
        self.cumulative: dict[str, Counter] = defaultdict(Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = group_of(names.get(ident, "?"))
                self.samples[group] += 1
                seen = set()
                top = True
                while frame is not None:
                    code = frame.f_code
                    key = f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"
                    if top:
                        self.own[group][key] += 1
                        top = False
                    if key not in seen:
                        seen.add(key)
                        self.cumulative[group][key] += 1
                    frame = frame.f_back

    def report(self, top: int) -> str:
        lines = []
        for group, n in self.samples.most_common():
            for title, counts in (("own", self.own[group]), ("cumulative", self.cumulative[group])):
                lines.append(f"===== {group}: {n} samples, by {title} (share of the group's samples)")
                for key, c in counts.most_common(top):
                    lines.append(f"  {c / n:6.1%}  {key}")
        return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the report here as well")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--hz", type=float, default=250.0, help="samples per second (default 250)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then gpuloom bench's arguments")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    from gpuloom.cli import main as cli_main

    sampler = StackSampler(a.hz)
    sampler.start()
    t0 = time.monotonic()
    try:
        rc = cli_main(["bench", *bench_args])
    finally:
        sampler.stop()
    text = f"# {time.monotonic() - t0:.0f} s sampled at {a.hz:g} Hz: gpuloom bench {' '.join(bench_args)}\n"
    text += sampler.report(a.top)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return rc or 0


if __name__ == "__main__":
    raise SystemExit(main())
