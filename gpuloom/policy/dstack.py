"""``dstack``: run the planner's space-time schedule, fill idle slots, re-plan on drift.

Follows Dhakal et al., "D-STACK: High Throughput DNN Inference by Effective Multiplexing and
Spatio-Temporal Scheduling of GPUs" (IEEE TCC 2024): each model gets a disjoint SM partition sized
where it stops speeding up (its knee) and a batch that fits its SLO; models that share a partition
take turns in a repeating cycle (:func:`gpuloom.plan.plan` makes the :class:`~gpuloom.plan.Schedule`).

At run time, when a partition is free at phase ``phi`` of its cycle (the cycle starts when the
layout is ready):

1. **slot owner first**: the model whose slot contains ``phi`` runs up to its planned batch;
2. **work-conserving fill**: otherwise (the owner has nothing queued, or ``phi`` falls in a gap)
   any model with queued work may run -- earliest deadline first -- as long as its batch ends before
   the next slot of *another* model in this partition begins (so no other model's planned slot is
   delayed) and before its oldest request's deadline. The batch is the largest bucket up to the
   model's planned batch that fits both;
3. nothing fits: wake up at the next slot start.

A request is dropped (reason ``"deadline"``) only when it can no longer meet its deadline on any
partition, even as a batch of one started now. Arrivals feed a
:class:`~gpuloom.plan.RateEstimator`; every ``check_ms`` the :class:`~gpuloom.plan.Replanner`
decides (hysteresis band, hold time, switch cost) whether measured rates drifted enough to switch
to a new schedule; the runtime then drains the running batches and starts the new layout.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from ..plan import Demand, RateEstimator, Replanner, Schedule, plan
from ..profile.store import ProfileStore
from .base import Action, Policy, PolicyContext, Queues, hopeless, register
from .types import Decision, Drop, Layout, Partition


class _PartPlan:
    """One partition's cycle, indexed for fast look-ups (private)."""

    __slots__ = ("sms", "starts", "ends", "models", "other_starts")

    def __init__(self, part, models: Sequence[str]) -> None:
        slots = sorted(part.slots, key=lambda s: s.start_ms)
        self.sms = part.sms
        self.starts = [s.start_ms for s in slots]
        self.ends = [s.end_ms for s in slots]
        self.models = [s.model for s in slots]
        # for a filler x: sorted starts of the slots of every model other than x
        self.other_starts = {x: [s.start_ms for s in slots if s.model != x] for x in models}

    def owner_at(self, phi: float) -> str | None:
        i = bisect.bisect_right(self.starts, phi) - 1
        if i >= 0 and phi < self.ends[i]:
            return self.models[i]
        return None

    def horizon(self, x: str, phi: float, cycle: float) -> float:
        """Time from phase ``phi`` until the next slot of a model other than ``x`` starts (ms)."""
        others = self.other_starts[x]
        if not others:
            return math.inf
        i = bisect.bisect_left(others, phi)
        nxt = others[i] if i < len(others) else others[0] + cycle
        return nxt - phi

    def next_start(self, phi: float, cycle: float) -> float:
        """Time from ``phi`` until the next slot start (ms); inf without slots."""
        if not self.starts:
            return math.inf
        i = bisect.bisect_right(self.starts, phi)
        nxt = self.starts[i] if i < len(self.starts) else self.starts[0] + cycle
        return nxt - phi


