"""Shared memory between an HTTP front-end worker and the runtime's process (``--http-workers``).

Why: behind the workers, the runtime's process still received every request's tensors over its
Unix socket (600 KB per mix6 image) on bridge threads that share its interpreter with the runtime's
loop. On the H200 at mix6 x0.25 the service's own queue grew 6-10x when the same arrivals came that
way (``docs/reports/serving.md``). With an arena the worker copies the tensors into memory both
processes map, and the socket carries only a small frame naming where they are. The runtime's
process reads them in place.

One arena per worker connection: an anonymous memory file (``memfd_create``) the worker creates and
maps, and passes to the runtime's process with the connection's first message (``SCM_RIGHTS``). The
memory goes when both have closed it, so nothing can leak a name in ``/dev/shm``. The worker owns
the allocation (first fit, coalescing on free). A block is freed when the request's reply comes
back, so the runtime never sees its input change while it may still read it. A request that does
not fit (arena full, or bigger than the arena) goes inline over the socket as before.
"""

from __future__ import annotations

import bisect
import mmap
import os

ALIGN = 64  # blocks start on cache-line boundaries (and satisfy any tensor dtype's alignment)
DEFAULT_BYTES = 256 << 20


def supported() -> bool:
    return hasattr(os, "memfd_create")


class Arena:
    """The worker's end: an anonymous shared mapping and a first-fit allocator over it."""

    def __init__(self, size: int = DEFAULT_BYTES) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self.fd, self.map = shared_file("gpuloom-arena", size)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset, coalesced
        self._used: dict[int, int] = {}  # offset -> length of each allocated block
        self.in_use = 0

    def alloc(self, n: int) -> int | None:
        """Offset of a block of at least ``n`` bytes, or None when no free range is big enough."""
        need = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                self.in_use += need
                return off
        return None

    def free(self, off: int) -> None:
        """Return a block; neighbouring free ranges merge. Freeing an unknown offset is an error."""
        length = self._used.pop(off)
        self.in_use -= length
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + length == self._free[i][0]:  # merge with the next range
            length += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and with the previous
            prev_off, prev_len = self._free[i - 1]
            self._free[i - 1] = (prev_off, prev_len + length)
        else:
            self._free.insert(i, (off, length))

    def view(self, off: int, n: int) -> memoryview:
        return memoryview(self.map)[off:off + n]

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        os.close(self.fd)


def shared_file(name: str, size: int) -> tuple[int, mmap.mmap]:
    """An anonymous memory file of ``size`` bytes and this process's mapping of it: the worker's end
    of an arena, or of its rings (``ring.py``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def attach(fd: int, size: int, what: str = "arena") -> mmap.mmap:
    """The runtime process's end: map the worker's arena (or other ``what``) from the descriptor it
    passed (then closed here: the mapping keeps the memory)."""
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{what} descriptor is {os.fstat(fd).st_size} bytes, the worker said {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


__all__ = ["ALIGN", "Arena", "DEFAULT_BYTES", "attach", "shared_file", "supported"]
