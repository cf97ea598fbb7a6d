"""The runtime: per-model request queues and the loop that feeds a policy and a backend.

The loop is one idea: *handle every event of this instant, then let the policy decide*. Events are
arrivals (scheduled here), completions (scheduled by the backend) and policy wake-ups. Everything
else is a named helper. The same loop drives the simulated backend and (issue 5) the GPU backend:
the backend's :class:`~gpuloom.runtime.events.EventLoop` decides whether time jumps or passes.

Books are kept per request: every request that arrives ends the run SERVED, DROPPED (with the
policy's reason), FAILED (with the backend's error) or still QUEUED; :meth:`Runtime.run` asserts the
sum.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from ..policy.base import Policy, PolicyContext, PolicyError
from ..policy.types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status, TraceEntry
from .backend import Backend
from .events import ARRIVAL, WAKEUP


@dataclass
class RunRecord:
    """Everything a run produced; metrics are computed from it (``gpuloom.bench.metrics``)."""

    policy: str
    results: list[Result]  # one per request, by request id
    until_ms: float  # arrivals were generated up to here
    end_ms: float  # the clock when the run stopped (after draining)
    gpu_sms: int
    busy_sm_ms: float  # useful SM-milliseconds (see the backend)
    layouts: list[tuple[float, Layout]]  # (time, layout) every time the layout changed
    dispatches: int  # batches submitted
    trace: list[TraceEntry] = field(default_factory=list)  # only with trace=True

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)


class Runtime:
    """Drives ``policy`` against ``backend`` over a list of requests.

    ``ctx`` describes the models (profiles, SLOs, rates); ``trace=True`` records every event for tests.
    """

    def __init__(self, policy: Policy, backend: Backend, ctx: PolicyContext, *, trace: bool = False) -> None:
        self.policy = policy
        self.backend = backend
        self.ctx = ctx
        self.loop = backend.loop
        self.queues: dict[str, deque[Request]] = {m: deque() for m in ctx.models}
        self._trace_on = trace
        self.trace: list[TraceEntry] = []
        self._results: dict[int, Result] = {}
        self._pending: dict[int, Request] = {}  # queued, not yet dispatched or dropped
        self._inflight: dict[int, tuple[Decision, list[Request]]] = {}  # partition -> batch
        self._parts: Sequence[Partition] = ()
        self._ready_ms = 0.0  # the current layout accepts work from here (and once old batches drain)
        self._orphans = 0  # batches of a previous layout still running
        self._orphan_reqs: dict[int, list[Request]] = {}  # id(decision) -> its requests
        self._wake_ms = float("inf")
        self._stop_ms = float("inf")  # no dispatch after this
        self._layouts: list[tuple[float, Layout]] = []
        self._dispatches = 0
        self._free: list[Partition] | None = None  # cache of the free partitions
        self._woke = True  # a wake-up fired (or the run just started): poll the policy's timers

    # -- the loop ---------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], *, until_ms: float, drain_ms: float = 0.0) -> RunRecord:
        """Serve ``requests`` (sorted by arrival, arrivals <= ``until_ms``).

        The policy may dispatch until ``until_ms + drain_ms``; batches running then are allowed to
        finish; whatever is still queued is reported QUEUED.
        """
        self._check_requests(requests, until_ms)
        self.backend.start(self._on_completion)
        self._set_layout(self.policy.setup(self.ctx))
        self._stop_ms = until_ms + drain_ms
        if requests:
            self.loop.schedule(requests[0].arrival_ms, ARRIVAL, self._on_arrival, requests, 0)
        loop = self.loop
        stop = self._stop_ms
        while loop.step():
            now = loop.now
            if now <= stop and loop.peek() != now:
                self._decide()
        return self._record(requests, until_ms)

    # -- event handlers ---------------------------------------------------------------------
    def _on_arrival(self, requests: Sequence[Request], i: int) -> None:
        r = requests[i]
        if i + 1 < len(requests):
            self.loop.schedule(requests[i + 1].arrival_ms, ARRIVAL, self._on_arrival, requests, i + 1)
        self.queues[r.model].append(r)
        self._pending[r.id] = r
        if self._trace_on:
            self._log("arrive", r.model, r.id)
        self.policy.on_arrival(r, self.loop.now)

    def _on_completion(self, c: Completion) -> None:
        d = c.decision
        entry = self._inflight.get(d.partition)
        if entry is None or entry[0] is not d:  # a batch of a replaced layout
            self._orphans -= 1
            reqs = self._orphan_reqs.pop(id(d))
        else:
            del self._inflight[d.partition]
            reqs = entry[1]
            self._free = None
        status = Status.FAILED if c.error else Status.SERVED
        for r in reqs:
            self._results[r.id] = Result(r, status, c.end_ms, c.error, d.batch)
        if self._trace_on:
            self._log("complete", d.model, d.partition, d.request_ids)
        self.policy.on_completion(c, self.loop.now)

    def _on_wakeup(self, t: float) -> None:
        self._woke = True
        if t == self._wake_ms:
            self._wake_ms = float("inf")

    # -- deciding ---------------------------------------------------------------------------
    def _decide(self) -> None:
        now = self.loop.now
        free = self._free_partitions(now) if self._pending else None
        if free:
            for action in self.policy.decide(now, self.queues, free):
                if type(action) is Decision:
                    self._dispatch(action, free)
                elif isinstance(action, Drop):
                    self._drop(action)
                else:
                    raise PolicyError(f"{self.policy.name}: decide returned {action!r}; expected Decision or Drop")
        elif not self._woke:
            return  # nothing the policy could act on, and no timer of its own fired
        self._woke = False
        wake = self.policy.next_wakeup(now)
        if wake is not None and now < wake < self._wake_ms:
            self._wake_ms = wake
            self.loop.schedule(wake, WAKEUP, self._on_wakeup, wake)
        layout = self.policy.layout_change()
        if layout is not None:
            self._set_layout(layout)

    def _free_partitions(self, now: float) -> list[Partition]:
        if now < self._ready_ms or self._orphans:
            return []
        if self._free is None:
            busy = self._inflight
            self._free = [p for p in self._parts if p.index not in busy]
        return self._free

    def _dispatch(self, d: Decision, free: list[Partition]) -> None:
        if d.partition in self._inflight or not any(p.index == d.partition for p in free):
            raise PolicyError(f"{self.policy.name}: decision on partition {d.partition}, which is not free: {d}")
        if not d.request_ids or d.batch < len(d.request_ids):
            raise PolicyError(f"{self.policy.name}: a decision needs 1..batch requests, got {d}")
        reqs = self._take(d.model, d.request_ids)
        self._inflight[d.partition] = (d, reqs)
        self._free = None
        self._dispatches += 1
        if self._trace_on:
            self._log("dispatch", d.model, d.partition, d.request_ids)
        self.backend.submit(d, reqs)

    def _drop(self, drop: Drop) -> None:
        now = self.loop.now
        for r in self._take(drop.model, drop.request_ids):
            self._results[r.id] = Result(r, Status.DROPPED, now, drop.reason)
        if self._trace_on:
            self._log("drop", drop.model, drop.request_ids, drop.reason)

    def _take(self, model: str, ids: tuple[int, ...]) -> list[Request]:
        """Remove ``ids`` from ``model``'s queue (fast when they are its head, as they usually are)."""
        q = self.queues.get(model)
        if q is None:
            raise PolicyError(f"{self.policy.name}: unknown model {model!r}; models: {list(self.queues)}")
        out = []
        for rid in ids:
            r = self._pending.pop(rid, None)
            if r is None or r.model != model:
                raise PolicyError(f"{self.policy.name}: request {rid} is not queued for {model!r}")
            out.append(r)
        if q[0] is out[0]:
            j = 0
        else:  # a block further down the queue (a policy passed over the oldest requests)
            j = q.index(out[0])
            q.rotate(-j)
        for r in out:
            if q and q[0] is r:
                q.popleft()
            else:
                q.remove(r)
        if j:
            q.rotate(j)
        return out

    # -- layouts ----------------------------------------------------------------------------
    def _set_layout(self, layout: Layout) -> None:
        for d, reqs in self._inflight.values():
            self._orphan_reqs[id(d)] = reqs
            self._orphans += 1
        self._inflight = {}
        self._free = None
        self._ready_ms = self.backend.configure(layout)
        self._parts = tuple(self.backend.partitions())
        self._layouts.append((self.loop.now, layout))
        if self._trace_on:
            self._log("layout", tuple((p.sm_offset, p.sms, p.shared, p.owner) for p in layout.partitions))
        if self._ready_ms > self.loop.now:
            self.loop.schedule(self._ready_ms, WAKEUP, self._on_wakeup, self._ready_ms)

    # -- books ------------------------------------------------------------------------------
    def _check_requests(self, requests: Sequence[Request], until_ms: float) -> None:
        last = float("-inf")
        for r in requests:
            if r.model not in self.queues:
                raise ValueError(f"request {r.id} asks for {r.model!r}; the run serves {list(self.queues)}")
            if r.arrival_ms < last:
                raise ValueError(f"requests must be sorted by arrival_ms; request {r.id} arrives at {r.arrival_ms}")
            last = r.arrival_ms
        if requests and last > until_ms:
            raise ValueError(f"request arrives at {last} ms, after the run's end {until_ms} ms")
        if len({r.id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique")

    def _record(self, requests: Sequence[Request], until_ms: float) -> RunRecord:
        results = [self._results.get(r.id) or Result(r, Status.QUEUED) for r in requests]
        n_queued = sum(1 for r in results if r.status == Status.QUEUED)
        assert n_queued == len(self._pending) + sum(len(v[1]) for v in self._inflight.values()), "lost requests"
        assert len(results) == len(self._results) + n_queued, "a request was recorded twice or lost"
        return RunRecord(
            policy=self.policy.name,
            results=results,
            until_ms=until_ms,
            end_ms=self.loop.now,
            gpu_sms=self.backend.gpu_sms,
            busy_sm_ms=self.backend.busy_sm_ms(),
            layouts=self._layouts,
            dispatches=self._dispatches,
            trace=self.trace,
        )

    def _log(self, kind: str, *detail) -> None:
        self.trace.append(TraceEntry(self.loop.now, kind, detail))
