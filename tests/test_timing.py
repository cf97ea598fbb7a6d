"""gpu/timing.median_ms_interleaved on the CPU clock: variants take turns, so drift hits all alike."""

from __future__ import annotations

import time

import pytest

from gpuloom.gpu import timing
from gpuloom.gpu.timing import median_ms, median_ms_interleaved


def sleeper(ms: float):
    return lambda: time.sleep(ms / 1e3)


def test_interleaved_medians_follow_known_sleep_durations():
    nominal = {"short": 2.0, "middle": 6.0, "long": 12.0}
    got = median_ms_interleaved({k: sleeper(v) for k, v in nominal.items()},
                                warmup=1, iters=12, rounds=4, cuda=False)
    assert list(got) == list(nominal)
    assert got["short"] < got["middle"] < got["long"]
    for name, ms in nominal.items():
        # sleep never returns early; a loaded 2-core host may overshoot, but not by a whole sleep
        assert ms * 0.95 <= got[name] < ms + 4.0, (name, got)


class VirtualClock:
    """A stand-in for ``time`` whose clock only moves when a fake workload says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def perf_counter(self) -> float:
        return self.now

    def workload(self, name: str, ms):
        def run():
            self.calls.append(name)
            self.now += ms(len(self.calls)) / 1e3
        return run


def test_every_variant_gets_iters_timed_calls_in_rotating_turns(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(timing, "time", clock)
    fns = {n: clock.workload(n, lambda i: 1.0) for n in "abc"}
    median_ms_interleaved(fns, warmup=2, iters=7, rounds=3, cuda=False, settle=1)
    calls = clock.calls
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up, each in turn
    timed = calls[6:]
    # 7 = 3 + 2 + 2 timed calls, each turn preceded by one untimed settle call
    assert [c for c in "abc" if timed.count(c) != 7 + 3] == []
    turns = [timed[i] for i in range(len(timed)) if i == 0 or timed[i] != timed[i - 1]]
    assert turns == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the order rotates each round


def test_interleaving_spreads_a_drift_over_all_variants(monkeypatch):
    """Two identical workloads on a machine that slows down steadily: timed one after the other the
    second looks much slower; interleaved they come out (almost) equal."""
    clock = VirtualClock()
    monkeypatch.setattr(timing, "time", clock)
    drift = lambda i: 1.0 + 0.02 * i  # ms; the host gets slower with every call  # noqa: E731
    a, b = clock.workload("a", drift), clock.workload("b", drift)

    seq_a = median_ms(a, warmup=5, iters=100, cuda=False)
    seq_b = median_ms(b, warmup=5, iters=100, cuda=False)
    assert seq_b / seq_a > 1.5  # the bias interleaving removes

    clock.calls.clear()
    got = median_ms_interleaved({"a": a, "b": b}, warmup=5, iters=100, rounds=10, cuda=False)
    assert abs(got["b"] / got["a"] - 1) < 0.05, got


@pytest.mark.parametrize("kwargs", [dict(iters=3, rounds=4), dict(iters=10, rounds=0), dict(iters=10, rounds=2, warmup=-1)])
def test_bad_arguments_are_refused(kwargs):
    kwargs = {"warmup": 0, **kwargs}
    with pytest.raises(ValueError, match="rounds|warmup"):
        median_ms_interleaved({"a": lambda: None}, cuda=False, **kwargs)
    with pytest.raises(ValueError, match="at least one"):
        median_ms_interleaved({}, warmup=0, iters=10, cuda=False)
