"""The short GIL switch interval a service holds while it runs (gpuloom.runtime.gilswitch). CPU only."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from gpuloom.runtime.host_device import FakeDeviceLayer
from gpuloom.runtime.gilswitch import ShortSwitchInterval
from gpuloom.runtime.service import InferenceService


@pytest.fixture(autouse=True)
def _default_interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


def test_the_shortest_asked_interval_holds_until_the_last_holder_leaves():
    ShortSwitchInterval.enter(1.0)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    ShortSwitchInterval.enter(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    ShortSwitchInterval.leave(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    ShortSwitchInterval.leave(1.0)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    ShortSwitchInterval.leave(1.0)  # an extra leave changes nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_longer_than_the_current_one_never_lengthens_it():
    sys.setswitchinterval(0.0002)
    ShortSwitchInterval.enter(2.0)
    assert sys.getswitchinterval() == pytest.approx(0.0002, abs=2e-6)  # kept in whole microseconds
    ShortSwitchInterval.leave(2.0)
    assert sys.getswitchinterval() == pytest.approx(0.0002, abs=2e-6)


@pytest.mark.parametrize("bad", [0, -1, 1000, float("nan"), "1"])
def test_bad_intervals_are_refused_with_the_range(bad):
    with pytest.raises(ValueError, match=r"\(0, 100\] ms"):
        ShortSwitchInterval.enter(bad)
    with pytest.raises(ValueError, match=r"\(0, 100\] ms"):
        InferenceService(policy="triton", device_layer=FakeDeviceLayer(), switch_interval_ms=bad)


def test_a_running_service_holds_it_when_asked_and_close_restores_it():
    svc = InferenceService(policy="triton", device_layer=FakeDeviceLayer(), switch_interval_ms=0.5)
    assert sys.getswitchinterval() == pytest.approx(0.005)  # nothing before start
    svc.start()
    assert sys.getswitchinterval() == pytest.approx(0.0005, abs=2e-6)
    svc.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    # the default leaves the interpreter alone: on the H200 a 0.5 ms interval cut the HTTP goodput
    # of the 6-model mix at x0.1 from 0.997 to 0.66 of the in-process one (docs/reports/serving.md)
    default = InferenceService(policy="triton", device_layer=FakeDeviceLayer())
    assert default.switch_interval_ms is None
    default.start()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    default.close()


def test_next_to_a_busy_thread_a_gil_releasing_call_is_held_off_for_about_the_short_interval():
    """The convoy effect the option is there for. A loop of short GIL-releasing calls runs next to a
    thread spinning in Python. Whenever the spinner wins the GIL while the call is out, the call's
    thread waits until the interval forces a hand-off: about 5 ms at the default, about 0.5 ms with
    the option. The length of those hold-offs is the interval's doing; how often they happen is the
    OS scheduler's (on a loaded 2-core CI machine the spinner won 2% of the races, on the build VM
    most of them), so the test counts the hold-offs longer than half the default interval, not the mean time per call:
    the mean failed there at 129 us vs 65 us per call (default vs short)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    dst, src = torch.zeros(20000), torch.ones(20000)

    def call_times_s(budget_s: float = 0.6, most: int = 400) -> list[float]:
        times, end = [], time.perf_counter() + budget_s
        while len(times) < most and time.perf_counter() < end:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return times

    alone = float(np.median(call_times_s()))

    def hold_offs_s(ms: float) -> list[float]:
        """The calls that took at least 0.25 ms longer than alone, over three spinner runs."""
        sys.setswitchinterval(ms / 1000)
        held: list[float] = []
        for _ in range(3):
            stop = threading.Event()

            def spin():
                while not stop.is_set():
                    pass

            th = threading.Thread(target=spin, daemon=True)
            th.start()
            time.sleep(0.01)
            try:
                held += [t for t in call_times_s() if t > alone + 0.25e-3]
            finally:
                stop.set()
                th.join()
        return held

    default = hold_offs_s(5.0)
    if len(default) < 10:  # the spinner hardly ever took the GIL (an overloaded machine): nothing to remove
        pytest.skip(f"no convoy at the default interval on this machine now ({len(default)} hold-offs)")
    assert float(np.median(default)) > 3e-3, sorted(default)  # the default's hold-offs are its 5 ms
    # a hold-off of more than half the default interval under the short one is the OS's, not the GIL's.
    # The OS preempts at will on a busy 2-core CI machine (once 5 such against the default's 14): a
    # fresh sample of both, up to three times. An interval that is not applied fails every one.
    for _ in range(3):
        short = hold_offs_s(0.5)
        long_default, long_short = (sum(t > 2.5e-3 for t in h) for h in (default, short))
        if long_short * 3 <= long_default:
            break
        default = hold_offs_s(5.0)
    assert long_short * 3 <= long_default, (sorted(short), sorted(default))
