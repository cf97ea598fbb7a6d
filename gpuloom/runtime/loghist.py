"""Counts of durations in buckets 5% wide: tails (p50, p99) of many small samples, cheaply.

The backend keeps one per (model, SMs, batch) for device time and one per partition for the time a
batch holds its partition beyond its device time. Means hid what lost SLOs on the H200 (eleventh
session: bert_base missed at x1 while its mean device time and hold, fed to the simulator, kept
0.997); a tail needs the distribution. Counts only grow, so the tail of an interval is the
difference of two snapshots (:func:`delta`), as with the service's histograms. No torch here.
"""

from __future__ import annotations

import math

RATIO = 1.05  # each bucket's upper bound is 5% above the one before: quantiles within 5%
FLOOR_MS = 0.001  # bucket 0 holds everything at or below 1 us (and negative skews)
_LOG_RATIO = math.log(RATIO)


def bucket(ms: float) -> int:
    """The bucket of ``ms``: 0 for <= FLOOR_MS, else k with FLOOR_MS * RATIO**(k-1) < ms <= FLOOR_MS * RATIO**k."""
    if not ms > FLOOR_MS:
        return 0
    return max(1, math.ceil(math.log(min(ms, 1e12) / FLOOR_MS) / _LOG_RATIO - 1e-9))  # inf: the top bucket


def upper(k: int) -> float:
    """The upper bound of bucket ``k`` in ms."""
    return FLOOR_MS * RATIO ** k


class LogHistogram:
    """Sparse counts per bucket; add() is a log and a dict update (about 0.3 us)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, ms: float) -> None:
        if ms != ms:  # NaN: no duration to count
            return
        k = bucket(ms)
        self.counts[k] = self.counts.get(k, 0) + 1

    def to_json(self) -> dict[str, int]:
        return {str(k): c for k, c in sorted(self.counts.items())}


def delta(after: dict, before: dict | None) -> dict[int, int]:
    """Counts added between two :meth:`LogHistogram.to_json` snapshots (``before`` None: all)."""
    prior = {int(k): c for k, c in (before or {}).items()}
    out = {int(k): c - prior.get(int(k), 0) for k, c in after.items()}
    return {k: c for k, c in out.items() if c > 0}


def quantile(counts: dict[int, int], q: float) -> float | None:
    """Upper bound (ms) of the bucket holding the ``q`` quantile; None without samples."""
    n = sum(counts.values())
    if n <= 0:
        return None
    target, acc = q * n, 0
    for k in sorted(counts):
        acc += counts[k]
        if acc >= target:
            return upper(k)
    return upper(max(counts))


def tails(counts: dict[int, int]) -> tuple[float, float]:
    """(p50, p99) of ``counts`` in ms, rounded as reports give them (there must be samples)."""
    return round(quantile(counts, 0.5), 4), round(quantile(counts, 0.99), 4)
