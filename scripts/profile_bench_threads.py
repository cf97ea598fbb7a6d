#!/usr/bin/env python
"""Where the runtime's threads spend their CPU during ``gpuloom bench`` (cProfile per thread).

Why: on the H200 the runtime's loop thread used 0.6 CPU-s per s at 2,258 requests/s of mix6 (about
275 us per request) when it also submitted the requests (``arrivals=loop``), against about 110 us
on the build VM with a fake device. This runs a bench with the loop thread (``Runtime._serve``) and
each completion watcher (``_Watcher._run``) under cProfile and prints the top functions of each, by
own time and by cumulative time. Profiling slows Python by 1.5-2x: compare shares, not absolutes.

    python3 scripts/profile_bench_threads.py --out prof.txt -- examples/mix6.yaml \\
        --policy dstack:pinned_inputs=true:arrivals=loop --scale 0.5 --duration 5 --no-simulate
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the report here as well")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then gpuloom bench's arguments")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args

    import gpuloom.runtime.core as core
    import gpuloom.runtime.exec_backend as eb

    profiles: dict[str, list[cProfile.Profile]] = {}

    def wrap(cls, name: str, key: str) -> None:
        real = getattr(cls, name)

        def profiled(self, *args, **kw):
            p = cProfile.Profile()
            profiles.setdefault(key, []).append(p)
            return p.runcall(real, self, *args, **kw)

        setattr(cls, name, profiled)

    wrap(core.Runtime, "_serve", "runtime loop")
    wrap(eb._Watcher, "_run", "watchers")
    from gpuloom.cli import main as cli_main

    rc = cli_main(["bench", *bench_args])
    report = io.StringIO()
    for key, ps in profiles.items():
        st = pstats.Stats(ps[0], stream=report)
        for p in ps[1:]:
            st.add(p)
        for order in ("tottime", "cumulative"):
            report.write(f"===== {key} ({len(ps)} thread(s)), by {order}\n")
            st.sort_stats(order).print_stats(a.top)
    text = report.getvalue()
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return rc or 0


if __name__ == "__main__":
    raise SystemExit(main())
