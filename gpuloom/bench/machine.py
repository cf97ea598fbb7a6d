"""What machine a benchmark ran on, and how fast its host was, measured in a fraction of a second.

Why: on the H200 one lent machine ran every policy slower than another, triton as much as dstack
(runs 57-58 against 53-54 and 59-60: completions came back 1.0-1.3 ms after their batch instead of
0.4-0.6), and nothing in the reports said which machine or why. A bench report now carries the
host's CPU model and core count and three quick probes, so that figures from two machines can be
told apart, and a slow host shows before its figures are compared:

* ``python_loop_us``: one pure-Python loop of 100,000 additions (the interpreter's speed);
* ``thread_wake_us``: the median round trip of a wake-up between two threads (what every hand-off
  between the service's threads pays);
* ``cuda_sync_us`` (CUDA only, given a ``sync`` callable): the median of an empty synchronize on the
  GPU's stream, a floor on how soon the host sees a batch end.

Each probe is a median of a few repeats, so a single preemption does not decide it. No torch here:
the caller passes the CUDA synchronize.

Beside them, ``gpuloom_settings``: the process's ``GPULOOM_*`` settings, so that a report says which leg
of an A/B it was.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from typing import Callable, Mapping

LOOP_N = 100_000


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def python_loop_us(repeats: int = 5) -> float:
    """Median µs of a pure-Python loop of :data:`LOOP_N` additions."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc = 0
        for i in range(LOOP_N):
            acc += i
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def thread_wake_us(round_trips: int = 200) -> float:
    """Median µs for one thread to wake another and be woken back (a ``threading.Event`` ping-pong)."""
    ping, pong = threading.Event(), threading.Event()
    stop = False

    def echo() -> None:
        while True:
            ping.wait()
            ping.clear()
            if stop:
                return
            pong.set()

    t = threading.Thread(target=echo, name="gpuloom-wake-probe", daemon=True)
    t.start()
    times = []
    try:
        for _ in range(round_trips):
            t0 = time.perf_counter()
            ping.set()
            if not pong.wait(1.0):  # the echo thread was starved for a second: report that, not hang
                times.append(1e6)
                continue
            pong.clear()
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        stop = True
        ping.set()
        t.join(1.0)
    return statistics.median(times)


def sync_us(sync: Callable[[], None], repeats: int = 200) -> float:
    """Median µs of ``sync()`` (e.g. ``torch.cuda.synchronize`` with nothing queued)."""
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def describe_machine(sync: Callable[[], None] | None = None) -> dict:
    """The host's CPU, core count and speed probes (module docstring), as plain data for a report."""
    out = {"cpu": cpu_model(), "cpus": os.cpu_count() or 0,
           "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0,
           "python": platform.python_version(),
           "python_loop_us": round(python_loop_us(), 1), "thread_wake_us": round(thread_wake_us(), 1)}
    if sync is not None:
        out["cuda_sync_us"] = round(sync_us(sync), 1)
    return out


#: the environment variables that only say where gpuloom keeps files, left out of :func:`gpuloom_settings`
PATH_SETTINGS = ("GPULOOM_GRAPH_CACHE", "GPULOOM_PROFILE_CACHE")


def gpuloom_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process-wide ``GPULOOM_*`` settings in effect (``GPULOOM_LAUNCH_FIRST``,
    ``GPULOOM_YIELD_ANSWERS``, ...), not the cache paths, sorted by name: a report whose figures an
    A/B of such a setting moved says which leg it was (runs 202-203's legs differed by 29-43% with
    ``GPULOOM_YIELD_ANSWERS``, and their reports did not say so). ``GPULOOM_YIELD_ANSWERS`` is there
    set or not (its default, on since the sixty-fifth session): a report without it ran before, with
    the option off."""
    from ..runtime.core import YIELD_DEFAULT

    env = os.environ if environ is None else environ
    got = {k: env[k] for k in env if k.startswith("GPULOOM_") and k not in PATH_SETTINGS}
    got.setdefault("GPULOOM_YIELD_ANSWERS", YIELD_DEFAULT)
    return dict(sorted(got.items()))


def summary(machine: dict) -> str:
    """One line for a bench's output."""
    line = (f"host: {machine.get('cpu', '?')}, {machine.get('usable_cpus', '?')} CPUs; python loop "
            f"{machine.get('python_loop_us', float('nan')):.0f} us, thread wake-up {machine.get('thread_wake_us', float('nan')):.0f} us")
    if "cuda_sync_us" in machine:
        line += f", CUDA synchronize {machine['cuda_sync_us']:.0f} us"
    return line
