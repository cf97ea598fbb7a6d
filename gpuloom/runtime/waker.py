"""How the runtime's loop thread sleeps and is woken: by other threads, or by the GPU itself.

Why: a batch's completion used to reach the loop through a watcher thread per partition: the
blocking-sync event wakes the watcher, the watcher waits for the GIL, books the batch and posts it,
and the loop thread wakes and waits for the GIL in turn. On the H200 that way back cost 0.6-0.8 ms
per batch (run 13, ``docs/reports/runtime.md``), as much as a small batch's device time. A
:class:`SemaphoreWaker` is a POSIX semaphore the loop sleeps on; besides Python threads, a CUDA
stream can post it with ``cuLaunchHostFunc(stream, sem_post, &sem)`` (:attr:`SemaphoreWaker.c_post`),
so a finished batch wakes the loop directly, with no Python thread in between.

:class:`EventWaker` (a ``threading.Event``) is the fallback where libc has no ``sem_clockwait``; it
has no C entry point, so completions then go through the watchers. Neither imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time

_CLOCK_MONOTONIC = 1  # Linux; time.monotonic() reads the same clock


class EventWaker:
    """``post`` from any thread; ``wait`` on one thread (the loop's). No C entry point."""

    c_post: tuple[int, int] | None = None
    share_fd: int | None = None  # no other process can post it

    def __init__(self) -> None:
        self._event = threading.Event()

    def close(self) -> None:
        pass

    def post(self) -> None:
        self._event.set()

    def quiet_until(self, t_s: float) -> None:  # (no other process posts it: nothing to quieten)
        pass

    post_unless_quiet = post

    def wait(self, timeout_s: float | None) -> None:
        """Return after a post (also one made before this call) or after ``timeout_s``."""
        self._event.wait(timeout_s)
        self._event.clear()  # posts made after this are seen by the caller's next look, or wake the next wait


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class SemaphoreWaker:
    """A POSIX semaphore the loop sleeps on (``sem_clockwait`` on the monotonic clock, GIL released).

    ``c_post`` is ``(address of sem_post, address of the semaphore)``: a C caller (a CUDA host
    function) posts it without Python. The semaphore's memory is never freed: a host function
    enqueued on a stream may still run after its loop is gone, and must not post freed memory.
    """

    _keep: list = []  # every private and loop semaphore ever made (a few dozen bytes each), see above

    def __init__(self, memory=None, *, create: bool = True, quiet_memory=None) -> None:
        """``memory``: a writable buffer of at least 64 bytes shared with another process (a
        ``MAP_SHARED`` mapping): the semaphore lives there, process-shared, so that process can post
        it or wait on it (``gpuloom.serve.ring``). ``create=False`` uses the semaphore the other
        process already initialised there. Default: a semaphore of this process alone.
        ``quiet_memory``: 8 bytes beside it for :meth:`quiet_until` (the shared ones have it)."""
        name = ctypes.util.find_library("c") or "libc.so.6"
        self._fast = ctypes.PyDLL(name, use_errno=True)  # sem_post / sem_trywait never block: keep the GIL
        slow = ctypes.CDLL(name, use_errno=True)  # the waits release the GIL
        # sem_t is 32 bytes on 64-bit glibc; 64, aligned, to be safe
        self._sem = (ctypes.c_uint64 * 8)() if memory is None else (ctypes.c_uint64 * 8).from_buffer(memory)
        if memory is None:  # (a shared one lives in its mapping, which from_buffer keeps alive with it)
            SemaphoreWaker._keep.append(self._sem)
        ptr = ctypes.c_void_p
        self._post_fn = self._fast.sem_post
        self._post_fn.argtypes, self._post_fn.restype = [ptr], ctypes.c_int
        self._trywait = self._fast.sem_trywait
        self._trywait.argtypes, self._trywait.restype = [ptr], ctypes.c_int
        self._wait = slow.sem_wait
        self._wait.argtypes, self._wait.restype = [ptr], ctypes.c_int
        self._clockwait = slow.sem_clockwait  # glibc >= 2.30; AttributeError otherwise (make_waker falls back)
        self._clockwait.argtypes = [ptr, ctypes.c_int, ctypes.POINTER(_Timespec)]
        self._clockwait.restype = ctypes.c_int
        init = self._fast.sem_init
        init.argtypes, init.restype = [ptr, ctypes.c_int, ctypes.c_uint], ctypes.c_int
        if create and init(ctypes.addressof(self._sem), int(memory is not None), 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._addr = ctypes.addressof(self._sem)
        self.c_post = (ctypes.cast(self._post_fn, ctypes.c_void_p).value, self._addr)
        self._ts = _Timespec()
        # monotonic s before which the waiting side needs no post from post_unless_quiet (quiet_until)
        self._quiet = None if quiet_memory is None else ctypes.c_double.from_buffer(quiet_memory)
        self._monotonic = time.monotonic

    share_fd: int | None = None  # a descriptor of the semaphore's memory, for :meth:`in_shared_memory`'s

    @classmethod
    def in_shared_memory(cls) -> "SemaphoreWaker":
        """A semaphore in an anonymous memory file (``share_fd``) that another process maps, after the
        descriptor is passed to it over a Unix socket, to post it (:meth:`attach`): the HTTP workers
        wake the runtime's loop this way (``gpuloom.serve.ring``). :meth:`close` closes the descriptor;
        the memory stays mapped, as a host function enqueued on a stream may still post it."""
        fd = os.memfd_create("gpuloom-waker", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            memory = mmap.mmap(fd, mmap.PAGESIZE)
            view = memoryview(memory)
            waker = cls(view[:64], create=True, quiet_memory=view[64:72])
        except BaseException:
            os.close(fd)
            raise
        cls._keep.append(memory)
        waker.share_fd = fd
        return waker

    @classmethod
    def attach(cls, fd: int) -> "SemaphoreWaker":
        """The other process's end of :meth:`in_shared_memory`: the semaphore behind ``fd`` (closed
        here; the mapping stays as long as the returned waker)."""
        try:
            view = memoryview(mmap.mmap(fd, 72))
            return cls(view[:64], create=False, quiet_memory=view[64:72])
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.share_fd is not None:
            os.close(self.share_fd)
            self.share_fd = None

    def post(self) -> None:
        self._post_fn(self._addr)

    def quiet_until(self, t_s: float) -> None:
        """The waiting side (the runtime's loop) promises to look at what other processes queued at
        monotonic time ``t_s`` anyway: until then :meth:`post_unless_quiet` need not wake it. Only for
        shared semaphores (:meth:`in_shared_memory`); a no-op otherwise."""
        if self._quiet is not None:
            self._quiet.value = t_s

    def post_unless_quiet(self) -> None:
        """:meth:`post`, unless the waiting side said it will look anyway (:meth:`quiet_until`). A
        producer calls it after it has published its item: an item published before the promised
        time is seen then (the monotonic clock is the host's, every process reads it alike)."""
        quiet = self._quiet
        if quiet is None or self._monotonic() >= quiet.value:
            self._post_fn(self._addr)

    def wait(self, timeout_s: float | None) -> None:
        """Return after a post (also one made before this call) or after ``timeout_s``; then take
        every further post already made, so a burst of posts wakes the loop once."""
        if timeout_s is None:
            self._wait(self._addr)
        elif timeout_s > 0:
            deadline = time.monotonic() + timeout_s
            ts = self._ts
            ts.tv_sec = int(deadline)
            ts.tv_nsec = int((deadline - ts.tv_sec) * 1e9)
            self._clockwait(self._addr, _CLOCK_MONOTONIC, ctypes.byref(ts))
        while self._trywait(self._addr) == 0:
            pass


def make_waker(shared: bool = False) -> SemaphoreWaker | EventWaker:
    """A :class:`SemaphoreWaker` where libc has one, else an :class:`EventWaker`. ``shared``: one that
    other processes can post (:meth:`SemaphoreWaker.in_shared_memory`) where memfd exists."""
    try:
        if shared and hasattr(os, "memfd_create"):
            return SemaphoreWaker.in_shared_memory()
        return SemaphoreWaker()
    except (OSError, AttributeError):
        return EventWaker()


__all__ = ["EventWaker", "SemaphoreWaker", "make_waker"]