@register
class DStackPolicy(Policy):
    name = "dstack"

    def __init__(
        self,
        headroom: float = 0.0,
        replan: bool = True,
        check_ms: float = 250.0,
        window_s: float = 2.0,
        band: float = 0.2,
        hold_s: float = 2.0,
        switch_cost_s: float = 0.5,
        schedule: Schedule | None = None,
    ) -> None:
        if headroom < 0 or check_ms <= 0:
            raise ValueError(f"dstack: need headroom >= 0 and check_ms > 0, found {headroom}, {check_ms}")
        self.headroom = float(headroom)
        self.replan = bool(replan)
        self.check_ms = float(check_ms)
        self.window_s, self.band, self.hold_s, self.switch_cost_s = window_s, band, hold_s, switch_cost_s
        self._given = schedule
        self._wake: float | None = None
        self._now = 0.0
        self._next_check = 0.0
        self._pending_layout: Layout | None = None
        self.replans = 0

    # -- setup ------------------------------------------------------------------------------
    def layout(self, ctx: PolicyContext) -> Layout:
        self.store = ProfileStore(profiles=[i.profile for i in ctx.models.values()])
        demands = [Demand(m, i.rate, i.slo_ms, i.weight) for m, i in ctx.models.items()]
        kwargs = {"gpu_sms": ctx.gpu_sms, "granularity": ctx.granularity, "eps": ctx.knee_eps, "headroom": self.headroom}
        sched = self._given or plan(demands, self.store, **kwargs)
        self.replanner = Replanner(
            demands, self.store, schedule=sched, band=self.band, hold_s=self.hold_s,
            switch_cost_s=self.switch_cost_s, plan_kwargs=kwargs,
        ) if self.replan else None
        self.estimator = RateEstimator(self.window_s)
        self._next_check = self.check_ms
        return self._adopt(sched, 0.0)

    def _adopt(self, sched: Schedule, now_ms: float) -> Layout:
        """Index ``sched`` and return its layout; its cycles start at ``now_ms``."""
        if sched.gpu_sms != self.ctx.gpu_sms:
            raise ValueError(f"dstack: schedule for {sched.gpu_sms} SMs, the GPU has {self.ctx.gpu_sms}")
        self.schedule = sched
        self.epoch = now_ms
        self.cycle = sched.cycle_ms
        models = list(self.ctx.models)
        self.parts = [_PartPlan(p, models) for p in sched.partitions]
        planned = {mp.model: mp for mp in sched.models}
        self.cap = {}
        for m, info in self.ctx.models.items():
            mp = planned.get(m)
            self.cap[m] = mp.batch if mp is not None and mp.batch >= 1 else info.profile.batches[0]
        biggest = max(p.sms for p in sched.partitions)
        self.fastest = {m: i.profile.latency(i.profile.batches[0], biggest) for m, i in self.ctx.models.items()}
        parts = []
        for p in sched.partitions:
            owner = p.models[0] if len(p.models) == 1 else None
            parts.append(Partition(p.index, p.sm_offset, p.sms, shared=False, owner=owner, label=f"p{p.index}[{p.sm_offset}:{p.sm_offset + p.sms}]"))
        return Layout(tuple(parts), sched.gpu_sms)

    # -- events -----------------------------------------------------------------------------
    def on_arrival(self, request, now_ms: float) -> None:
        self.estimator.observe(request.model, now_ms / 1000.0)

    # -- deciding ---------------------------------------------------------------------------
    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        self._now = now_ms
        out: list[Action] = []
        pos: dict[str, int] = {}
        for m, q in queues.items():
            if q:
                dead = hopeless(q, now_ms, self.fastest[m])
                if dead:
                    out.append(Drop(m, dead, "deadline"))
                pos[m] = len(dead)
        wake = math.inf
        phi_all = (now_ms - self.epoch) % self.cycle if self.cycle > 0 else 0.0
        for p in free:
            pp = self.parts[p.index]
            phi = phi_all
            owner = pp.owner_at(phi)
            cands = [m for m, i in pos.items() if i < len(queues[m])]
            if not cands:
                break
            cands.sort(key=lambda m: (m != owner, queues[m][pos[m]].deadline_ms))
            for m in cands:
                k = self._batch(m, queues[m], pos[m], pp, phi, now_ms)
                if k:
                    q, i = queues[m], pos[m]
                    out.append(Decision(m, tuple(q[i + j].id for j in range(k)), k, p.index))
                    pos[m] = i + k
                    break
            else:
                wake = min(wake, now_ms + pp.next_start(phi, self.cycle))
        self._wake = wake if math.isfinite(wake) else None
        return out

    def _batch(self, m: str, q, i: int, pp: _PartPlan, phi: float, now_ms: float) -> int:
        """Requests of ``m`` (from queue position ``i``) to run now on ``pp``; 0 = none fits."""
        prof = self.ctx.models[m].profile
        n = min(len(q) - i, self.cap[m])
        room = min(pp.horizon(m, phi, self.cycle), q[i].deadline_ms - now_ms)
        best = 0
        for b in prof.batches:
            k = min(b, n)
            if prof.latency(k, pp.sms) <= room + 1e-9:
                best = k
            if b >= n:
                break
        return best

    def next_wakeup(self, now_ms: float) -> float | None:
        self._now = now_ms
        t = self._wake if self._wake is not None and self._wake > now_ms else None
        if self.replanner is not None:
            t = self._next_check if t is None else min(t, self._next_check)
        return t

    def layout_change(self) -> Layout | None:
        if self.replanner is None or self._now < self._next_check:
            return None
        now_s = self._now / 1000.0
        self._next_check = self._now + self.check_ms
        rates = {m: self.estimator.rate(m, now_s) for m in self.ctx.models}
        d = self.replanner.check(now_s, rates)
        if not d.replan:
            return None
        self.replans += 1
        return self._adopt(d.schedule, self._now)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "cycle_ms": self.cycle,
            "partitions": [(p.sms, list(dict.fromkeys(pp for pp in self.parts[p.index].models))) for p in self.schedule.partitions],
            "batch": dict(self.cap),
            "replans": self.replans,
            "short": list(self.schedule.short),
        }
