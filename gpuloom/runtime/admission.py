"""Admission at a policy's planned rate (``Policy.admit_rps``): a token bucket per model.

Under overload a request the plan has no room for waits in its queue until its deadline passes and
is dropped, after costing the host a queue entry, a wake-up and an answer. Refusing it on arrival
costs next to nothing. The service (wall clock) and the simulated runtime (its clock) admit with the
same bucket, so the simulator sees what the GPU runs. Pure Python.
"""

from __future__ import annotations

#: requests enter at up to this many times the planned rate ...
ADMIT_SLACK = 1.1
#: ... with this many seconds of them at once (Poisson arrivals come in bursts)
ADMIT_BURST_S = 0.05


class TokenBucket:
    """Admits rows at ``rate`` x :data:`ADMIT_SLACK` per second, up to :data:`ADMIT_BURST_S` of them at
    once; full at the first request. A request of more rows than the bucket holds enters once it is
    full and leaves it in debt, so small requests cannot starve large ones. Not thread-safe: the
    caller holds its lock."""

    __slots__ = ("tokens", "at")

    def __init__(self) -> None:
        self.tokens: float | None = None  # None: full
        self.at = 0.0

    @staticmethod
    def _fill_cap(rate: float) -> tuple[float, float]:
        """Rows per second the bucket refills at, and the most it holds."""
        fill = rate * ADMIT_SLACK
        return fill, max(1.0, fill * ADMIT_BURST_S)

    def take(self, rate: float, n: int, now_s: float) -> bool:
        """Whether ``n`` rows may enter at ``now_s`` (seconds) when the plan serves ``rate`` per second."""
        fill, cap = self._fill_cap(rate)
        tokens = cap if self.tokens is None else min(cap, self.tokens + max(0.0, now_s - self.at) * fill)
        self.at = now_s
        ok = tokens >= min(float(n), cap)
        self.tokens = tokens - n if ok else tokens
        return ok

    def wait_s(self, rate: float, n: int) -> float:
        """Seconds from the last :meth:`take` until ``n`` rows may enter (a refusal's Retry-After)."""
        fill, cap = self._fill_cap(rate)
        if fill <= 0:
            return 1.0
        short = min(float(n), cap) - (cap if self.tokens is None else self.tokens)
        return max(0.001, short / fill)
