"""``ideal``: the simulation-only upper bound -- a perfect divider of SMs and an oracle scheduler.

The bound D-STACK measures itself against is "an ideal scheduler where each kernel gets exactly the
SMs it can use". Here SMs are one fluid pool with no partition granularity and no fragmentation,
divided by an oracle at every event: running batches get SMs in earliest-deadline order, each up to
its knee ``knee(b)`` (at which it runs at whole-GPU speed ``L(b, A)``), losslessly; a batch left with
fewer SMs ``s`` runs at ``L(b, s)``, one left with none waits (``Decision.priority`` = the deadline of
the batch's oldest request; see :mod:`gpuloom.runtime.sim`). On top of that the scheduler never
blocks one model behind another (``lanes_per_model`` batches per model in flight), batches as much as
is queued up to the largest bucket with ``L(b, knee(b)) <= SLO / 2``, never waits, and drops a
request the moment it can no longer meet its deadline, so no GPU time is spent on it.

Admission keeps EDF from collapsing under overload: a batch starts only if, among the batches due
before it, it still gets at least ``min(knee, min_sms)`` SMs and, on what it gets, finishes by its
oldest request's deadline; the largest such batch is taken.

It cannot run on a GPU (the hardware does not divide SMs losslessly), hence ``simulation_only``.
"""

from __future__ import annotations

from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, hopeless, register
from .types import Completion, Decision, Drop, Layout, Partition


@register
class IdealPolicy(Policy):
    name = "ideal"
    simulation_only = True

    def __init__(self, lanes_per_model: int = 4, preempt: bool = True, min_sms: int = 8) -> None:
        self.preempt = bool(preempt)
        self.min_sms = int(min_sms)
        if lanes_per_model < 1:
            raise ValueError(f"ideal: lanes_per_model must be >= 1, found {lanes_per_model}")
        self.lanes_per_model = int(lanes_per_model)

    def layout(self, ctx: PolicyContext) -> Layout:
        self.cap, self.fastest, self.demand = {}, {}, {}
        for m, i in ctx.models.items():
            p = i.profile
            ok = [b for b in p.batches if p.latency(b, p.knee(b, ctx.knee_eps)) <= i.slo_ms / 2]
            self.cap[m] = max(ok or [p.batches[0]])
            self.fastest[m] = p.full_latency(p.batches[0])
            self.demand[m] = {b: min(ctx.gpu_sms, p.knee(b, ctx.knee_eps)) for b in p.batches}
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
            k = 0
            room = self._room(prio)
            for b in reversed(prof.batches):  # the largest batch that can start now and make its deadline
                if b > n and prof.bucket(n) != b:
                    continue
                demand = self.demand[best][b]
                s = min(demand, room)
                if s >= min(demand, self.min_sms) and now_ms + prof.latency(b, max(s, prof.sms[0])) <= prio:
                    k = min(b, n)
                    break
            if k == 0:
                lanes[best] = []  # nothing of this model fits now; a completion will wake us
                continue
            lane = lanes[best].pop(0)
            ids = tuple(q[i + j].id for j in range(k))
            out.append(Decision(best, ids, k, lane.index, priority=prio if self.preempt else None))
            self.running[lane.index] = (prio, self.demand[best][prof.bucket(k)])
            pos[best] = i + k
        return out

    def describe(self) -> dict:
        return {"name": self.name, "lanes_per_model": self.lanes_per_model, "batch_cap": dict(self.cap)}
