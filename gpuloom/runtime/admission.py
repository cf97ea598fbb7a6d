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
    once; full at the first request. Not thread-safe: the caller holds its lock."""

    __slots__ = ("tokens", "at")

    def __init__(self) -> None:
        self.tokens = -1.0  # < 0: full
        self.at = 0.0

    def take(self, rate: float, n: int, now_s: float) -> bool:
        """Whether ``n`` rows may enter at ``now_s`` (seconds) when the plan serves ``rate`` per second."""
        fill = rate * ADMIT_SLACK
        cap = max(float(n), fill * ADMIT_BURST_S)
        tokens = cap if self.tokens < 0 else min(cap, self.tokens + max(0.0, now_s - self.at) * fill)
        self.at = now_s
        ok = tokens >= n
        self.tokens = tokens - n if ok else tokens
        return ok
