"""Which CPUs the runtime's process runs on (``taskset -c`` from inside).

Why: the runtime's process is GIL-bound, with a dozen Python threads (the loop, one watcher per
partition, bridge readers and writers, a client). On the H200's 16-core host its threads used many
times the CPU per request that they use alone: a thread woken on another core, finding the GIL
taken, goes back to sleep, and the hand-offs cost more than the work. Confining the process to one
or two cores is the classic way to see whether that is what happens (``gpuloom serve --cpus``,
the bench's ``cpus=`` variant key). No torch here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def parse_cpus(text: str) -> set[int]:
    """A CPU list as ``taskset -c`` takes it (``1``, ``0,2-3``; ``+`` may stand for ``,`` where a
    comma would split a longer list) as a set of CPU numbers; ValueError otherwise."""
    cpus: set[int] = set()
    try:
        for part in text.replace("+", ",").split(","):
            lo, dash, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if dash else int(lo)  # "1-" is no range
            if a < 0 or b < a:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        raise ValueError(f"expected a CPU list like '1' or '0,2-3', got {text!r}")
    return cpus


def pin_process(cpus: set[int]) -> None:
    """Run every thread of this process on ``cpus``: those alive now (e.g. a BLAS pool started at
    import) and, as threads inherit it, those started later."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # it ended meanwhile
            pass
    os.sched_setaffinity(0, cpus)


def pin_apart(cpus: set[int]) -> set[int]:
    """Pin this process to ``cpus`` (:func:`pin_process`); returns the CPUs it could use before that
    are not in ``cpus`` (all of them where none is left): where its helper processes (front-end
    workers, load clients) should run rather than inherit the pin."""
    everything = os.sched_getaffinity(0)
    pin_process(cpus)
    return (everything - cpus) or everything


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Every thread of the process on ``cpus`` inside the block (nothing changes for None); the CPUs
    the calling thread had before are every thread's again afterwards."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)


__all__ = ["parse_cpus", "pin_apart", "pin_process", "pinned"]
