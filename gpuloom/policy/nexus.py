"""``nexus``: Nexus's batch sizing from the SLO, squishy bin packing into a duty cycle, early drop.

Follows Shen et al., "Nexus: A GPU Cluster Engine for Accelerating DNN-Based Video Analysis",
SOSP 2019 (section 6.1, squishy bin packing; section 6.3, early drop):

* each model's largest batch ``B`` satisfies ``2 * L(B) <= SLO`` (half the SLO to gather a batch,
  half to run it; ``L`` = whole-GPU latency);
* a model alone would use the largest batch ``b <= B`` whose fill time at its rate plus its latency
  fits the SLO (``b / rate + L(b) <= SLO``); its duty cycle is that fill time ``b / rate``;
* sessions on one GPU are merged into one node whose duty cycle ``d`` is the smallest of theirs:
  each model runs one batch of ``ceil(rate * d)`` (at most ``B``) per cycle -- the batches are
  *squished* to the shorter cycle, so every SLO still holds -- and the node fits when the batches'
  latencies sum to at most ``d`` (occupancy <= 1). With one GPU there is no other node to spill to:
  an over-full node is kept and its cycle simply runs longer than ``d``;
* the GPU executes the node's batches one after another (Nexus's backend runs one model's batch at a
  time: one stream over the whole GPU), round-robin over models, skipping models with nothing queued;
* when more than a model's planned batch is queued (the node is over-full, or a burst came), it
  takes up to ``B`` (``grow_batches=True``, the generous reading of Nexus's "up to the batch size";
  ``False`` keeps the planned batch);
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
    deadline_queues = True  # its head is its most urgent request, whatever deadlines clients give

    def __init__(self, duty_cycle_ms: float | None = None, grow_batches: bool = True) -> None:
        self._d_opt = duty_cycle_ms
        self.grow_batches = bool(grow_batches)
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

        # per model: the largest batch whose fill time at its rate plus its latency fits the SLO
        # (and whose latency fits half of it); its duty cycle is that fill time
        per = {}
        for m, i in models.items():
            b_best = i.profile.batches[0]
            for b in i.profile.batches:
                if b > self.max_batch[m]:
                    break
                if i.rate > 0 and b / i.rate * 1000.0 + lat(m, b) <= i.slo_ms:
                    b_best = b
            per[m] = b_best / i.rate * 1000.0 if i.rate > 0 else float("inf")
        d = self._d_opt or min(per.values())
        if not d < float("inf"):
            d = min(i.slo_ms for i in models.values()) / 2
        # merged node: every model runs one batch per common duty cycle d (d <= each model's own)
        batch = {m: max(1, min(self.max_batch[m], math.ceil(i.rate * d / 1000.0))) for m, i in models.items()}
        occupancy = sum(lat(m, b) for m, b in batch.items()) / d
        return d, batch, occupancy

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
            b = self.max_batch[m] if self.grow_batches else self.batch[m]
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
                "max_batch": dict(self.max_batch), "grow_batches": self.grow_batches,
                "occupancy": self.occupancy}
