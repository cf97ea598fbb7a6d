"""``triton``: NVIDIA Triton Inference Server's dynamic batcher, each model on its own streams.

Follows Triton's model configuration semantics (``dynamic_batching`` and ``instance_group`` in
``model_config.proto``, and the "Dynamic Batcher" section of Triton's user guide):

* every model has ``instances`` execution instances; each is a stream over the *whole* GPU that
  runs one batch at a time, and instances of different models run concurrently, so the GPU's
  hardware scheduler shares the SMs (the simulator's contention model);
* when an instance is free, the batcher takes up to ``max_batch_size`` queued requests. A batch of
  ``max_batch_size``, or of one of the ``preferred_batch_sizes``, goes at once; a smaller batch waits
  until its oldest request has waited ``max_queue_delay_ms``, then goes with whatever is queued;
* no request is dropped (no queue-policy timeouts configured); late ones are served late.

Defaults are what a careful operator would set, not a strawman: ``max_batch_size`` is the largest
batch whose whole-GPU latency is at most half the SLO, ``max_queue_delay_ms`` is a tenth of the SLO.
"""

from __future__ import annotations

from typing import Sequence

from .base import Action, Policy, PolicyContext, Queues, register, slo_batch_cap, take
from .types import Decision, Layout, Partition


@register
class TritonPolicy(Policy):
    name = "triton"

    def __init__(
        self,
        instances: int = 1,
        max_queue_delay_ms: float | None = None,
        preferred_batch_sizes: Sequence[int] = (),
        max_batch_size: int | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"triton: instances must be >= 1, found {instances}")
        if max_queue_delay_ms is not None and max_queue_delay_ms < 0:
            raise ValueError(f"triton: max_queue_delay_ms must be >= 0, found {max_queue_delay_ms}")
        self.instances = int(instances)
        self._delay_opt = max_queue_delay_ms
        self.preferred = tuple(sorted(int(b) for b in preferred_batch_sizes))
        self._max_opt = max_batch_size
        self._wake: float | None = None

    def layout(self, ctx: PolicyContext) -> Layout:
        self.delay: dict[str, float] = {}
        self.max_batch: dict[str, int] = {}
        for m, info in ctx.models.items():
            self.delay[m] = self._delay_opt if self._delay_opt is not None else 0.1 * info.slo_ms
            cap = self._max_opt or slo_batch_cap(info.profile, ctx.gpu_sms, info.slo_ms / 2)
            self.max_batch[m] = min(cap, info.profile.max_batch)
        return Layout.shared_lanes(ctx.gpu_sms, [m for m in ctx.models for _ in range(self.instances)])

    def batch_size(self, model: str, queued: int, waited_ms: float) -> int:
        """Requests the batcher sends now (0 = keep waiting), Triton's rules."""
        cap = self.max_batch[model]
        if queued >= cap:
            return cap
        pref = [b for b in self.preferred if b <= queued and b <= cap]
        if pref:
            return pref[-1]
        if waited_ms >= self.delay[model] - 1e-9:
            return queued
        return 0

    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        out: list[Action] = []
        self._wake = None
        taken: dict[str, int] = {}
        for p in free:
            m = p.owner
            q = queues[m]
            skip = taken.get(m, 0)
            n = len(q) - skip
            if n <= 0:
                continue
            oldest = q[skip]
            k = self.batch_size(m, n, now_ms - oldest.arrival_ms)
            if k == 0:
                t = oldest.arrival_ms + self.delay[m]
                self._wake = t if self._wake is None else min(self._wake, t)
                continue
            ids = tuple(q[skip + i].id for i in range(k)) if skip else take(q, k)
            taken[m] = skip + k
            out.append(Decision(m, ids, k, p.index))
        return out

    def next_wakeup(self, now_ms: float) -> float | None:
        return self._wake

    def describe(self) -> dict:
        return {"name": self.name, "instances": self.instances, "max_queue_delay_ms": self.delay,
                "max_batch_size": self.max_batch, "preferred_batch_sizes": list(self.preferred)}
