"""A short GIL hand-off interval while a service runs (``sys.setswitchinterval``).

Why: the runtime's loop thread calls into torch and CUDA many times per batch (copies, the graph's
replay, events), and each call releases the GIL. When another thread of the process is busy in
Python at that moment (the load generator, an in-process HTTP server, a bridge thread, a stage copy),
it takes the GIL, and the loop thread gets it back only when that thread blocks or its switch
interval runs out: 5 ms by default. This is CPython's convoy effect. On the build machine a thread
making a 20 us GIL-releasing call in a loop took 750-980 us per call next to one busy Python thread
with the default interval, and 3-60 us with 0.2-1 ms (``scripts/diag_gil_convoy.py``). On the H200
(``docs/reports/runtime.md``) dstack's partitions idled 0.4-1.0 ms between batches, growing with load,
and the loop thread fell more than 1 ms behind 600-800 times in each 5 s point.

**Off by default** (``InferenceService(switch_interval_ms=None)``). On the H200's host the effect is
far worse than on the build machine -- 9-14 ms per call at 5 ms, still 0.8-1.0 ms at 0.5 ms
(``docs/results/runtime/diag_gil_convoy_h200.json``) -- and a short interval did not help there:
dstack's bench A/B (run 9) was unchanged, and behind ``--http-workers 4`` the 6-model mix over HTTP
kept 0.66 of its in-process goodput at x0.1 with 0.5 ms against 0.997 without it, because every
forced hand-off between the runtime's threads and the four bridge threads costs a wake-up.

The interval is process-wide: the first holder sets it, the last one to leave restores it.
"""

from __future__ import annotations

import sys
import threading

DEFAULT_MS: float | None = None  # InferenceService's default: leave the interpreter alone (see above)


def check_interval_ms(ms: float) -> float:
    """``ms`` unchanged, or ValueError unless it is a number in (0, 100]."""
    if not (isinstance(ms, (int, float)) and 0 < ms <= 100):
        raise ValueError(f"switch_interval_ms must be a number in (0, 100] ms, got {ms!r}")
    return ms


class ShortSwitchInterval:
    """While at least one holder is active, the interpreter's switch interval is at most the shortest
    one asked for; the previous value comes back when the last holder leaves. Thread-safe."""

    _lock = threading.Lock()
    _held: list[float] = []  # the intervals asked for by the active holders, s
    _saved: float | None = None

    @classmethod
    def enter(cls, ms: float) -> None:
        check_interval_ms(ms)
        with cls._lock:
            if not cls._held:
                cls._saved = sys.getswitchinterval()
            cls._held.append(ms / 1000.0)
            sys.setswitchinterval(min(min(cls._held), cls._saved))

    @classmethod
    def leave(cls, ms: float) -> None:
        with cls._lock:
            try:
                cls._held.remove(ms / 1000.0)
            except ValueError:
                return
            if cls._held:
                sys.setswitchinterval(min(min(cls._held), cls._saved))
            elif cls._saved is not None:
                sys.setswitchinterval(cls._saved)
                cls._saved = None


__all__ = ["DEFAULT_MS", "ShortSwitchInterval", "check_interval_ms"]
