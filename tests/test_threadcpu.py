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
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(500))

    busy = threading.Thread(target=spin, name="gpuloom-busy-1")
    idle = threading.Thread(target=stop.wait, name="gpuloom-idle-1")
    before = thread_cpu()
    t0 = time.monotonic()
    busy.start()
    idle.start()
    time.sleep(0.5)
    after = thread_cpu()
    wall = time.monotonic() - t0
    stop.set()
    busy.join()
    idle.join()
    share = cpu_share(before, after, wall)
    assert share["gpuloom-busy"] > 0.3, share  # the GIL is shared with this thread's sleep only
    assert share["gpuloom-idle"] < 0.05, share
    # /proc counts CPU in clock ticks (10 ms): the process's and the thread's readings each round
    # by up to a tick at both ends, and are taken a moment apart: allow 3 ticks of the window
    tick = 1.0 / os.sysconf("SC_CLK_TCK") / wall
    assert share["process"] >= share["gpuloom-busy"] - 3 * tick, (share, tick)
