"""Durations in 5%-wide buckets: quantiles within 5%, tails of an interval from two snapshots."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.runtime import loghist
from gpuloom.runtime.loghist import LogHistogram


@given(st.floats(min_value=0.0011, max_value=1e5, allow_nan=False))
def test_a_value_lies_in_its_bucket_which_is_5_percent_wide(ms):
    k = loghist.bucket(ms)
    assert loghist.upper(k - 1) < ms <= loghist.upper(k) * (1 + 1e-9)
    assert loghist.upper(k) / loghist.upper(k - 1) == pytest.approx(1.05)


def test_tiny_and_negative_values_share_bucket_zero():
    assert loghist.bucket(-0.3) == loghist.bucket(0.0) == loghist.bucket(0.001) == 0


def test_quantiles_are_within_5_percent_of_the_exact_ones():
    rng = random.Random(1)
    xs = [rng.lognormvariate(0.0, 0.6) for _ in range(5000)]
    h = LogHistogram()
    for x in xs:
        h.add(x)
    counts = loghist.delta(h.to_json(), None)
    xs.sort()
    for q in (0.5, 0.9, 0.99):
        exact = xs[int(q * len(xs)) - 1]
        assert exact <= loghist.quantile(counts, q) <= exact * 1.05 * 1.05


def test_the_tail_of_an_interval_is_the_difference_of_two_snapshots():
    h = LogHistogram()
    for _ in range(100):
        h.add(1.0)
    before = h.to_json()
    for _ in range(99):
        h.add(2.0)
    h.add(50.0)
    counts = loghist.delta(h.to_json(), before)
    assert sum(counts.values()) == 100
    assert 2.0 <= loghist.quantile(counts, 0.5) <= 2.1 and 50.0 <= loghist.quantile(counts, 1.0) <= 52.5
    assert loghist.quantile({}, 0.99) is None


def test_infinity_lands_in_a_top_bucket_and_nan_is_not_counted():
    h = LogHistogram()
    h.add(float("inf"))
    h.add(float("nan"))
    assert sum(h.counts.values()) == 1 and loghist.quantile(h.counts, 1.0) >= 1e12
