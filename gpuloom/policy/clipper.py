"""``clipper``: Clipper's adaptive batching, AIMD on each model's batch size.

Follows Crankshaw et al., "Clipper: A Low-Latency Online Prediction Serving System", NSDI 2017,
section 4.3.1: each model container takes the queued requests up to its current maximum batch size
as soon as it is free (no waiting); the maximum grows additively (``step``) after every batch whose
processing latency met the latency objective and shrinks multiplicatively (by ``backoff``, 10% in
the paper) after one that exceeded it. Model containers share the GPU without partitions: one
stream over the whole GPU per container replica. No request is dropped.
"""

from __future__ import annotations

import math
from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, register, take
from .types import Completion, Decision, Layout, Partition


@register
class ClipperPolicy(Policy):
    name = "clipper"

    def __init__(self, replicas: int = 1, step: int = 1, backoff: float = 0.9, start_batch: int = 1) -> None:
        if replicas < 1 or step < 1 or not (0 < backoff < 1) or start_batch < 1:
            raise ValueError(
                f"clipper: need replicas >= 1, step >= 1, 0 < backoff < 1, start_batch >= 1; found "
                f"{replicas}, {step}, {backoff}, {start_batch}"
            )
        self.replicas, self.step, self.backoff, self.start_batch = int(replicas), int(step), float(backoff), int(start_batch)

    def layout(self, ctx: PolicyContext) -> Layout:
        self.cap: dict[str, int] = {m: self.start_batch for m in ctx.models}
        return Layout.shared_lanes(ctx.gpu_sms, [m for m in ctx.models for _ in range(self.replicas)])

    def on_completion(self, completion: Completion, now_ms: float) -> None:
        """The AIMD step: compare the batch's processing latency with the model's SLO."""
        m = completion.decision.model
        info = self.ctx.models[m]
        took = completion.end_ms - completion.start_ms
        if took > info.slo_ms:
            self.cap[m] = max(1, math.floor(self.cap[m] * self.backoff))
        elif len(completion.decision.request_ids) >= self.cap[m]:  # only a full batch says more would fit
            self.cap[m] = min(info.profile.max_batch, self.cap[m] + self.step)

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        out: list[Action] = []
        taken: dict[str, int] = {}
        for p in free:
            m = p.owner
            q = queues[m]
            skip = taken.get(m, 0)
            k = min(len(q) - skip, self.cap[m])
            if k <= 0:
                continue
            ids = tuple(q[skip + i].id for i in range(k)) if skip else take(q, k)
            taken[m] = skip + k
            out.append(Decision(m, ids, k, p.index))
        return out

    def describe(self) -> dict:
        return {"name": self.name, "replicas": self.replicas, "step": self.step, "backoff": self.backoff,
                "batch_caps": dict(self.cap)}
