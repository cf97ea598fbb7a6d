"""``ideal``: the simulation-only reference -- a perfect divider of SMs and an oracle scheduler.

The reference D-STACK measures itself against is "an ideal scheduler where each kernel gets exactly
the SMs it can use". Here SMs are one fluid pool with no partition granularity and no fragmentation,
divided by an oracle at every event: each batch is granted SMs (``Decision.sms``, at most its knee)
and running batches get their grants in earliest-deadline order, losslessly; a batch left with
fewer SMs ``s`` runs at ``L(b, s)``, one left with none waits (``Decision.priority`` = the deadline of
the batch's oldest request; see :mod:`gpuloom.runtime.sim`). On top of that the scheduler never
blocks one model behind another (``lanes_per_model`` batches per model in flight), never waits, and
drops a request the moment it can no longer meet its deadline, so no GPU time is spent on it.

Each batch takes as many queued requests as it can (up to the largest bucket with
``L(b, knee(b)) <= SLO / 2``) and, among the SM counts of the profile up to its knee that are free for
it under the EDF division and finish before its oldest request's deadline, the one with the least
SM-time per request (fewer SMs are usually more efficient per SM; the knee is the fastest, not the
most efficient). It is a strong heuristic on an idealized GPU, *not* a proven upper bound: on
measured profiles ``dstack``'s planned space-time packing can beat it (see
``gpuloom.bench.experiment.fluid_bound`` for a capacity bound).

The oracle knows the simulated device's holds (``PolicyContext.sim_hold_ms`` / ``sim_hold_per_ms``,
each model's own ``sim_model_hold_ms`` and ``sim_hold_per_request_ms``, from its
:class:`~gpuloom.runtime.sim.ContentionModel`; the options ``batch_overhead_ms`` (for every model) /
``hold_per_ms`` / ``hold_per_request_ms`` set others, 0 the oracle blind to them): a batch's requests
are answered that long after its GPU work, so its deadline check, its batch cap and its hopeless rule
count the hold too.
Blind, it launches batches whose GPU work meets a deadline its answer misses (forty-fifth session:
under ``--contention h200`` it simulated below dstack planning the hold).

It cannot run on a GPU (the hardware does not divide SMs losslessly), hence ``simulation_only``.
"""

from __future__ import annotations

from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, hopeless, register
from .types import Completion, Decision, Drop, Layout, Partition


