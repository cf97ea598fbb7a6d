"""Rings in shared memory between an HTTP front-end worker and the runtime's process: no bridge
thread wakes per request or per reply.

Why: behind ``--http-workers`` the runtime's process used to take each request off the worker's
Unix socket on a reader thread and send each reply on a writer thread. On the H200 those threads
used a third of an interpreter that was 83-86% busy (runs 71-74), mostly wake-ups and GIL hand-offs,
not work; sending replies from the runtime's own thread lost (run 73: every send releases the GIL).
Here a reply is written into a ring both processes map and the worker is woken through an eventfd,
both with the GIL held (``ctypes.PyDLL``): the runtime's thread gives the GIL away only if another
thread is writing a reply to the same worker at that moment (they share a lock). Requests go the
other way through a second ring. The worker posts the runtime loop's semaphore, which the runtime
passes it in its answer to the hello, and the loop's thread takes every request queued each time it
wakes (``InferenceService.add_intake``, ``bridge.InferBridge``); without such a loop, a semaphore
of the block's own wakes a drain thread per worker instead. ``scripts/diag_ring_bridge.py``
measured both on the CPU first, and ``docs/reports/serving.md`` (twenty-fourth session) on the H200.

One block per worker (an anonymous memory file, passed with the worker's hello like its arena):
the semaphore a drain thread would sleep on, then the request ring, then the reply ring. Each
ring has one producer and one consumer (the runtime's reply writers share one lock) and counts
bytes in two 64-bit cells, written only after what they publish. That order is what x86's memory
model keeps for plain stores (``supported`` is False elsewhere: the socket carries everything). A
frame that does not fit goes over the socket, which stays open for that and for the hello.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import threading
from typing import Callable, Sequence

_LINE = 64  # the semaphore and each index cell get a cache line of their own
_HEAD = 2 * _LINE  # a ring's index cells (tail: producer's, head: consumer's), then its bytes
_REC = 8  # record header: the record's length in bytes; records start 8-byte aligned
_WRAP = (1 << 64) - 1  # a header that says: the rest of the ring's end is empty, go on at its start
DEFAULT_KB = 8192


def supported() -> bool:
    """Shared rings need memfd, eventfd and ``sem_clockwait`` (Linux, glibc >= 2.30), and x86-64's
    store order (see the module's docstring)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not hasattr(os, "memfd_create") \
            or not hasattr(os, "eventfd"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return hasattr(libc, "sem_clockwait")


class ByteRing:
    """One producer's records to one consumer, in a region of shared memory (``_HEAD`` bytes of index
    cells, then the records). Records are never split: one that would cross the region's end leaves
    a wrap marker and starts over at the beginning."""

    def __init__(self, memory: memoryview) -> None:
        self.view = memory
        self.size = len(memory) - _HEAD
        if self.size < 64 or self.size % _REC:
            raise ValueError(f"a ring needs a multiple of {_REC} bytes, at least 64, after its header; got {self.size}")
        self._tail = ctypes.c_uint64.from_buffer(memory, 0)  # an aligned 8-byte store each: never torn
        self._head = ctypes.c_uint64.from_buffer(memory, _LINE)
        self._data = memory[_HEAD:]

    def put(self, parts: Sequence) -> bool:
        """Append one record made of ``parts`` (bytes-like, in order); False, and nothing written,
        when it does not fit in the free space."""
        n = sum(len(p) for p in parts)
        rec = (_REC + n + _REC - 1) // _REC * _REC
        tail = self._tail.value
        off = tail % self.size
        to_end = self.size - off
        need = rec if rec <= to_end else to_end + rec
        if rec > self.size or tail + need - self._head.value > self.size:
            return False
        data = self._data
        if rec > to_end:
            data[off:off + _REC] = _WRAP.to_bytes(_REC, "little")
            off = 0
        data[off:off + _REC] = n.to_bytes(_REC, "little")
        pos = off + _REC
        for p in parts:
            k = len(p)
            data[pos:pos + k] = p
            pos += k
        self._tail.value = tail + need  # last: the consumer reads nothing of the record before this
        return True

    def cells(self) -> tuple[ctypes.c_uint64, ctypes.c_uint64]:
        """The (head, tail) index cells themselves, for a consumer that checks many rings per loop
        step: ``head.value != tail.value`` is :meth:`pending` without a call."""
        return self._head, self._tail

    @property
    def head(self) -> int:
        """Bytes taken so far (it moves when the consumer takes a record)."""
        return self._head.value

    def pending(self) -> bool:
        """Whether a record is published and not yet taken (two loads: cheap enough per loop step)."""
        return self._head.value != self._tail.value

    def take(self, handle: Callable[[memoryview], None]) -> int:
        """Call ``handle`` on each record published when the call began, in order (the view is valid
        only during the call: its bytes are given back to the producer after it); returns how many.
        Records published meanwhile wait for the next call, so one call's work is bounded."""
        head, tail = self._head.value, self._tail.value
        data, size, count = self._data, self.size, 0
        while head < tail:
            off = head % size
            n = int.from_bytes(data[off:off + _REC], "little")
            if n == _WRAP:
                head += size - off
                self._head.value = head
                continue
            try:
                handle(data[off + _REC:off + _REC + n])
            finally:
                head += (_REC + n + _REC - 1) // _REC * _REC
                self._head.value = head
                count += 1
        return count

    def release(self) -> None:
        """Drop this ring's hold on the shared memory, so its mapping can be closed."""
        self._tail = self._head = None
        self._data.release()
        self.view.release()


class _Eventfd:
    """An eventfd written with the GIL held (``os.eventfd_write`` releases it: the runtime's thread
    must not). Non-blocking, so a write never waits."""

    _write = None

    def __init__(self, fd: int) -> None:
        if _Eventfd._write is None:
            lib = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _Eventfd._write = lib.write
            _Eventfd._write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
            _Eventfd._write.restype = ctypes.c_ssize_t
        self.fd = fd
        self._one = ctypes.c_uint64(1)

    def post(self) -> None:
        _Eventfd._write(self.fd, ctypes.byref(self._one), 8)

    def close(self) -> None:
        os.close(self.fd)


def _layout(total: int) -> tuple[int, int, int]:
    """(request ring's offset, reply ring's offset, end) in a block of about ``total`` bytes: an
    eighth for requests (their JSON only: the tensors are in the arena), the rest for replies."""
    req = max(4096, total // 8 // _LINE * _LINE)
    rep = max(4096, (total - _LINE - req) // _LINE * _LINE)
    return _LINE, _LINE + req, _LINE + req + rep


class WorkerRings:
    """The worker's end: makes the block (and the eventfd the runtime wakes it with), writes requests,
    reads replies. ``fds`` go to the runtime's process with the hello."""

    def __init__(self, total_bytes: int = DEFAULT_KB << 10) -> None:
        from ..runtime.waker import SemaphoreWaker
        from .arena import shared_file

        a, b, end = _layout(total_bytes)
        self.size = end
        self.fd, self.map = shared_file("gpuloom-rings", end)
        view = memoryview(self.map)
        self._sem_view = view[:_LINE]
        self.runtime_wake = SemaphoreWaker(self._sem_view, create=True)  # process-shared: the runtime waits on it
        self.requests, self.replies = ByteRing(view[a:b]), ByteRing(view[b:end])
        view.release()
        self.event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the runtime posts it per reply

    @property
    def fds(self) -> list[int]:
        return [self.fd, self.event_fd]

    def send(self, parts: Sequence) -> bool:
        """Queue one request frame and wake its consumer (``runtime_wake``: the runtime loop's
        semaphore once the runtime passed it, else the block's own); False when the ring is full."""
        if not self.requests.put(parts):
            return False
        self.runtime_wake.post_unless_quiet()  # (the runtime's loop may have said it looks anyway: intake window)
        return True

    def take_replies(self, handle: Callable[[memoryview], None]) -> int:
        """Every reply frame published so far, after clearing the eventfd (a reply published after the
        clear posts it again, so none is left behind)."""
        try:
            os.eventfd_read(self.event_fd)
        except BlockingIOError:
            pass
        return self.replies.take(handle)

    def close(self) -> None:
        os.close(self.event_fd)
        self.requests.release()
        self.replies.release()
        self._sem_view.release()  # the semaphore's ctypes object may still hold the mapping: then it stays
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


_deferred = threading.local()  # .rings: the RuntimeRings written to inside one_post_per_worker, or None


class one_post_per_worker:  # noqa: N801 - used as a function: ``with one_post_per_worker(): ...``
    """Within, on this thread, :meth:`RuntimeRings.reply` writes its frames but wakes each worker once,
    on the way out, instead of once per reply. Why: the eventfd's ``write`` was about half of the
    runtime thread's cost per reply (59 of 125 samples, ``docs/reports/serving.md``), and a batch's
    rows often go to the same worker. The post comes after every frame it covers, so the worker,
    which clears the eventfd before it reads the ring, misses none. Nested, the outermost posts.
    A class, not a generator: entering and leaving cost the build VM 3-4 us a batch, not 7-8."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = getattr(_deferred, "rings", None) is None
        if self._outer:
            _deferred.rings = {}

    def __exit__(self, *exc) -> None:
        if self._outer:
            touched, _deferred.rings = _deferred.rings, None
            for rings in touched.values():
                rings.post()


WAKEUPS = ("batch", "reply")  # InferBridge(wakeups=...): a worker woken once per batch, or per reply
COALESCE_FROM_ROWS = 8  # ... once per batch from this many rows (scripts/diag_reply_posts.py, below)
_NO_SCOPE = contextlib.nullcontext()


def batch_replies(rows: int) -> "one_post_per_worker | contextlib.nullcontext":
    """``InferenceService.answer_scope`` for ``wakeups="batch"``: :class:`one_post_per_worker` around
    the answers of a batch of ``COALESCE_FROM_ROWS`` rows or more, nothing around smaller ones. On the
    build VM (``scripts/diag_reply_posts.py``, 8 workers, fifty-second session) the scope cost a
    one-row batch 9-18% more of the runtime thread's time for its replies, about none at 4 rows, and
    saved 7-8% at 8 rows and 18-30% at 16 (16 posts became 7), while the batch's first worker was
    woken 0.09-0.16 ms later (at the batch's end instead of after its first reply)."""
    return one_post_per_worker() if rows >= COALESCE_FROM_ROWS else _NO_SCOPE


def each_reply(rows: int) -> contextlib.nullcontext:
    """``InferenceService.answer_scope`` for ``wakeups="reply"``: every reply wakes its worker at once."""
    return _NO_SCOPE


class RuntimeRings:
    """The runtime process's end of one worker's block: waits for requests, writes replies. Replies
    may come from several threads (the runtime's, the drain thread's errors): they share a lock."""

    def __init__(self, fd: int, event_fd: int, size: int) -> None:
        import threading

        from ..runtime.waker import SemaphoreWaker
        from .arena import attach

        a, b, end = _layout(size)
        if end != size:
            os.close(fd)
            os.close(event_fd)
            raise ValueError(f"ring block of {size} bytes does not have the layout of one (would be {end})")
        try:
            self._map = attach(fd, size, "ring block")  # closes fd
        except BaseException:
            os.close(event_fd)
            raise
        view = memoryview(self._map)
        self.wake = SemaphoreWaker(view[:_LINE], create=False)
        self.requests, self.replies = ByteRing(view[a:b]), ByteRing(view[b:end])
        view.release()
        self._worker = _Eventfd(event_fd)
        self._lock = threading.Lock()
        self._open = True

    @property
    def open(self) -> bool:
        return self._open

    def reply(self, parts: Sequence) -> bool:
        """Write one reply frame and wake the worker; False when it does not fit (or the worker's end
        is closed): the caller sends it over the socket instead."""
        with self._lock:
            if not self._open or not self.replies.put(parts):
                return False
            touched = getattr(_deferred, "rings", None)
            if touched is None:
                self._worker.post()
            else:  # inside one_post_per_worker: posted once, on its way out
                touched[id(self)] = self
            return True

    def post(self) -> None:
        """Wake the worker (its replies are in the ring); nothing once the worker's end is closed."""
        with self._lock:
            if self._open:
                self._worker.post()

    def close(self) -> None:
        """No more replies; the eventfd is closed under the lock, so no writer posts a reused number."""
        with self._lock:
            if self._open:
                self._open = False
                self._worker.close()
        self.wake.post()  # the drain thread wakes, sees the connection closed, and ends


__all__ = ["ByteRing", "COALESCE_FROM_ROWS", "DEFAULT_KB", "RuntimeRings", "WAKEUPS", "WorkerRings", "batch_replies",
           "each_reply", "one_post_per_worker", "supported"]
