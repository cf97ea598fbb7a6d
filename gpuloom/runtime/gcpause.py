"""Python garbage-collector pauses: measure them, and keep the loaded models out of them.

Why: a full collection stops every Python thread of the process -- the runtime's loop, the watchers,
the HTTP front end -- for as long as it takes to scan every tracked object. With the six mix6
models compiled (exported programs, FX graphs, executors: about 580,000 objects) one full collection
took 320-340 ms on the project's build machine, against 4-6 ms before loading them
(``docs/reports/runtime.md``). Such a pause turns into a latency spike for every request in flight.

* :func:`freeze_loaded` moves everything alive after a load into the permanent generation
  (``gc.freeze``), so later collections scan only what was created since. A full collection then
  took 0.0 ms on the same heap. Objects that die later by reference count are still freed; only
  cyclic garbage among frozen objects waits for :func:`thaw` (at an unload, and at close); after an
  unload, the next full collection frees it and freezes the rest again.
* :class:`RareFullCollections` makes automatic full collections 100x rarer while a service runs.
  Under load the requests alive at any moment (queues, payloads, futures) are tens of thousands of
  objects, and each full collection of them stopped the process for 53-75 ms on the build machine.
  On a fake device at mix6 x1 (``scripts/diag_dstack_realtime.py --small-tensors --tune-gc on,off``,
  ``docs/results/runtime/diag_gc_fake_small_cpu.json``) there were two such pauses per 3 s point,
  and dstack kept 0.957-0.966 of its requests within SLO; with this and the freeze, 0.996-0.999.
  Young garbage is still collected as before (generations 0 and 1); only cycles that survive both
  wait longer.
* :class:`GcMonitor` times every collection (``gc.callbacks``): count per generation, total and
  longest pause, so a benchmark point can say whether a pause hit it.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque


def freeze_loaded(*, collect: bool = True) -> None:
    """Freeze everything alive (after one full collection with ``collect``: a stop-the-world pause,
    for when nothing is being served).

    Without ``collect``, while an unload's :func:`thaw` waits for its full collection, nothing is
    frozen now: the unloaded model's cycles are still alive, uncollected, and freezing them here
    would keep them (and the weights they hold) for the life of the process. A load right after an
    unload did exactly that (2,250 objects frozen for good per unload/load cycle,
    ``scripts/diag_unload_memory.py``). The next full collection frees them and then freezes what
    survives (:func:`thaw`). With ``collect``, an unload's thaw during the collection likewise leaves
    the freezing to its own full collection.

    Freezing itself is one list splice. It does not count what it froze: ``gc.get_freeze_count()``
    walks the whole frozen list holding the GIL (67 ms for 6 million objects on the build machine),
    which stopped the served models at every load."""
    if collect:
        with _Refreeze.lock:
            epoch = _Refreeze.epoch
        gc.collect()
    with _Refreeze.lock:
        if (collect and _Refreeze.epoch != epoch) or (not collect and _Refreeze.pending):
            return
        _Refreeze.pending = False
        gc.freeze()


def thaw(*, refreeze: bool = False) -> None:
    """Return frozen objects to the collector. ``refreeze`` (an unload; a close while other services
    run): the unloaded model's cyclic garbage goes at the next full collection, which then freezes
    what survives, so the models still loaded are out of the collector's reach again, with no
    collection forced now while they are served. That collection scans the whole thawed heap once
    (the pause freeing the model needs; 167-370 ms in the soak's server on the build VM). Without
    ``refreeze`` (the last service's close) nothing is frozen again."""
    if refreeze:
        _Refreeze.install()
    with _Refreeze.lock:
        gc.unfreeze()
        _Refreeze.pending = refreeze
        _Refreeze.epoch += 1


def full_collection_awaited() -> bool:
    """Whether a thaw (an unload's) still waits for its full collection: False once one has run (or
    a load's collecting freeze), so whatever was unloaded before it has been freed."""
    with _Refreeze.lock:
        return _Refreeze.pending


class _Refreeze:
    """After an unload's thaw: freeze at the end of the next full collection (``gc.callbacks``).
    ``lock`` orders thaws and freezes across threads; the callback, which may run in any thread at
    any allocation (one holding ``lock`` included), only tries it, and leaves the freeze to the next
    full collection when it is taken. On an interpreter whose automatic collections never report
    generation 2, nothing is frozen again until a load finds nothing pending: no leak, only slower
    full collections."""

    pending = False
    epoch = 0  # thaws so far
    lock = threading.Lock()
    _installed = False
    _install_lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        with cls._install_lock:
            if not cls._installed:
                gc.callbacks.append(cls._after_collection)
                cls._installed = True

    @classmethod
    def _after_collection(cls, phase: str, info: dict) -> None:
        if phase != "stop" or info.get("generation") != 2 or not cls.pending:
            return
        if cls.lock.acquire(blocking=False):
            try:
                if cls.pending:
                    cls.pending = False
                    gc.freeze()  # between collections: the generations' lists are consistent
            finally:
                cls.lock.release()


class RareFullCollections:
    """While at least one holder is active, automatic full (generation 2) collections happen 100x
    less often (``gc.set_threshold``'s third value x100); the previous thresholds come back when the
    last holder leaves. Process-wide, counted, thread-safe."""

    FACTOR = 100
    _lock = threading.Lock()
    _holders = 0
    _saved: tuple[int, ...] | None = None

    @classmethod
    def enter(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = gc.get_threshold()
                t0, t1, t2 = cls._saved
                gc.set_threshold(t0, t1, t2 * cls.FACTOR)
            cls._holders += 1

    @classmethod
    def holders(cls) -> int:
        """Services holding the thresholds now (each ``InferenceService(tune_gc=True)`` while it runs)."""
        with cls._lock:
            return cls._holders

    @classmethod
    def leave(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders == 0 and cls._saved is not None:
                gc.set_threshold(*cls._saved)
                cls._saved = None


class GcMonitor:
    """Times the garbage collector's pauses in this process (installed once, shared)."""

    _instance: "GcMonitor | None" = None
    _install_lock = threading.Lock()

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation
        self.total_ms = 0.0
        self.max_ms = 0.0
        self._t0 = 0.0
        self.recent: deque = deque(maxlen=4096)  # (monotonic s at the end, generation, ms)

    @classmethod
    def installed(cls) -> "GcMonitor":
        """The process's monitor, installed in ``gc.callbacks`` on first use."""
        with cls._install_lock:
            if cls._instance is None:
                cls._instance = cls()
                gc.callbacks.append(cls._instance._callback)
            return cls._instance

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1000.0
        gen = int(info.get("generation", 0))
        self.collections[min(gen, 2)] += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)
        self.recent.append((time.monotonic(), gen, ms))

    def since(self, t: float) -> dict:
        """Pauses that ended after monotonic time ``t`` (s): count per generation, total and longest ms."""
        rows = [(g, ms) for end, g, ms in list(self.recent) if end > t]
        per = [0, 0, 0]
        for g, _ in rows:
            per[min(g, 2)] += 1
        return {"collections": per, "total_ms": sum(ms for _, ms in rows),
                "max_ms": max((ms for _, ms in rows), default=0.0)}

    def snapshot(self) -> dict:
        """Plain data: collections per generation, total pause ms, longest pause ms. (Not the number of
        frozen objects: counting them walks the frozen list under the GIL, about 6 ms at each metrics
        scrape with mix6 loaded; see :func:`freeze_loaded`.)"""
        return {"collections": list(self.collections), "total_ms": self.total_ms, "max_ms": self.max_ms}


__all__ = ["GcMonitor", "RareFullCollections", "freeze_loaded", "thaw"]
