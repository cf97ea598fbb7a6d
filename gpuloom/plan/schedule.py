"""The planner's output: a space-time schedule of one GPU, as small frozen dataclasses.

The GPU's SMs are carved into disjoint ``Partition``s. Each partition repeats a slot pattern every
``period_ms`` (a divisor of the schedule's ``cycle_ms``); ``slots`` lists every ``Slot`` of one whole
cycle (the pattern repeated ``cycle_ms / period_ms`` times), each one batch of one model.
``ModelPlan`` summarizes, per model, what the plan gives it. ``Schedule`` serializes to versioned
JSON (``gpuloom.schedule/1``) so a plan made on a laptop can be served on the GPU.

Plain Python (no torch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "gpuloom.schedule/1"


class PlanError(ValueError):
    """A demand, a profile or a schedule the planner cannot work with."""


class PlanInfeasible(PlanError):
    """No schedule can serve a model at all (e.g. its SLO is below its fastest latency)."""


@dataclass(frozen=True)
class Demand:
    """What one model asks of the GPU."""

    model: str  # profile model name or key
    rate: float  # requests/s to serve
    slo_ms: float  # latency target of one request, ms
    weight: float = 1.0  # weighted max-min share when the GPU is oversubscribed

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise PlanError(f"Demand.model must be a non-empty string, found {self.model!r}")
        for name in ("rate", "slo_ms", "weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"),):
                raise PlanError(f"Demand({self.model!r}).{name} must be a finite number, found {v!r}")
        if self.rate < 0:
            raise PlanError(f"Demand({self.model!r}).rate must be >= 0 requests/s, found {self.rate}")
        if not self.slo_ms > 0:
            raise PlanError(f"Demand({self.model!r}).slo_ms must be > 0 ms, found {self.slo_ms}")
        if not self.weight > 0:
            raise PlanError(f"Demand({self.model!r}).weight must be > 0, found {self.weight}")


@dataclass(frozen=True)
class Slot:
    """One batch of one model, at a fixed offset within its partition's cycle."""

    model: str
    batch: int  # requests in the batch (a profile batch bucket)
    start_ms: float  # offset from the start of the cycle, ms
    duration_ms: float  # L(batch, partition SMs) from the profile, ms

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


@dataclass(frozen=True)
class Partition:
    """A disjoint range of SMs ``[sm_offset, sm_offset + sms)`` and its repeating cycle of slots."""

    index: int
    sm_offset: int  # first SM of the range
    sms: int  # number of SMs (a multiple of the granularity, except one may take the remainder)
    slots: tuple[Slot, ...]  # ordered by start_ms, non-overlapping, all within [0, cycle_ms]
    period_ms: float = 0.0  # the slot pattern repeats every period_ms (divides the cycle); 0: the whole cycle

    @property
    def busy_ms(self) -> float:
        """Time per cycle the partition runs slots, ms."""
        return sum(s.duration_ms for s in self.slots)

    def period(self, cycle_ms: float) -> float:
        return self.period_ms if self.period_ms > 0 else cycle_ms

    @property
    def models(self) -> tuple[str, ...]:
        seen: list[str] = []
        for s in self.slots:
            if s.model not in seen:
                seen.append(s.model)
        return tuple(seen)


@dataclass(frozen=True)
class ModelPlan:
    """What the schedule gives one model."""

    model: str
    batch: int  # batch of each of its slots
    sms: int  # SMs of its partition (0 when the model got nothing)
    partition: int  # index of its partition (-1 when the model got nothing)
    latency_ms: float  # L(batch, sms) (+ the planned batch overhead): how long one slot holds the partition, ms
    demand_rps: float  # requests/s asked for
    planned_rps: float  # requests/s the slots can serve: slots_per_cycle * batch / cycle
    slo_ms: float
    served_fraction: float  # min(1, planned_rps / demand_rps); 1.0 when demand is 0
    slots_per_cycle: int = 1  # back-to-back slots of this model in each period of its partition
    worst_ms: float = 0.0  # latency bound: period + slots_per_cycle * latency_ms (see gpuloom.plan.planner)
    period_ms: float = 0.0  # its partition's period (the slot pattern repeats cycle_ms / period_ms times)
    weight: float = 1.0

    @property
    def short(self) -> bool:
        return self.served_fraction < 1.0 - 1e-9


