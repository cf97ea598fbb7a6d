"""CPU time of this process's threads, by role: where the host's time goes under load.

Why: on the H200 the runtime's completions wait 0.6-0.9 ms per batch for the GIL (run 14,
``docs/reports/runtime.md``) while the CUDA wake-up itself takes 10-35 us
(``scripts/diag_wake.py``). Which threads keep the interpreter busy decides what to make cheaper.
Linux only (``/proc/self/task``); elsewhere :func:`thread_cpu` returns only the process total.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Callable

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def role(name: str) -> str:
    """A thread's role from its name: ``gpuloom-watch-p0`` -> ``gpuloom-watch``, ``Thread-3 (run)``
    -> ``Thread``; names without a counter or label stay as they are."""
    if name.startswith("gpuloom-"):
        return "-".join(name.split("-")[:2])
    return re.split(r"[- ]", name, maxsplit=1)[0]


def stat_cpu_s(path: str) -> float | None:
    """CPU seconds (user + system) from a ``/proc/<pid>/stat`` or ``/proc/self/task/<tid>/stat``
    file, or None when it cannot be read (the thread or process is gone)."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # after "pid (comm)": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def thread_cpu(key: Callable[[str], str] = role) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the live Python threads of this process, summed
    by ``key(thread name)`` (default :func:`role`), plus ``"process"``: the whole process, its
    threads outside Python (CUDA's, torch's) and those that already ended included."""
    out: dict[str, float] = {}
    for th in threading.enumerate():
        if th.native_id is None:
            continue
        secs = stat_cpu_s(f"/proc/self/task/{th.native_id}/stat")
        if secs is not None:
            k = key(th.name)
            out[k] = out.get(k, 0.0) + secs
    # the process last: its total then covers every thread's reading above, so between two
    # readings the process's share is never below a thread's (the threads keep running while
    # /proc is read, the longer the more threads there are)
    t = os.times()
    out["process"] = t.user + t.system
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """CPU seconds per second of wall time of each role between two :func:`thread_cpu` readings
    (1.0 = one core busy all the time); roles that appear in ``after`` only count from zero."""
    if wall_s <= 0:
        return {}
    return {k: round((v - before.get(k, 0.0)) / wall_s, 4) for k, v in sorted(after.items())}


__all__ = ["cpu_share", "role", "stat_cpu_s", "thread_cpu"]
