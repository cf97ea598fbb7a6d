"""The runtime loop's wakers (runtime/waker.py): a post is never lost, a burst wakes once, the C entry
point (what a CUDA host function calls) wakes a waiting thread. CPU only."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from gpuloom.runtime.events import COMPLETION, RealtimeLoop
from gpuloom.runtime.waker import EventWaker, SemaphoreWaker, make_waker

WAKERS = [SemaphoreWaker, EventWaker]


@pytest.mark.parametrize("kind", WAKERS)
def test_a_post_made_before_the_wait_is_not_lost(kind):
    w = kind()
    w.post()
    t0 = time.monotonic()
    w.wait(5.0)
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("kind", WAKERS)
def test_a_burst_of_posts_wakes_once_then_the_wait_times_out(kind):
    w = kind()
    for _ in range(50):
        w.post()
    w.wait(5.0)
    t0 = time.monotonic()
    w.wait(0.05)
    assert 0.04 <= time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("kind", WAKERS)
def test_a_post_from_another_thread_wakes_a_waiting_thread(kind):
    w = kind()
    threading.Timer(0.05, w.post).start()
    t0 = time.monotonic()
    w.wait(5.0)
    assert 0.03 <= time.monotonic() - t0 < 1.0


def test_the_c_entry_point_wakes_the_waiter_from_a_thread_without_python_code():
    """``c_post`` is what ``cuLaunchHostFunc`` gets: a C function and its argument, called from a driver thread."""
    w = make_waker()
    assert isinstance(w, SemaphoreWaker), "glibc has sem_clockwait on every supported Linux"
    fn, arg = w.c_post
    post = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)  # the same call a driver thread makes
    threading.Timer(0.05, post, (arg,)).start()
    t0 = time.monotonic()
    w.wait(5.0)
    assert 0.03 <= time.monotonic() - t0 < 1.0


def test_the_loop_runs_its_pollers_on_every_wake_and_honours_their_deadline():
    """A poller that books work when a device posts the waker: the loop sleeps until the post (or the
    poller's deadline), never spins, and runs what the poller posted."""
    loop = RealtimeLoop()
    done_at = time.monotonic() + 0.05
    calls, ran = [], []

    def poll() -> float:
        calls.append(time.monotonic())
        if ran or time.monotonic() < done_at:
            return float("inf") if ran else 500.0  # due far away: the post must wake us
        loop.post(COMPLETION, ran.append, "done")
        return float("inf")

    loop.add_poller(poll)
    loop.expect()
    threading.Timer(0.05, loop.waker.post).start()
    assert loop.step() and ran == ["done"]
    assert len(calls) < 10, f"the loop polled {len(calls)} times: it should sleep until the post"
    assert not loop.step()  # nothing expected, nothing open: the loop ends


def test_a_pollers_delay_brings_the_loop_back_to_it_with_no_post():
    """What a poller returns is a delay from now (ms), on whichever loop calls it: the loop sleeps that
    long and calls it again, with nothing posted meanwhile (the HTTP intake's window relies on it)."""
    loop = RealtimeLoop(start_ms=123_456.0)  # (a loop whose clock is far from the monotonic one's)
    calls, ran = [], []

    def poll() -> float:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return 40.0
        if not ran:
            loop.post(COMPLETION, ran.append, "due")
        return float("inf")

    loop.add_poller(poll)
    loop.waker.wait(0)  # (takes add_poller's own wake-up: from here nothing posts)
    loop.expect()
    t0 = time.monotonic()
    assert loop.step() and ran == ["due"]
    assert len(calls) >= 2 and 0.035 <= calls[1] - t0 < 2.0, [c - t0 for c in calls]
    assert len(calls) < 10, f"the loop polled {len(calls)} times: it should sleep out the delay"


def test_a_producer_does_not_wake_a_loop_that_promised_to_look_by_then():
    """``quiet_until``: the runtime's loop says it will look at monotonic t anyway; another process's
    ``post_unless_quiet`` (a front-end worker's, after it queued a request) then posts nothing before
    t, and posts again from t on. A plain ``post`` always wakes."""
    import os

    loop_side = SemaphoreWaker.in_shared_memory()
    worker_side = SemaphoreWaker.attach(os.dup(loop_side.share_fd))
    try:
        loop_side.quiet_until(time.monotonic() + 60.0)
        worker_side.post_unless_quiet()
        t0 = time.monotonic()
        loop_side.wait(0.05)
        assert time.monotonic() - t0 >= 0.04  # not woken
        worker_side.post()
        t0 = time.monotonic()
        loop_side.wait(5.0)
        assert time.monotonic() - t0 < 0.5  # a plain post still wakes it
        loop_side.quiet_until(time.monotonic() - 0.001)  # the promise has passed
        worker_side.post_unless_quiet()
        t0 = time.monotonic()
        loop_side.wait(5.0)
        assert time.monotonic() - t0 < 0.5
    finally:
        loop_side.close()
    private = SemaphoreWaker()  # no other process: nothing to quieten, every post wakes
    private.quiet_until(time.monotonic() + 60.0)
    private.post_unless_quiet()
    t0 = time.monotonic()
    private.wait(5.0)
    assert time.monotonic() - t0 < 0.5
