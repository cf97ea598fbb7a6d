"""The front-end workers' return allowance (``gpuloom.serve.allowance``). CPU only."""

from __future__ import annotations

import statistics

import pytest

from gpuloom.serve.allowance import ReturnAllowance


# -- the estimator ---------------------------------------------------------------------------------
def test_the_allowance_is_zero_until_32_samples_then_their_median():
    a = ReturnAllowance()
    samples = [float(x) for x in range(1, 33)]  # median 16.5
    for x in samples[:31]:
        a.add(x)
        assert a.ms == 0.0
    a.add(samples[31])
    assert a.ms == statistics.median(samples) == 16.5


def test_the_median_is_of_the_last_128_samples_and_recomputed_every_32_only():
    a = ReturnAllowance()
    for _ in range(128):
        a.add(1.0)
    assert a.ms == 1.0
    for _ in range(31):  # not recomputed yet
        a.add(10.0)
    assert a.ms == 1.0
    a.add(10.0)  # 32 of 10 among the last 128
    assert a.ms == 1.0
    for _ in range(32):  # 64 and 64
        a.add(10.0)
    assert a.ms == 5.5
    for _ in range(32):  # the last 128: 32 ones, 96 tens
        a.add(10.0)
    assert a.ms == 10.0
    for _ in range(32):  # no one left among the last 128
        a.add(10.0)
    assert a.ms == 10.0


def test_one_stalled_sample_does_not_move_it_and_many_are_capped_at_50_ms():
    a = ReturnAllowance()
    for _ in range(31):
        a.add(2.0)
    a.add(5_000.0)  # one reply that waited out a pause
    assert a.ms == 2.0
    for _ in range(128):
        a.add(400.0)
    assert a.ms == 50.0 == a.cap_ms


def test_negative_and_nan_samples_neither_go_below_zero_nor_count():
    a = ReturnAllowance()
    for _ in range(32):
        a.add(-1.0)
    assert a.ms == 0.0
    a = ReturnAllowance()
    for _ in range(31):
        a.add(3.0)
    a.add(float("nan"))  # not a sample: the 32nd is still to come
    assert a.ms == 0.0
    a.add(3.0)
    assert a.ms == 3.0


def test_a_window_of_failed_replies_in_a_row_starts_it_again_from_zero():
    """Requests the allowance itself may fail (each counted out of time) bring no sample that could
    lower it: after 128 failures in a row it starts again from 0, and again needs 32 samples."""
    a = ReturnAllowance()
    for _ in range(32):
        a.add(40.0)
    for _ in range(127):
        a.miss()
    a.add(40.0)  # a success between: the run of failures starts again
    for _ in range(127):
        a.miss()
    assert a.ms == 40.0
    a.miss()
    assert a.ms == 0.0
    for _ in range(31):
        a.add(7.0)
    assert a.ms == 0.0
    a.add(7.0)
    assert a.ms == 7.0  # the samples before the reset are gone


def test_a_window_or_cadence_that_cannot_work_is_refused():
    for kw in ({"every": 0}, {"every": 200}, {"cap_ms": -1.0}):
        with pytest.raises(ValueError, match="expected 0 < every <= window"):
            ReturnAllowance(**kw)
