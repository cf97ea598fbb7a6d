"""The online service's per-model books: counts, latency histograms, requests in flight.

:class:`~gpuloom.runtime.service.InferenceService` keeps one :class:`_Model` per loaded model and one
:class:`_Call` per accepted client request; every accepted request ends as exactly one of success,
failure or dropped (by reason), so ``accepted == success + failure + dropped + in_flight`` holds at
any time (:meth:`InferenceService.stats`). Rejected submissions are counted apart (``rejected``,
``shed``) and never enter the books. Split out of ``service.py``; ``service`` still exports these
names.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import copy
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..profile.store import Profile
from .admission import TokenBucket
from .errors import ServiceError
from .model_config import ModelConfig

#: upper bounds (ms) of the latency histogram buckets; the last bucket is +inf
LATENCY_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Histogram:
    """Counts per bucket of ``bounds`` (upper bounds, ascending) plus one +inf bucket; sum too."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.n = 0

    def add(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.n += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the ``q`` quantile (inf when it is the last one)."""
        if not self.n:
            return float("nan")
        target, acc = q * self.n, 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= target:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def to_json(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.n}

    @classmethod
    def delta(cls, after: dict, before: dict | None) -> "Histogram":
        """What was added between two :meth:`to_json` snapshots of one histogram (``before`` None: all)."""
        h = cls(after["bounds"])
        h.counts = [x - (before["counts"][i] if before else 0) for i, x in enumerate(after["counts"])]
        h.sum = after["sum"] - (before["sum"] if before else 0.0)
        h.n = sum(h.counts)
        return h


@dataclass
class _Model:
    config: ModelConfig
    profile: Profile
    runner: Any  # CompiledModel, or FakeModel on a fake device
    state: str = "loading"  # loading | ready | unloading
    loaded_at: float = field(default_factory=time.monotonic)
    accepted: int = 0
    success: int = 0
    failure: int = 0
    on_time: int = 0
    rejected: int = 0
    shed: int = 0  # of rejected: calls refused beyond the policy's admitted rate (admit_rps)
    admission: TokenBucket = field(default_factory=TokenBucket)
    dropped: Counter = field(default_factory=Counter)
    n_dropped: int = 0  # sum(dropped.values()), kept as _settle counts: in_flight is read on every submit
    queue_ms: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_MS))
    compute_ms: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_MS))
    total_ms: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_MS))
    batch: Counter = field(default_factory=Counter)  # rows of the batch a request ran in -> requests
    arrivals: deque = field(default_factory=lambda: deque(maxlen=4096))  # monotonic s, for the rate
    #: batch rows -> the profile's knee (SMs) for them; the profile is fixed for this load, and the
    #: backend asks once per batch (Profile.knee interpolates every measured SM count: ~30 us)
    knee_by_batch: dict = field(default_factory=dict)
    held_bytes: int = 0  # what its unload can give back: the module's weights and the graphs' memory
    exec_base: int = 0  # the backend's batches of this name before this load (its exec_count counts from there)

    @property
    def answered(self) -> int:
        return self.success + self.failure + self.n_dropped

    def books(self) -> dict:
        """A copy of its books of the requests answered so far (those still in flight are left out,
        with their outcomes: whoever books them later books them here), for the model's next version
        to go on from (:meth:`take_books`, ``InferenceService.reload``; a model unloaded and loaded again
        starts afresh). Why: the server's counters
        (``nv_inference_*``) went on across a reload while these started again, so the statistics
        contradicted each other (a review, sixty-ninth session)."""
        out = {f: copy.deepcopy(getattr(self, f)) for f in _CARRIED}
        out["accepted"] = self.answered
        return out

    def take_books(self, books: dict) -> None:
        for f, v in books.items():
            setattr(self, f, v)

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered

    def rate(self, now: float, window_s: float = 60.0) -> float | None:
        ts = [t for t in self.arrivals if t >= now - window_s]
        if len(ts) < 10:
            return None
        return len(ts) / max(1e-3, now - ts[0])


#: what a model's books carry to its next version (:meth:`_Model.books`): counts, latencies,
#: batch sizes, arrivals (its rate), and when it was first loaded (its goodput's denominator)
_CARRIED = ("loaded_at", "accepted", "success", "failure", "on_time", "rejected", "shed", "dropped", "n_dropped",
            "queue_ms", "compute_ms", "total_ms", "batch", "arrivals", "exec_base")

#: the drop reason of a request whose caller cancelled it (:class:`RequestFuture`)
CANCELLED = "cancelled"


class RequestFuture(concurrent.futures.Future):
    """A request's answer (``InferenceService.submit``). Cancelling it while the request is
    unanswered also takes the request's rows still waiting in their model's queue out of it: they
    are answered (and booked) Dropped("cancelled") and take no GPU time. Rows already in a batch
    run, and their outputs go nowhere. Why: a gRPC client that gives up (its deadline passes, it
    cancels) cancels the handler that waits here, and what it left in the queue would otherwise
    hold a batch slot that another client's request could use."""

    def __init__(self, cancel_rows: Callable[[tuple[int, ...], str], None]) -> None:
        super().__init__()
        self._cancel_rows = cancel_rows
        self.rids: tuple[int, ...] = ()  # the request's rows in the runtime, once submitted

    def cancel(self) -> bool:
        if not super().cancel():  # answered already
            return False
        if self.rids:
            self._cancel_rows(self.rids, CANCELLED)
        return True


class _Call:
    """One accepted client request: its rows' fates joined into one answer, given through a future
    (``future``, or a plain one made here), or through ``on_done(outputs, error)`` where the caller
    passed one (no future made)."""

    __slots__ = ("model", "future", "on_done", "settled", "outputs", "left", "error", "t0", "deadline_s",
                 "explicit", "queue_ms", "compute_ms", "batch")

    def __init__(self, model: _Model, n: int, deadline_s: float, explicit: bool,
                 on_done: Callable[[Any, ServiceError | None], None] | None = None,
                 future: concurrent.futures.Future | None = None) -> None:
        self.model = model
        self.future: concurrent.futures.Future | None = None
        if on_done is None:
            self.future = future if future is not None else concurrent.futures.Future()
        self.on_done = on_done
        self.settled = False  # answered (served, failed or dropped): later results are ignored
        self.outputs: list[Any] = [None] * n
        self.left = n
        self.error: ServiceError | None = None
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.explicit = explicit
        self.queue_ms = 0.0
        self.compute_ms = 0.0
        self.batch = 0
