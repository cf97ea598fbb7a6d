"""Per-thread CPU accounting (runtime/threadcpu.py). CPU only."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from gpuloom.runtime.threadcpu import cpu_share, role, thread_cpu


def test_roles_drop_counters_and_labels():
    assert role("gpuloom-watch-p3") == "gpuloom-watch"
    assert role("gpuloom-runtime-dstack") == "gpuloom-runtime"
    assert role("Thread-7 (worker)") == "Thread"
    assert role("MainThread") == "MainThread"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task is Linux's")
def test_a_busy_thread_shows_up_with_about_its_cpu_time_and_an_idle_one_does_not():
    # Held against the busy thread's own CPU clock (time.thread_time), not against wall time: on a
    # loaded host the thread gets what the scheduler gives it (CI's two busy cores: 0.32 of a core).
    stop = threading.Event()
    clock = {"read": 0.0}  # the busy thread's CPU seconds, as it last read them

    def spin():
        while not stop.is_set():
            sum(range(500))
            clock["read"] = time.thread_time()
        clock["end"] = time.thread_time()

    busy = threading.Thread(target=spin, name="gpuloom-busy-1")
    idle = threading.Thread(target=stop.wait, name="gpuloom-idle-1")
    before = thread_cpu()
    t0 = time.monotonic()
    busy.start()
    idle.start()
    # at least 0.5 s, and until the busy thread has used 0.3 s of CPU however slowly it gets it
    give_up = t0 + 60.0
    while time.monotonic() - t0 < 0.5 or clock["read"] < 0.3:
        assert time.monotonic() < give_up, f"the busy thread used {clock['read']:.3f} s of CPU in 60 s"
        time.sleep(0.01)
    used_before = clock["read"]  # read before thread_cpu() reads /proc, ...
    after = thread_cpu()
    wall = time.monotonic() - t0
    stop.set()
    busy.join()
    idle.join()
    used_after = clock["end"]  # ... and after
    share = cpu_share(before, after, wall)
    # /proc rounds user and system time each down to a clock tick (10 ms) and gives a running thread's
    # time as of the kernel's last timer tick (at most 10 ms old): under 3 ticks below the thread's own
    # clock, never above it (seen up to 17 ms below); cpu_share rounds to 1e-4 of the window
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    seen = share["gpuloom-busy"] * wall  # the busy thread's CPU seconds in /proc, from its start
    assert used_before - 3 * tick - 1e-4 * wall <= seen <= used_after + 1e-4 * wall, (share, used_before, used_after)
    assert share["gpuloom-idle"] < 0.05, share
    # the process's and the thread's readings each round by up to a tick at both ends, and are taken
    # a moment apart: allow 3 ticks of the window
    assert share["process"] >= share["gpuloom-busy"] - 3 * tick / wall, (share, tick)
