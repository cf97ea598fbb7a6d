"""``gslice``: static spatial partitions at each model's knee plus adaptive batching.

Follows Dhakal et al., "GSLICE: Controlled Spatial Sharing of GPUs for a Scalable Inference
Platform", SoCC 2020: every model gets its own slice of SMs (MPS active-thread percentage; here an
exclusive partition) sized at the knee of its latency-vs-SMs curve, and batches adaptively so that
a batch's execution fits half the SLO.

* batch ``b``: the smallest profile bucket whose knee-SM throughput covers the model's expected rate
  while ``L(b, knee(b)) <= SLO / 2`` (the largest such bucket when none covers it);
* partition: ``knee(b)`` rounded up to the partition granularity. SMs are handed out one granule at a
  time to the most loaded model (``rate / throughput`` on its current slice) still below its knee; when
  the knees fit, the SMs they leave free go the same way to the most loaded model (GSLICE's
  self-tuning grows the slices of models that miss their SLO, so its converged state uses the whole
  GPU; ``share_leftover=False`` stops at the knees);
* adaptive batching at run time: a free partition takes up to ``cap`` queued requests at once, where
  ``cap`` is the largest bucket with ``L(cap, sms) <= SLO / 2`` on that partition (the fixed point of
  GSLICE's batch-size tuning); no waiting, no dropping.
"""

from __future__ import annotations

import math
from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, register, slo_batch_cap, take
from .types import Decision, Layout, Partition


@register
class GslicePolicy(Policy):
    name = "gslice"

    def __init__(self, share_leftover: bool = True) -> None:
        self.share_leftover = bool(share_leftover)

    def layout(self, ctx: PolicyContext) -> Layout:
        g, total = ctx.granularity, ctx.gpu_sms
        if g * len(ctx.models) > total:
            raise ValueError(f"gslice: {len(ctx.models)} models need at least {g} SMs each; the GPU has {total}")
        want: dict[str, int] = {}
        for m, info in ctx.models.items():
            p = info.profile
            chosen = None
            for b in p.batches:
                k = p.knee(b, ctx.knee_eps)
                if p.latency(b, k) > info.slo_ms / 2:
                    break
                chosen = b
                if p.throughput(b, k) >= info.rate:
                    break
            b = chosen or p.batches[0]
            want[m] = max(g, math.ceil(p.knee(b, ctx.knee_eps) / g) * g)
        # Hand out granules, one at a time, to the most loaded model still below its knee; then (the
        # leftover, when knees fit) to the most loaded model overall.
        sms = {m: g for m in want}

        def load(m: str) -> float:
            info = ctx.models[m]
            cap = slo_batch_cap(info.profile, sms[m], info.slo_ms / 2)
            return info.rate / info.profile.throughput(cap, sms[m])

        while total - sum(sms.values()) >= g:
            below = [m for m in sms if sms[m] < want[m]]
            if not below and not self.share_leftover:
                break
            m = max(below or sms, key=load)
            sms[m] += g
        self.cap = {m: slo_batch_cap(ctx.models[m].profile, s, ctx.models[m].slo_ms / 2) for m, s in sms.items()}
        self.sms = sms
        return Layout.exclusive(total, [(s, m) for m, s in sms.items()])

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        out: list[Action] = []
        for p in free:
            q = queues[p.owner]
            if q:
                k = min(len(q), self.cap[p.owner])
                out.append(Decision(p.owner, take(q, k), k, p.index))
        return out

    def describe(self) -> dict:
        return {"name": self.name, "sms": dict(self.sms), "batch_cap": dict(self.cap)}
