"""gpuloom.runtime.affinity: CPU lists and pinning every thread of the process."""

from __future__ import annotations

import os
import threading

import pytest

from gpuloom.runtime.affinity import parse_cpus, pinned


def test_cpu_lists_read_like_taskset_and_plus_stands_for_comma():
    assert parse_cpus("1") == {1} and parse_cpus("0,2-3") == {0, 2, 3} and parse_cpus("0+4-5") == {0, 4, 5}
    for bad in ("", "x", "3-1", "-1", "1,", "1-"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_pinned_moves_threads_alive_and_started_inside_then_gives_every_thread_its_cpus_back():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    stop = threading.Event()
    old = threading.Thread(target=stop.wait, daemon=True)  # alive before the block
    old.start()
    inside = {}
    with pinned({cpu}):
        new = threading.Thread(target=lambda: inside.setdefault("new", os.sched_getaffinity(0)))
        new.start()
        new.join()
        inside["old"] = os.sched_getaffinity(old.native_id)
        inside["me"] = os.sched_getaffinity(0)
    assert inside == {"new": {cpu}, "old": {cpu}, "me": {cpu}}
    assert os.sched_getaffinity(0) == before and os.sched_getaffinity(old.native_id) == before
    with pinned(None):  # nothing asked: nothing changes
        assert os.sched_getaffinity(0) == before
    stop.set()


def test_pin_apart_pins_this_process_and_hands_back_the_other_cpus():
    from gpuloom.runtime.affinity import pin_apart, pin_process

    before = os.sched_getaffinity(0)
    cpu = min(before)
    try:
        others = pin_apart({cpu})
        assert os.sched_getaffinity(0) == {cpu}
        assert others == ((before - {cpu}) or before)
    finally:
        pin_process(before)
