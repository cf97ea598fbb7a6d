"""The small, typed records that cross between the policies, the runtime and the backends.

All frozen: a policy builds a :class:`Decision`, the runtime validates it and hands it to a
backend; the backend answers with a :class:`Completion`. Times are milliseconds on the backend's
clock (simulated or wall), SM counts are streaming multiprocessors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request, as the runtime queues it."""

    id: int  # unique within a run, increasing in arrival order
    model: str  # profile name of the model it asks for
    arrival_ms: float  # when it entered the runtime
    deadline_ms: float  # arrival_ms + the model's SLO


@dataclass(frozen=True, slots=True)
class Partition:
    """A place a batch can run: an exclusive SM partition or a shared lane over the GPU.

    * ``shared=False``: SMs ``[sm_offset, sm_offset + sms)`` belong to this partition alone (a green
      context on the GPU). A batch on it runs for ``L(b, sms)``.
    * ``shared=True``: a stream over the SMs not owned by exclusive partitions (the whole GPU when
      there are none). Batches on several shared lanes compete for SMs; the simulated backend
      slows them down by its :class:`~gpuloom.runtime.sim.ContentionModel`.

    Either kind runs one batch at a time (a stream's batches serialize; a model instance in Triton
    executes one batch at a time).
    """

    index: int  # position in the layout, what a Decision names
    sm_offset: int  # first SM (exclusive partitions); 0 for shared lanes
    sms: int  # SMs of the partition; for shared lanes the SMs they share
    shared: bool = False
    owner: str | None = None  # model the partition is meant for (a hint); None = any model
    label: str = ""  # for traces and reprs, e.g. "p0[0:48]" or "resnet50#1"

    def __repr__(self) -> str:
        kind = "shared" if self.shared else f"SMs {self.sm_offset}:{self.sm_offset + self.sms}"
        own = f" owner={self.owner}" if self.owner else ""
        return f"Partition({self.index}, {kind}, sms={self.sms}{own})"


@dataclass(frozen=True)
class Layout:
    """The partitions a policy asks the backend to set up, in index order."""

    partitions: tuple[Partition, ...]
    gpu_sms: int  # SMs of the device the layout was made for

    def __post_init__(self) -> None:
        parts = tuple(self.partitions)
        object.__setattr__(self, "partitions", parts)
        if not parts:
            raise ValueError("a layout needs at least one partition")
        for i, p in enumerate(parts):
            if p.index != i:
                raise ValueError(f"layout partition {i} has index {p.index}; indices must be 0..{len(parts) - 1}")
            if p.sms < 1 or p.sm_offset < 0:
                raise ValueError(f"partition {i}: expected sms >= 1 and sm_offset >= 0, found {p.sms}, {p.sm_offset}")
        excl = sorted((p.sm_offset, p.sm_offset + p.sms, p.index) for p in parts if not p.shared)
        for (a0, a1, ia), (b0, b1, ib) in zip(excl, excl[1:]):
            if b0 < a1:
                raise ValueError(f"exclusive partitions {ia} [{a0}:{a1}) and {ib} [{b0}:{b1}) overlap")
        if excl and excl[-1][1] > self.gpu_sms:
            raise ValueError(f"partition {excl[-1][2]} ends at SM {excl[-1][1]} beyond the GPU's {self.gpu_sms}")
        if any(p.shared for p in parts) and self.shared_sms < 1:
            raise ValueError("shared lanes need SMs outside the exclusive partitions; none are left")

    @property
    def exclusive_sms(self) -> int:
        """SMs owned by exclusive partitions."""
        return sum(p.sms for p in self.partitions if not p.shared)

    @property
    def shared_sms(self) -> int:
        """SMs that shared lanes compete for: everything exclusive partitions leave."""
        return self.gpu_sms - self.exclusive_sms

    @staticmethod
    def shared_lanes(gpu_sms: int, owners: list[str | None]) -> "Layout":
        """One shared lane over the whole GPU per entry of ``owners`` (Triton-style streams)."""
        parts = tuple(
            Partition(i, 0, gpu_sms, shared=True, owner=o, label=f"{o or 'lane'}#{i}") for i, o in enumerate(owners)
        )
        return Layout(parts, gpu_sms)

    @staticmethod
    def exclusive(gpu_sms: int, sizes: list[tuple[int, str | None]]) -> "Layout":
        """Disjoint partitions of the given (SMs, owner) sizes, packed from SM 0."""
        parts, off = [], 0
        for i, (s, o) in enumerate(sizes):
            parts.append(Partition(i, off, s, shared=False, owner=o, label=f"p{i}[{off}:{off + s}]"))
            off += s
        return Layout(tuple(parts), gpu_sms)


@dataclass(frozen=True, slots=True)
class Decision:
    """Run ``request_ids`` of ``model`` as one batch on partition ``partition`` now."""

    model: str
    request_ids: tuple[int, ...]  # taken from the model's queue, in its order
    batch: int  # batch size that runs (>= len(request_ids)); the backend pads it to a profile bucket
    partition: int  # Partition.index, must be free
    sms: int | None = None  # shared lanes only: SMs the batch demands (None = its knee)
    priority: float | None = None  # shared lanes only: lower gets SMs first (None = share by demand)


@dataclass(frozen=True, slots=True)
class Drop:
    """Give up on ``request_ids`` of ``model`` (removed from the queue, reported with ``reason``)."""

    model: str
    request_ids: tuple[int, ...]
    reason: str  # e.g. "deadline" (can no longer meet it)


@dataclass(frozen=True, slots=True)
class Completion:
    """A backend's report that a submitted batch finished (or failed)."""

    decision: Decision
    start_ms: float  # when the batch started running
    end_ms: float  # when its outputs were ready
    error: str = ""  # non-empty when the batch failed; its requests fail with this message
    # the batch's device time where the backend measured it (CUDA events; the simulator's GPU work):
    # what a policy learns its models' slowdowns from (gpuloom.plan.slowdown); NaN where unknown
    device_ms: float = math.nan


class Status(enum.IntEnum):
    """What became of a request."""

    QUEUED = 0  # still queued (or running) when the run ended
    SERVED = 1
    DROPPED = 2
    FAILED = 3


@dataclass(frozen=True, slots=True)
class Result:
    """The fate of one request, as metrics read it."""

    request: Request
    status: Status
    finish_ms: float = float("nan")  # completion time (SERVED/FAILED) or drop time (DROPPED)
    reason: str = ""  # drop reason or error message
    batch: int = 0  # batch size it ran in (SERVED)

    @property
    def latency_ms(self) -> float:
        return self.finish_ms - self.request.arrival_ms

    @property
    def on_time(self) -> bool:
        return self.status == Status.SERVED and self.finish_ms <= self.request.deadline_ms + 1e-9


@dataclass
class TraceEntry:
    """One line of a run's event trace (tests compare traces exactly)."""

    time_ms: float
    kind: str  # "arrive", "dispatch", "complete", "drop", "layout"
    detail: tuple = field(default_factory=tuple)

    def __iter__(self):
        return iter((self.time_ms, self.kind, *self.detail))
