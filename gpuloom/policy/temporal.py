"""``temporal``: time sharing, one model at a time on the whole GPU.

The classic baseline of the D-STACK paper (Dhakal et al., "D-STACK: High Throughput DNN Inference
by Effective Multiplexing and Spatio-Temporal Scheduling of GPUs", IEEE TCC 2024): a single stream
over the whole GPU; whenever it is free it runs the model whose oldest queued request has the
earliest deadline, with as many of its requests as fit a batch whose whole-GPU latency is at most
half the SLO. No concurrency, so no contention; nothing is dropped.
"""

from __future__ import annotations

from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, register, slo_batch_cap, take
from .types import Decision, Layout, Partition


@register
class TemporalPolicy(Policy):
    name = "temporal"

    def layout(self, ctx: PolicyContext) -> Layout:
        self.max_batch = {m: slo_batch_cap(i.profile, ctx.gpu_sms, i.slo_ms / 2) for m, i in ctx.models.items()}
        return Layout.shared_lanes(ctx.gpu_sms, [None])

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        best = None
        for m, q in queues.items():
            if q and (best is None or q[0].deadline_ms < queues[best][0].deadline_ms):
                best = m
        if best is None:
            return []
        q = queues[best]
        k = min(len(q), self.max_batch[best])
        return [Decision(best, take(q, k), k, free[0].index)]
