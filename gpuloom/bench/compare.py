"""Is one server's tail really lower than another's? Statistics for side-by-side latency runs.

Why: a p99 read off 500-2,000 requests moves by tens of percent from run to run on a shared VM
(issue 6's CPU benchmark: both servers' p99s at 100 requests/s overlapped across runs), so "lower in
this run" says little on its own. Two answers, both pure numpy / math:

* :func:`quantile_difference`: within one run, the difference of two samples' quantiles with a
  bootstrap interval (each sample resampled with replacement): an interval below zero says the
  first server's tail was lower beyond what resampling its own requests could explain.
* :func:`sign_test`: across runs, how unlikely at least ``wins`` of ``n`` runs would be if each run
  were a coin toss (one-sided binomial).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def quantile_difference(a: Sequence[float], b: Sequence[float], *, q: float = 0.99, reps: int = 2000,
                        level: float = 0.95, seed: int = 0) -> dict:
    """``quantile(a) - quantile(b)`` at ``q`` with a percentile-bootstrap interval at ``level``.

    Returns ``{"q", "a", "b", "diff", "lo", "hi", "level", "reps", "n_a", "n_b", "a_lower"}``:
    ``a_lower`` is True when the whole interval is below zero (``a``'s quantile lower beyond the
    resampling spread), False when it is above zero, None when it straddles zero."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.ndim != 1 or y.ndim != 1 or len(x) < 2 or len(y) < 2:
        raise ValueError(f"quantile_difference: two 1-D samples of at least 2 values each, found {x.shape} and {y.shape}")
    if not 0.0 < q < 1.0 or not 0.0 < level < 1.0 or reps < 1:
        raise ValueError(f"quantile_difference: 0 < q < 1, 0 < level < 1 and reps >= 1, found {q}, {level}, {reps}")
    rng = np.random.default_rng(seed)
    qa = np.quantile(x[rng.integers(0, len(x), size=(reps, len(x)))], q, axis=1)
    qb = np.quantile(y[rng.integers(0, len(y), size=(reps, len(y)))], q, axis=1)
    lo, hi = np.quantile(qa - qb, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    at_a, at_b = float(np.quantile(x, q)), float(np.quantile(y, q))
    lower = True if hi < 0 else False if lo > 0 else None
    return {"q": q, "a": at_a, "b": at_b, "diff": at_a - at_b,
            "lo": float(lo), "hi": float(hi), "level": level, "reps": int(reps), "n_a": len(x), "n_b": len(y),
            "a_lower": lower}


def sign_test(wins: int, n: int) -> float:
    """One-sided sign test: P(at least ``wins`` of ``n`` fair coin tosses come up heads)."""
    if not 0 <= wins <= n:
        raise ValueError(f"sign_test: 0 <= wins <= n, found wins={wins}, n={n}")
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2.0 ** n


__all__ = ["quantile_difference", "sign_test"]
