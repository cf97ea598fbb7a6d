"""Latency profiles L(model, batch, SMs) and the store that keeps them as versioned JSON.

Plain Python (no torch import): the planner, the policies and the simulator read profiles on any
machine, with or without a GPU.

A profile is a grid of measured median latencies, one row per batch bucket and one column per SM
count. Between measured points:

* along SMs, latency is interpolated linearly after the row has been made non-increasing (more SMs
  never makes a model slower; measurement noise that says otherwise is flattened);
* along batch, a request for batch ``b`` costs the latency of the smallest measured bucket ``>= b``
  (the engine pads a batch to its bucket, so that is what really runs), and rows are made
  non-decreasing in batch.

Example::

    >>> p = Profile(model="toy", input_shapes=((3, 8, 8),), dtype="float32",
    ...             gpu=GpuInfo(name="fake", sm_count=16, sm_granularity=8),
    ...             batches=(1, 2), sms=(8, 16), latency_ms=((2.0, 1.0), (3.0, 2.0)))
    >>> p.latency(2, 12)
    2.5
    >>> p.knee(1, eps=0.1)
    16
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

SCHEMA = "gpuloom.profile/1"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "profiles"


class ProfileError(ValueError):
    """A profile is malformed, or a query falls outside what was measured."""


@dataclass(frozen=True)
class GpuInfo:
    """The device a profile was measured on."""

    name: str  # e.g. "NVIDIA H200"
    sm_count: int  # SMs of the whole device, e.g. 132
    sm_granularity: int = 8  # partition sizes are multiples of this (green contexts on Hopper: 8)
    driver: str = ""  # CUDA driver version, e.g. "580.159.04"
    torch: str = ""  # torch version the profile was measured with


def model_key(model: str, input_shapes: Iterable[Iterable[int]], dtype: str) -> str:
    """The signature a profile is filed under: ``name|3x224x224|float32`` (shapes without batch)."""
    shapes = ",".join("x".join(str(d) for d in s) for s in input_shapes)
    return f"{model}|{shapes}|{dtype}"


@dataclass(frozen=True)
class Profile:
    """Measured latency of one model over batch buckets x SM counts.

    ``latency_ms[i][j]`` is the median latency in ms of batch ``batches[i]`` on ``sms[j]`` SMs.
    ``kernel_knee`` optionally holds the analytically predicted knee (SMs) per batch.
    """

    model: str  # short name, e.g. "resnet50"
    input_shapes: tuple[tuple[int, ...], ...]  # per input, without the batch dimension
    dtype: str  # "float32", "float16", ...
    gpu: GpuInfo
    batches: tuple[int, ...]  # ascending batch buckets
    sms: tuple[int, ...]  # ascending SM counts
    latency_ms: tuple[tuple[float, ...], ...]  # [batch index][sms index], ms
    date: str = ""  # ISO date of the measurement
    source: str = "measured"  # "measured" or "synthetic"
    predicted_knee: dict[int, int] = field(default_factory=dict)  # batch -> SMs, from kernel shapes
    runner: str = ""  # what was timed: "engine" (gpuloom.compile graphs) or "graph" (eager forward graph)
    _mono: tuple[tuple[float, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shapes", tuple(tuple(int(d) for d in s) for s in self.input_shapes))
        object.__setattr__(self, "batches", tuple(int(b) for b in self.batches))
        object.__setattr__(self, "sms", tuple(int(s) for s in self.sms))
        object.__setattr__(self, "latency_ms", tuple(tuple(float(v) for v in row) for row in self.latency_ms))
        object.__setattr__(self, "predicted_knee", {int(k): int(v) for k, v in self.predicted_knee.items()})
        if not self.batches or not self.sms:
            raise ProfileError(f"profile {self.model!r}: needs at least one batch and one SM count")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ProfileError(f"profile {self.model!r}: batches must be ascending positive, got {self.batches}")
        if list(self.sms) != sorted(set(self.sms)) or self.sms[0] < 1:
            raise ProfileError(f"profile {self.model!r}: sms must be ascending positive, got {self.sms}")
        if len(self.latency_ms) != len(self.batches) or any(len(r) != len(self.sms) for r in self.latency_ms):
            raise ProfileError(
                f"profile {self.model!r}: latency_ms must be {len(self.batches)} rows x {len(self.sms)} columns"
            )
        if any(not (v > 0) for r in self.latency_ms for v in r):
            raise ProfileError(f"profile {self.model!r}: every latency must be a positive number of ms")
        object.__setattr__(self, "_mono", _monotone(self.latency_ms))

    # -- identity ---------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return model_key(self.model, self.input_shapes, self.dtype)

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    # -- queries ----------------------------------------------------------------------------
    def bucket(self, batch: int) -> int:
        """The measured batch bucket a batch of ``batch`` requests runs as (the next one up)."""
        if batch < 1 or batch > self.batches[-1]:
            raise ProfileError(
                f"profile {self.model!r}: batch {batch} outside the measured 1..{self.batches[-1]}"
            )
        return self.batches[bisect.bisect_left(self.batches, batch)]

    def latency(self, batch: int, sms: float) -> float:
        """Latency in ms of one batch of ``batch`` on ``sms`` SMs (see the module docstring)."""
        row = self._mono[self.batches.index(self.bucket(batch))]
        if sms < self.sms[0]:
            raise ProfileError(f"profile {self.model!r}: {sms} SMs is below the smallest measured {self.sms[0]}")
        if sms >= self.sms[-1]:
            return row[-1]
        j = bisect.bisect_right(self.sms, sms)  # sms[j-1] <= sms < sms[j]
        s0, s1 = self.sms[j - 1], self.sms[j]
        t = (sms - s0) / (s1 - s0)
        return row[j - 1] + t * (row[j] - row[j - 1])

    def full_latency(self, batch: int) -> float:
        """Latency in ms on the whole GPU."""
        return self.latency(batch, self.sms[-1])

    def knee(self, batch: int, eps: float = 0.1) -> int:
        """Fewest measured SMs whose latency is within ``(1 + eps)`` of the whole-GPU latency."""
        full = self.full_latency(batch)
        for s in self.sms:
            if self.latency(batch, s) <= (1.0 + eps) * full:
                return s
        return self.sms[-1]

    def min_sm_time(self, batch: int, min_sms: float = 0, max_sms: float = float("inf")) -> float:
        """SM-ms of one batch at its most efficient measured SM count from ``min_sms`` to ``max_sms``
        (at ``min(max_sms, largest measured)`` when no measured count lies between): the SM-time it
        needs where no SM it holds is wasted (the simulator's ``demand="area"``)."""
        counts = [s for s in self.sms if min_sms <= s <= max_sms] or [min(max_sms, self.sms[-1])]
        return min(s * self.latency(batch, s) for s in counts)

    def throughput(self, batch: int, sms: float) -> float:
        """Requests per second of back-to-back batches of ``batch`` on ``sms`` SMs."""
        return batch * 1000.0 / self.latency(batch, sms)

    def throughput_per_sm(self, batch: int) -> list[tuple[int, float]]:
        """(SMs, requests/s per SM) at every measured SM count."""
        return [(s, self.throughput(batch, s) / s) for s in self.sms]

    def min_latency(self) -> float:
        """The fastest any single request can be served (batch 1, whole GPU), ms."""
        return self.full_latency(self.batches[0])

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "key": self.key,
            "model": self.model,
            "input_shapes": [list(s) for s in self.input_shapes],
            "dtype": self.dtype,
            "gpu": dataclasses.asdict(self.gpu),
            "date": self.date,
            "source": self.source,
            "batches": list(self.batches),
            "sms": list(self.sms),
            "latency_ms": [list(r) for r in self.latency_ms],
            "predicted_knee": {str(k): v for k, v in sorted(self.predicted_knee.items())},
            "runner": self.runner,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if data.get("schema") != SCHEMA:
            raise ProfileError(f"expected a profile with schema {SCHEMA!r}, found {data.get('schema')!r}")
        try:
            return cls(
                model=data["model"],
                input_shapes=tuple(tuple(s) for s in data["input_shapes"]),
                dtype=data["dtype"],
                gpu=GpuInfo(**data["gpu"]),
                batches=tuple(data["batches"]),
                sms=tuple(data["sms"]),
                latency_ms=tuple(tuple(r) for r in data["latency_ms"]),
                date=data.get("date", ""),
                source=data.get("source", "measured"),
                predicted_knee={int(k): int(v) for k, v in data.get("predicted_knee", {}).items()},
                runner=data.get("runner", ""),
            )
        except (KeyError, TypeError) as e:
            raise ProfileError(f"malformed profile JSON: {e}") from e


def _monotone(grid: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    """Non-increasing along SMs (running min), then non-decreasing along batch (running max)."""
    rows = []
    for r in grid:
        out, cur = [], float("inf")
        for v in r:
            cur = min(cur, v)
            out.append(cur)
        rows.append(out)
    for i in range(1, len(rows)):
        rows[i] = [max(a, b) for a, b in zip(rows[i], rows[i - 1])]
    return tuple(tuple(r) for r in rows)


class ProfileStore:
    """Profiles on disk: one JSON file per model signature in a directory.

    ``ProfileStore.builtin("h200")`` opens the profiles shipped with gpuloom. Lookups accept the
    full key (``resnet50|3x224x224|float32``) or a bare model name when it is unambiguous.
    """

    def __init__(self, directory: str | os.PathLike | None = None, profiles: Iterable[Profile] = ()) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._profiles: dict[str, Profile] = {}
        if self.directory is not None and self.directory.is_dir():
            for path in sorted(self.directory.glob("*.json")):
                with open(path) as f:
                    p = Profile.from_json(json.load(f))
                self._profiles[p.key] = p
        for p in profiles:
            self._profiles[p.key] = p

    @classmethod
    def builtin(cls, gpu: str = "h200") -> "ProfileStore":
        d = BUILTIN_DIR / gpu
        if not d.is_dir():
            known = sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir()) if BUILTIN_DIR.is_dir() else []
            raise ProfileError(f"no shipped profiles for GPU {gpu!r}; shipped: {known}")
        return cls(d)

    def __iter__(self) -> Iterator[Profile]:
        return iter(self._profiles.values())

    def __len__(self) -> int:
        return len(self._profiles)

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except ProfileError:
            return False

    def keys(self) -> list[str]:
        return sorted(self._profiles)

    def get(self, name: str) -> Profile:
        if name in self._profiles:
            return self._profiles[name]
        matches = [p for p in self._profiles.values() if p.model == name]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ProfileError(f"no profile for {name!r}; known: {self.keys()}")
        raise ProfileError(f"{name!r} is ambiguous; use one of {[p.key for p in matches]}")

    def put(self, profile: Profile) -> Path | None:
        """Add ``profile``; write it to the store's directory if it has one. Returns the path."""
        self._profiles[profile.key] = profile
        if self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        fname = profile.key.replace("|", "__").replace(",", "_") + ".json"
        return write_profile(profile, self.directory / fname)


def write_profile(profile: Profile, path: Path) -> Path:
    """Write ``profile``'s JSON to ``path`` atomically: a reader (another server, a crash) never sees half a
    file. The temporary name carries the process id so two writers do not share one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def today() -> str:
    return _dt.date.today().isoformat()
