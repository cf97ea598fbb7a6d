"""``nexus``: Nexus's batch sizing from the SLO, squishy bin packing into a duty cycle, early drop.

Follows Shen et al., "Nexus: A GPU Cluster Engine for Accelerating DNN-Based Video Analysis",
SOSP 2019 (section 6.1, squishy bin packing; section 6.3, early drop):

* each model's largest batch ``B`` satisfies ``2 * L(B) <= SLO`` (half the SLO to gather a batch,
  half to run it; ``L`` = whole-GPU latency);
* sessions on one GPU are merged into one node with a common *duty cycle* ``d``: each model runs one
  batch of ``b = ceil(rate * d)`` (at most ``B``) per cycle, and the node fits when the batches'
  latencies sum to at most ``d`` while ``d + L(b) <= SLO`` for every model. ``d`` starts at the
  smallest per-model duty cycle and is *squished* up (bigger, more efficient batches) while that
  lowers the node's occupancy and every SLO still holds. On one GPU there is no other node to spill
  to, so an over-full node keeps the least-occupied feasible duty cycle;
* the GPU executes the node's batches one after another (Nexus's backend runs one model's batch at a
  time: one stream over the whole GPU), round-robin over models, skipping models with nothing queued;
* early drop: before a model's turn, requests at the head of its queue that would miss their
  deadline even if the batch started now are dropped (reason ``"deadline"``).
"""

from __future__ import annotations

import math
from typing import Sequence

from .base import Action, ModelInfo, Policy, PolicyContext, Queues, register, slo_batch_cap, take
from .types import Decision, Drop, Layout, Partition


@register
class NexusPolicy(Policy):
    name = "nexus"

    def __init__(self, duty_cycle_ms: float | None = None) -> None:
        self._d_opt = duty_cycle_ms
        self._rr = 0

    def layout(self, ctx: PolicyContext) -> Layout:
        self.order = list(ctx.models)
        self.full = ctx.gpu_sms
        self.max_batch = {m: slo_batch_cap(i.profile, ctx.gpu_sms, i.slo_ms / 2) for m, i in ctx.models.items()}
        self.duty_ms, self.batch, self.occupancy = self.pack(ctx.models)
        return Layout.shared_lanes(ctx.gpu_sms, [None])

    def pack(self, models: dict[str, ModelInfo]) -> tuple[float, dict[str, int], float]:
        """Squishy bin packing of all models into one node: (duty cycle ms, batch per model, occupancy)."""
        def lat(m: str, b: int) -> float:
            return models[m].profile.latency(b, self.full)

        def batches(d: float) -> dict[str, int]:
            return {m: max(1, min(self.max_batch[m], math.ceil(i.rate * d / 1000.0))) for m, i in models.items()}

        # per-model duty cycle: time to gather its largest SLO-feasible batch at its rate
        per = []
        for m, i in models.items():
            b = self.max_batch[m]
            per.append(b / i.rate * 1000.0 if i.rate > 0 else float("inf"))
        d0 = self._d_opt or min(per)
        if not math.isfinite(d0):
            d0 = min(i.slo_ms for i in models.values()) / 2
        best = None
        d = d0
        slo_room = min(i.slo_ms for i in models.values())
        while d <= slo_room:
            bs = batches(d)
            if all(d + lat(m, b) <= models[m].slo_ms for m, b in bs.items()):
                occ = sum(lat(m, b) for m, b in bs.items()) / d
                if best is None or occ < best[2] - 1e-12:
                    best = (d, bs, occ)
                if occ <= 1.0 or self._d_opt:
                    break
            d *= 1.1
        if best is None:  # nothing satisfies every SLO: keep the smallest cycle
            bs = batches(d0)
            best = (d0, bs, sum(lat(m, b) for m, b in bs.items()) / d0)
        return best

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        out: list[Action] = []
        lane = free[0]
        n_models = len(self.order)
        for step in range(n_models):
            m = self.order[(self._rr + step) % n_models]
            q = queues[m]
            if not q:
                continue
            prof = self.ctx.models[m].profile
            b = self.batch[m]
            dropped = []
            i = 0
            while i < len(q):
                k = min(len(q) - i, b)
                if now_ms + prof.latency(k, self.full) > q[i].deadline_ms:
                    dropped.append(q[i].id)
                    i += 1
                else:
                    break
            if dropped:
                out.append(Drop(m, tuple(dropped), "deadline"))
            k = min(len(q) - i, b)
            if k <= 0:
                continue
            ids = tuple(q[i + j].id for j in range(k)) if i else take(q, k)
            out.append(Decision(m, ids, k, lane.index))
            self._rr = (self._rr + step + 1) % n_models
            break
        return out

    def describe(self) -> dict:
        return {"name": self.name, "duty_cycle_ms": self.duty_ms, "batch": dict(self.batch),
                "occupancy": self.occupancy}