@register
class IdealPolicy(Policy):
    name = "ideal"
    deadline_queues = True  # its head is its most urgent request, whatever deadlines clients give
    simulation_only = True

    def __init__(self, lanes_per_model: int = 4, preempt: bool = True, batch_overhead_ms: float | None = None,
                 hold_per_ms: float | None = None, hold_per_request_ms: float | None = None) -> None:
        self.preempt = bool(preempt)
        if lanes_per_model < 1:
            raise ValueError(f"ideal: lanes_per_model must be >= 1, found {lanes_per_model}")
        if any(v is not None and not v >= 0 for v in (batch_overhead_ms, hold_per_ms, hold_per_request_ms)):
            raise ValueError(f"ideal: batch_overhead_ms, hold_per_ms and hold_per_request_ms must be >= 0, found "
                             f"{batch_overhead_ms}, {hold_per_ms}, {hold_per_request_ms}")
        self.lanes_per_model = int(lanes_per_model)
        # None: the simulated device's (layout)
        self._given_holds = (batch_overhead_ms, hold_per_ms, hold_per_request_ms)

    def _answered_ms(self, m: str, gpu_ms: float, n: int) -> float:
        """How long after its launch a batch of ``n`` requests of ``m`` taking ``gpu_ms`` on the GPU
        answers them: the simulated hold too."""
        return gpu_ms * (1.0 + self.hold_per_ms) + self.holds_ms.get(m, self.batch_overhead_ms) \
            + self.hold_per_request_ms * n

    def layout(self, ctx: PolicyContext) -> Layout:
        fixed, per_ms, per_request = self._given_holds
        self.batch_overhead_ms = float(ctx.sim_hold_ms if fixed is None else fixed)
        self.holds_ms = {m: float(ms) for m, ms in ctx.sim_model_hold_ms.items()} if fixed is None else {}
        self.hold_per_ms = float(ctx.sim_hold_per_ms if per_ms is None else per_ms)
        self.hold_per_request_ms = float(ctx.sim_hold_per_request_ms if per_request is None else per_request)
        self.cap, self.fastest, self.demand, self.sm_steps = {}, {}, {}, {}
        for m, i in ctx.models.items():
            p = i.profile
            ok = [b for b in p.batches if self._answered_ms(m, p.latency(b, p.knee(b, ctx.knee_eps)), b) <= i.slo_ms / 2]
            self.cap[m] = max(ok or [p.batches[0]])
            self.demand[m] = {b: min(ctx.gpu_sms, p.knee(b, ctx.knee_eps)) for b in p.batches}
            # SM counts a batch may be granted: the profile's, up to its knee
            self.sm_steps[m] = {b: [s for s in p.sms if s <= self.demand[m][b]] or [p.sms[0]] for b in p.batches}
            # the soonest a batch of one can answer on the SMs it may be granted (not the whole GPU's:
            # a request between the two was neither dropped nor run, left queued on an idle GPU)
            b1 = p.batches[0]
            self.fastest[m] = self._answered_ms(m, min(p.latency(b1, s) for s in self.sm_steps[m][b1]), 1)
        self.running: dict[int, tuple[float, float]] = {}  # partition -> (priority, SMs demanded)
        return Layout.shared_lanes(ctx.gpu_sms, [m for m in ctx.models for _ in range(self.lanes_per_model)])

    def on_completion(self, completion: Completion, now_ms: float) -> None:
        self.running.pop(completion.decision.partition, None)

    def _room(self, priority: float) -> float:
        """SMs a batch of this priority would get under the EDF division (before its own demand)."""
        ahead = sum(d for p, d in self.running.values() if p <= priority or not self.preempt)
        return self.ctx.gpu_sms - ahead

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        out: list[Action] = []
        lanes: dict[str, list[Partition]] = {}
        for p in free:
            lanes.setdefault(p.owner, []).append(p)
        pos = {m: 0 for m in queues}  # requests of each queue already taken or dropped by this call
        for m, q in queues.items():
            dead = hopeless(q, now_ms, self.fastest[m])
            if dead:
                out.append(Drop(m, dead, "deadline"))
                pos[m] = len(dead)
        while True:
            best = None
            for m, q in queues.items():  # the model whose next request is due first
                if pos[m] < len(q) and lanes.get(m) and (best is None or q[pos[m]].deadline_ms < queues[best][pos[best]].deadline_ms):
                    best = m
            if best is None:
                break
            q, i, prof = queues[best], pos[best], self.ctx.models[best].profile
            n = min(len(q) - i, self.cap[best])
            prio = q[i].deadline_ms
            room = self._room(prio)
            choice = self._choose(best, prof, n, room, prio - now_ms)
            if choice is None:
                lanes[best] = []  # nothing of this model fits now; a completion will wake us
                continue
            k, sms = choice
            lane = lanes[best].pop(0)
            ids = tuple(q[i + j].id for j in range(k))
            out.append(Decision(best, ids, k, lane.index, sms=sms, priority=prio if self.preempt else None))
            self.running[lane.index] = (prio, sms)
            pos[best] = i + k
        return out

    def _choose(self, m: str, prof, n: int, room: float, slack_ms: float) -> tuple[int, int] | None:
        """(requests, SMs) for the next batch of ``m``: the most requests, then the least SM-time per
        request, among batches that fit ``room`` SMs (at most their knee) and finish within ``slack_ms``."""
        best = None
        for b in prof.batches:
            k = min(b, n)
            for s in self.sm_steps[m][b]:
                if s > room:
                    break
                lat = prof.latency(b, s)
                if self._answered_ms(m, lat, k) > slack_ms:
                    continue
                key = (k, -s * lat / k)
                if best is None or key > best[0]:
                    best = (key, k, s)
            if b >= n:
                break
        return None if best is None else (best[1], best[2])

    def describe(self) -> dict:
        return {"name": self.name, "lanes_per_model": self.lanes_per_model, "batch_cap": dict(self.cap),
                "batch_overhead_ms": self.batch_overhead_ms, "model_hold_ms": dict(self.holds_ms),
                "hold_per_ms": self.hold_per_ms, "hold_per_request_ms": self.hold_per_request_ms}
