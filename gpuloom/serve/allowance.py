"""The return allowance of an HTTP front-end worker (``gpuloom serve --http-return-allowance``).

Why: a worker hands each request to the runtime with ``waited_ms``, the time since its handler
started, and the runtime counts the request's deadline from there (``InferenceService.submit``). The
time the request spends in the server after that and outside the service's own clock is counted
nowhere: its answer and the reply ring back to the worker, and the worker building the response
(before the sixty-eighth session also the wait for the runtime's intake from the ring, which the
runtime now counts: a ring record carries its hand-off time). On the H100 (mix6 over HTTP at full load, run 209,
``docs/results/serve/e2e_h100_run209_c3.json``) that was about 1.1 ms (bridge minus service) plus
0.95 ms (worker minus bridge) at p50 against SLOs of 10-20 ms, so the scheduler served requests it
believed on time that reached the client late: mobilenet_v2 served 6,428, 2,600 on time at the
client. With the allowance on, a worker adds the time it expects that part to take to each
request's ``waited_ms``, so the runtime drops what would be late anyway instead of spending GPU time
on it.

No torch, no aiohttp: the worker imports it.
"""

from __future__ import annotations

import math
import statistics

#: ``Server(return_allowance=...)``: "auto" adds the estimate to each request's ``waited_ms``, "off" does not
MODES = ("auto", "off")
#: off: on a slow H100 host (runs 210-211) it turned late answers into drops, not on-time ones; a middle
#: or fast host, where the GPU and not the host limits, is still to measure (reports/runtime.md, next call 2)
DEFAULT_MODE = "off"


def check_mode(mode: str) -> str:
    """``mode`` unchanged, or ValueError naming the choices (the server's setting and the worker's flag)."""
    if mode not in MODES:
        raise ValueError(f"return_allowance: expected one of {MODES} (whether the front-end workers count a "
                         f"request's expected time outside the runtime in its deadline), got {mode!r}")
    return mode


class ReturnAllowance:
    """A worker's running estimate of a request's time in the server after its ``waited_ms`` was
    taken and outside the service's own clock (:attr:`ms`).

    Each successful reply gives one sample (:meth:`add`). The estimate is the median of the last
    ``window`` samples, recomputed every ``every`` samples, not per request: one sort of 128 per 32
    requests, and one stalled reply (a collector pause, a preempted worker) does not move it. It is 0
    until ``every`` samples exist.

    It is capped at ``cap_ms``: a run of stalled samples would otherwise tell the runtime that every
    request is out of time, and it would drop them all. Even under the cap it can exceed every SLO
    the worker sees (10-20 ms in mix6), and dropped requests bring no sample that could lower it, so
    :meth:`miss` counts the drops: after ``window`` of them in a row the estimate starts again from 0
    (it may be what dropped them)."""

    def __init__(self, window: int = 128, every: int = 32, cap_ms: float = 50.0) -> None:
        if not (0 < every <= window) or not cap_ms >= 0:
            raise ValueError(f"expected 0 < every <= window and cap_ms >= 0, got every={every}, "
                             f"window={window}, cap_ms={cap_ms}")
        self.window, self.every, self.cap_ms = window, every, cap_ms
        self._samples = [0.0] * window  # a ring: sample i is at i % window
        self._n = 0  # samples since the start (or the last reset)
        self._misses = 0  # drops since the last sample
        self.ms = 0.0

    def add(self, sample_ms: float) -> None:
        """One successful reply: its time in the worker's handler after ``waited_ms`` was taken, less the
        service's own time (``service_ms``)."""
        if not math.isfinite(sample_ms):
            return
        self._misses = 0
        self._samples[self._n % self.window] = sample_ms
        self._n += 1
        if self._n % self.every == 0:
            recent = self._samples if self._n >= self.window else self._samples[:self._n]
            self.ms = min(self.cap_ms, max(0.0, statistics.median(recent)))

    def miss(self) -> None:
        """One request the runtime dropped (no sample): ``window`` in a row reset the estimate to 0."""
        self._misses += 1
        if self._misses >= self.window:
            self._n = self._misses = 0
            self.ms = 0.0