@dataclass(frozen=True)
class Schedule:
    """A space-time plan of one GPU: disjoint SM partitions, each repeating a cycle of slots."""

    gpu_sms: int  # SMs of the whole device
    granularity: int  # partition sizes are multiples of this (one may add the remainder)
    cycle_ms: float  # length of every partition's repeating cycle, ms
    partitions: tuple[Partition, ...]
    models: tuple[ModelPlan, ...]
    short: tuple[tuple[str, float], ...] = ()  # (model, fraction of its demand NOT served), worst first
    gpu: str = ""  # GPU name from the profiles
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # free-form: planner settings, timing

    # -- queries ----------------------------------------------------------------------------
    def model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(f"no model {name!r} in this schedule; it has {[m.model for m in self.models]}")

    def partition_of(self, name: str) -> Partition | None:
        p = self.model(name).partition
        return self.partitions[p] if p >= 0 else None

    @property
    def used_sms(self) -> int:
        return sum(p.sms for p in self.partitions)

    @property
    def feasible(self) -> bool:
        """True when every model gets its whole demand."""
        return not self.short

    def utilization(self) -> float:
        """Planned SM-time busy / SM-time of the whole GPU over one cycle (0..1)."""
        if self.cycle_ms <= 0:
            return 0.0
        return sum(p.sms * p.busy_ms for p in self.partitions) / (self.gpu_sms * self.cycle_ms)

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "gpu": self.gpu,
            "gpu_sms": self.gpu_sms,
            "granularity": self.granularity,
            "cycle_ms": self.cycle_ms,
            "partitions": [
                {
                    "index": p.index,
                    "sm_offset": p.sm_offset,
                    "sms": p.sms,
                    "period_ms": p.period_ms,
                    "slots": [asdict(s) for s in p.slots],
                }
                for p in self.partitions
            ],
            "models": [asdict(m) for m in self.models],
            "short": [[m, f] for m, f in self.short],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Schedule":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise PlanError(f"expected a schedule with schema {SCHEMA!r}, found {found!r}")
        try:
            return cls(
                gpu_sms=int(data["gpu_sms"]),
                granularity=int(data["granularity"]),
                cycle_ms=float(data["cycle_ms"]),
                partitions=tuple(
                    Partition(
                        index=int(p["index"]),
                        sm_offset=int(p["sm_offset"]),
                        sms=int(p["sms"]),
                        slots=tuple(Slot(**s) for s in p["slots"]),
                        period_ms=float(p.get("period_ms", 0.0)),
                    )
                    for p in data["partitions"]
                ),
                models=tuple(ModelPlan(**m) for m in data["models"]),
                short=tuple((str(m), float(f)) for m, f in data.get("short", [])),
                gpu=str(data.get("gpu", "")),
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed schedule JSON: {e}") from e

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.dumps() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        return cls.loads(Path(path).read_text())

    # -- text -------------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [
            f"schedule: {self.gpu or 'GPU'} {self.gpu_sms} SMs (granularity {self.granularity}), "
            f"cycle {self.cycle_ms:.2f} ms, {len(self.partitions)} partitions, "
            f"{self.used_sms} SMs assigned, planned utilization {self.utilization():.0%}",
            f"{'model':<18}{'part':>5}{'SMs':>5}{'batch':>6}{'k':>4}{'period':>8}{'L ms':>8}{'worst':>8}{'SLO':>8}"
            f"{'demand/s':>10}{'plan/s':>9}{'served':>8}",
        ]
        for m in self.models:
            lines.append(
                f"{m.model:<18}{m.partition:>5}{m.sms:>5}{m.batch:>6}{m.slots_per_cycle:>4}{m.period_ms:>8.2f}"
                f"{m.latency_ms:>8.2f}{m.worst_ms:>8.2f}{m.slo_ms:>8.2f}{m.demand_rps:>10.1f}{m.planned_rps:>9.1f}"
                f"{m.served_fraction:>8.0%}"
            )
        for p in self.partitions:
            lines.append(
                f"partition {p.index}: SMs {p.sm_offset}..{p.sm_offset + p.sms - 1} ({p.sms}), busy "
                f"{p.busy_ms:.2f}/{self.cycle_ms:.2f} ms: "
                + ", ".join(f"{s.model} b{s.batch}@{s.start_ms:.2f}" for s in p.slots)
            )
        if self.short:
            lines.append("short: " + ", ".join(f"{m} misses {f:.0%} of its demand" for m, f in self.short))
        return "\n".join(lines)
