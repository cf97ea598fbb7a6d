"""Page-locked buffers lent to requests and taken back when the last view of them dies.

``CudaDeviceLayer(outputs="views")`` hands each request a view of its batch's page-locked output buffer
instead of a copy; these keep that cheap and bounded: a :class:`BufferPool` makes each buffer once and
lends it again, :class:`LiveBytes` caps what callers may hold, and :func:`lease_views` does both for one
batch. Pure Python (numpy inside :func:`lease_views`); the CUDA layer supplies the buffers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence


class LiveBytes:
    """Bytes of buffers handed out and still referenced, under a limit: ``reserve`` before handing one
    out (False over the limit), ``release`` when it is freed (``BufferPool.lend``'s ``on_free``, in
    whichever thread that happens) or was never handed out. ``outputs="views"`` holds its page-locked
    output buffers to it, so callers keeping outputs cannot page-lock the host's memory without bound:
    over the limit a batch copies instead."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.live = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.live + nbytes > self.limit:
                return False
            self.live += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


class BufferPool:
    """Buffers made once and lent again and again: :meth:`take` gives a free buffer made for a
    signature (e.g. shape and dtype), or makes one; :meth:`lend` takes it back once the array handed
    out over it, and every view onto that array, is freed (in whichever thread that happens).

    Why: ``outputs="views"`` gave every batch fresh page-locked output buffers from torch's caching
    host allocator, 0.07-0.13 ms per launch on the H200 (run 70's ``alloc``), on the runtime's thread;
    views then cost more dispatch time than the copies they save (5.5-5.9% of GPU busy time against
    3.1-3.3%). A buffer taken back here is reused by the next batch of its shape with no allocator
    call. At most ``max_free_bytes`` of free buffers are kept (one given back beyond that is dropped,
    and so freed), and none once the pool is closed.
    """

    def __init__(self, max_free_bytes: float = float("inf")) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[Any, list[tuple[Any, int]]] = {}  # signature -> [(buffer, bytes)]
        self._free_bytes = 0
        self._closed = False
        self._lock = threading.RLock()  # a give-back can run inside take (a finalizer the GC fires)
        self.made = 0
        self.reused = 0
        self.dropped = 0  # buffers given back over max_free_bytes, or after close: freed

    def take(self, signature: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            free = self._free.get(signature)
            if free:
                self.reused += 1
                buf, nbytes = free.pop()
                self._free_bytes -= nbytes
                return buf
        buf = make()  # outside the lock: an allocation can take milliseconds
        with self._lock:
            self.made += 1
        return buf

    def give_back(self, signature: Any, buf: Any, nbytes: int = 0) -> None:
        """``buf`` (``nbytes`` long) is free again: nothing handed out reads or writes it any more."""
        with self._lock:
            if self._closed or self._free_bytes + nbytes > self.max_free_bytes:
                self.dropped += 1
                return
            self._free.setdefault(signature, []).append((buf, nbytes))
            self._free_bytes += nbytes

    def lend(self, signature: Any, buf: Any, array: Any, nbytes: int = 0,
             on_free: Callable[[int], Any] | None = None) -> None:
        """``buf`` comes back when ``array`` (a numpy array over ``buf`` whose views keep it alive) is
        freed; then ``on_free(nbytes)`` runs, if given (one finalizer for both: each costs microseconds)."""
        weakref.finalize(array, self._back, signature, buf, nbytes, on_free)

    def _back(self, signature: Any, buf: Any, nbytes: int, on_free: Callable[[int], Any] | None) -> None:
        self.give_back(signature, buf, nbytes)
        if on_free is not None:
            on_free(nbytes)

    def free_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())

    def close(self) -> None:
        """Free the free buffers, and every buffer given back from now on."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._free_bytes = 0


def lease_views(pool: BufferPool, budget: "LiveBytes", like: Sequence[Any],
                make: Callable[[int], Any]) -> tuple[list[Any], list[Any]] | str:
    """Buffers for one batch's outputs shaped as the numpy arrays ``like`` (``make(i)`` makes one for
    ``like[i]``: an object with a ``memory`` memoryview of its bytes), and a fresh numpy array over
    each, lent (:meth:`BufferPool.lend`) and held to ``budget``. Or why not (a str): over the budget,
    or a ``make`` that ran out of memory (RuntimeError saying "out of memory"; any other error is raised).

    Each array is made with ``np.frombuffer`` over the buffer's memoryview, so its base is no array:
    every view handed out of it, reshaped or sliced, keeps it (and so the lease) alive, and the buffer
    comes back only when the last one dies. (``np.ndarray(buffer=...)`` would not do: numpy makes the
    buffer's own array the base, which the pool keeps, and the lease would end at once.)"""
    import numpy as np

    total = sum(a.nbytes for a in like)
    if not budget.reserve(total):
        return (f"the views still held take {budget.live / 2**20:.0f} MiB of at most "
                f"{budget.limit / 2**20:.0f} (views_max_bytes)")
    sigs = [(a.shape, a.dtype) for a in like]
    bufs: list[Any] = []
    try:
        for i, sig in enumerate(sigs):
            bufs.append(pool.take(sig, lambda i=i: make(i)))
    except RuntimeError as e:
        for a, sig, buf in zip(like, sigs, bufs):  # never handed out: free again at once
            pool.give_back(sig, buf, a.nbytes)
        budget.release(total)
        if "out of memory" not in str(e).lower():
            raise  # a CUDA error, not a lack of page-locked memory: the batch fails with it
        return f"no page-locked memory for a batch's outputs ({e})"
    arrays = []
    for a, sig, buf in zip(like, sigs, bufs):
        flat = np.frombuffer(buf.memory, a.dtype)
        arrays.append(flat.reshape(a.shape))
        pool.lend(sig, buf, flat, a.nbytes, budget.release)
    return bufs, arrays


__all__ = ["BufferPool", "LiveBytes", "lease_views"]
