"""gpuloom.bench.compare: the bootstrap interval of a quantile difference, and the sign test."""

import numpy as np
import pytest

from gpuloom.bench.compare import quantile_difference, sign_test


def test_a_clearly_lower_tail_gets_an_interval_below_zero():
    rng = np.random.default_rng(1)
    fast = rng.exponential(1.0, 2000)
    slow = rng.exponential(1.0, 2000) + 2.0  # every quantile 2 higher
    r = quantile_difference(fast, slow, q=0.99)
    assert r["a_lower"] is True and r["hi"] < 0 and r["lo"] <= r["diff"] <= r["hi"]
    assert r["diff"] == pytest.approx(np.quantile(fast, 0.99) - np.quantile(slow, 0.99))
    assert r["n_a"] == r["n_b"] == 2000
    flipped = quantile_difference(slow, fast, q=0.99)
    assert flipped["a_lower"] is False and flipped["lo"] > 0


def test_two_samples_of_one_distribution_straddle_zero():
    rng = np.random.default_rng(2)
    a, b = rng.exponential(1.0, 2000), rng.exponential(1.0, 2000)
    r = quantile_difference(a, b, q=0.99, seed=3)
    assert r["a_lower"] is None and r["lo"] < 0 < r["hi"]


def test_the_interval_widens_with_fewer_requests_and_is_reproducible():
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(0, 0.5, 4000), rng.lognormal(0, 0.5, 4000)
    wide = quantile_difference(a[:500], b[:500])
    narrow = quantile_difference(a, b)
    assert (wide["hi"] - wide["lo"]) > (narrow["hi"] - narrow["lo"])
    assert quantile_difference(a, b, seed=7) == quantile_difference(a, b, seed=7)


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="at least 2 values"):
        quantile_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="0 < q < 1"):
        quantile_difference([1.0, 2.0], [1.0, 2.0], q=1.0)
    with pytest.raises(ValueError, match="wins <= n"):
        sign_test(5, 4)


def test_sign_test_matches_the_binomial_tail():
    assert sign_test(0, 5) == 1.0
    assert sign_test(5, 5) == pytest.approx(1 / 32)
    assert sign_test(15, 19) == pytest.approx(5036 / 2 ** 19)  # 0.0096: issue 6's record, forty-fifth session
    assert sign_test(10, 13) == pytest.approx(0.0461, abs=1e-4)
