#!/usr/bin/env python
"""Where a process's CPU goes, thread by thread: run a module under cProfile in every thread.

The light3 bench is bound by the host (its interpreter at ~1 core-s per s on the H200, runs 41-45);
this names the functions that hold it. cProfile slows Python down, so read the shares, not the
attainment of the profiled run. From Python 3.12 cProfile profiles one thread at a time per
interpreter (run 46 failed with "Another profiling tool is already active"): there, name one thread
with ``--threads PREFIX`` (e.g. ``gpuloom-runtime``) and profile the others in other runs.

    python scripts/profile_threads.py --out DIR -- gpuloom.cli bench examples/light3.yaml --policy dstack --scale 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import runpy
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROFILES: list[tuple[str, cProfile.Profile]] = []  # (thread name, its profile), in start order
_LOCK = threading.Lock()
#: the profiles' clock: None is cProfile's wall clock, under which a thread waiting for the GIL
#: charges the wait to the function it was in; ``time.thread_time`` charges CPU time only (slower)
TIMER = None


def _new_profile() -> cProfile.Profile:
    return cProfile.Profile(TIMER) if TIMER else cProfile.Profile()


def install(workers: str | None, main: bool = True) -> cProfile.Profile | None:
    """Profile every thread started from now on whose name starts with ``workers`` ("" = every
    thread, None = none; each its own profile); with ``main``, return the main thread's profile
    (not yet enabled)."""
    run = threading.Thread.run

    def profiled(self):
        if workers is None or not self.name.startswith(workers):
            return run(self)
        prof = _new_profile()
        with _LOCK:
            PROFILES.append((self.name, prof))
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled
    if not main:
        return None
    prof = _new_profile()
    PROFILES.append(("MainThread", prof))
    return prof


def _report(out: Path, top: int) -> str:
    """Merge profiles by thread name prefix (one watcher per partition -> gpuloom-watch), write
    ``<name>.prof`` and return the top functions by own time, with each thread's CPU-bound share."""
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[cProfile.Profile]] = {}
    for name, prof in PROFILES:
        key = "gpuloom-watch" if name.startswith("gpuloom-watch") else name
        groups.setdefault(key, []).append(prof)
    text = []
    for key, profs in sorted(groups.items()):
        profs = [p for p in profs if p.getstats()]  # a thread that never ran under it
        if not profs:
            continue
        st = pstats.Stats(profs[0], stream=io.StringIO())
        for p in profs[1:]:
            st.add(p)
        st.dump_stats(str(out / f"{key}.prof"))
        buf = io.StringIO()
        st.stream = buf
        st.sort_stats("tottime").print_stats(top)
        text.append(f"=== thread {key} ({len(profs)}): {st.total_tt:.2f} s profiled\n" +
                    "\n".join(buf.getvalue().splitlines()[6:]))
    return "\n".join(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <thread>.prof and top.txt")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", default=None, metavar="PREFIX",
                    help="profile only the threads whose name starts with PREFIX, 'MainThread' for the main one "
                         "(default: all of them, which needs Python < 3.12)")
    ap.add_argument("--main-in", default="gpuloom.bench.e2e:run_point", metavar="MODULE:FUNC",
                    help="profile the main thread only inside this function (default: a bench point, not the "
                         "compile before it); '' for all of it")
    ap.add_argument("module", nargs=argparse.REMAINDER, help="-- MODULE ARGS... (run like python -m)")
    a = ap.parse_args()
    mod = [x for x in a.module if x != "--"] if a.module[:1] == ["--"] else a.module
    if not mod:
        ap.error("give a module to run after --")
    if a.threads is None and sys.version_info >= (3, 12):
        ap.error("Python 3.12+ runs one cProfile at a time: name one thread with --threads PREFIX "
                 "(MainThread, gpuloom-runtime, gpuloom-watch, ...)")
    # default: every thread; MainThread: that one alone; a prefix: those worker threads alone
    workers = None if a.threads == "MainThread" else (a.threads or "")
    main_prof = install(workers, main=a.threads in (None, "MainThread"))
    if a.main_in and main_prof is not None:  # wrap it before the module imports it by name
        import functools
        import importlib

        modname, func = a.main_in.split(":")
        owner = importlib.import_module(modname)
        inner = getattr(owner, func)

        @functools.wraps(inner)
        def within(*args, **kwargs):
            main_prof.enable()
            try:
                return inner(*args, **kwargs)
            finally:
                main_prof.disable()

        setattr(owner, func, within)
    sys.argv = mod
    rc = 0
    if main_prof is not None and not a.main_in:
        main_prof.enable()
    try:
        runpy.run_module(mod[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 0
    finally:
        if main_prof is not None:
            main_prof.disable()
    text = _report(Path(a.out), a.top)
    (Path(a.out) / "top.txt").write_text(text)
    print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
