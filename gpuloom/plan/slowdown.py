"""How much slower each model runs on its partition than its profile says, learned while serving.

Why: a profile is measured with the model alone on the GPU. On the H200, with the 6-model mix on
dstack's partitions, every model's batches took longer than their profile at every load: bert_base
1.14-1.17x, efficientnet_b0 1.11-1.14x, vgg16 1.28-1.61x, the others 1.00-1.11x
(``profile_check`` of runs 29-31, ``docs/reports/runtime.md``). Co-running partitions share memory
bandwidth and L2, which an SM partition does not isolate. A plan made from the profiles sizes
bert_base's partition for ~83% busy when it runs ~95% busy, and bert_base is the first model to miss
its SLO as the load rises. In simulation with those slowdowns (``scripts/sim_learned_slowdown.py``),
a planner that knows them keeps more of the load than one that does not.

:class:`SlowdownEstimator` keeps, per model, the device time and the profiled time of its last
``window`` batches on exclusive partitions; :meth:`factor` is their ratio once ``min_batches`` have
been seen. Pure logic: no torch, no clock.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from pathlib import Path
from typing import Mapping

from gpuloom.profile.store import Profile, ProfileStore


class _Windows:
    """Per model, the last ``window`` observations (tuples of numbers) and their running sums; what
    is known of a model once ``min_batches`` were seen. The bookkeeping both estimators share."""

    def __init__(self, window: int, min_batches: int, width: int) -> None:
        if not (isinstance(window, int) and isinstance(min_batches, int) and 1 <= min_batches <= window):
            raise ValueError(f"{type(self).__name__}: need integers 1 <= min_batches <= window, "
                             f"found {min_batches}, {window}")
        self.window, self.min_batches, self._width = window, min_batches, width
        self._seen: dict[str, deque[tuple[float, ...]]] = {}
        self._sums: dict[str, list[float]] = {}  # model -> each position's sum over its window

    def _add(self, model: str, values: tuple[float, ...]) -> None:
        q = self._seen.setdefault(model, deque())
        s = self._sums.setdefault(model, [0.0] * self._width)
        q.append(values)
        for i, v in enumerate(values):
            s[i] += v
        if len(q) > self.window:
            for i, v in enumerate(q.popleft()):
                s[i] -= v

    def batches(self, model: str) -> int:
        return len(self._seen.get(model, ()))

    def _known_sums(self, model: str) -> list[float] | None:
        """``model``'s sums over its window, or None before ``min_batches``."""
        return self._sums[model] if self.batches(model) >= self.min_batches else None

    def forget_all_but(self, models) -> None:
        """Drop what was seen of models not in ``models`` (unloaded: one loaded again under the
        same name may be another model)."""
        for m in [m for m in self._seen if m not in models]:
            del self._seen[m], self._sums[m]


class SlowdownEstimator(_Windows):
    """Device time over profiled time per model, over its last ``window`` batches."""

    def __init__(self, window: int = 200, min_batches: int = 50, *, clamp: tuple[float, float] = (0.5, 4.0)) -> None:
        super().__init__(window, min_batches, 2)  # [device ms, profiled ms] summed over the window
        if not 0 < clamp[0] <= 1 <= clamp[1]:
            raise ValueError(f"SlowdownEstimator: clamp must be (lo, hi) with 0 < lo <= 1 <= hi, found {clamp}")
        self.clamp = clamp

    def observe(self, model: str, device_ms: float, profile_ms: float) -> None:
        """One batch of ``model``: ``device_ms`` measured, ``profile_ms`` its profile's latency for the
        same batch size and SMs. Batches without a usable measurement are ignored."""
        if device_ms > 0 and profile_ms > 0 and math.isfinite(device_ms) and math.isfinite(profile_ms):
            self._add(model, (device_ms, profile_ms))

    def factor(self, model: str) -> float | None:
        """``model``'s device time over its profile (clamped), or None before ``min_batches``."""
        sums = self._known_sums(model)
        if sums is None:
            return None
        lo, hi = self.clamp
        return min(hi, max(lo, sums[0] / sums[1]))

    def factors(self) -> dict[str, float]:
        """Every model's factor that is known yet."""
        return {m: f for m in self._seen if (f := self.factor(m)) is not None}


class HoldEstimator(_Windows):
    """How long each model's batches hold their partition beyond their device time (ms): the mean
    over its last ``window`` batches, once ``min_batches`` have been seen.

    A hold is the host's part of a batch (launch, copies, the completion's way back to the runtime):
    busy time (dispatch to outputs on the host) less device time (CUDA events). On the H200 it was
    0.6-2.4 ms on one machine and 1.7-5.5 ms on another for the same mix (runs 57-60), so it is
    learned where the service runs rather than read from another machine's report. Each hold is
    clamped to ``clamp_ms`` (busy and device time come from two clocks; a host stall is not a hold)."""

    def __init__(self, window: int = 200, min_batches: int = 50, *, clamp_ms: tuple[float, float] = (0.0, 50.0)) -> None:
        super().__init__(window, min_batches, 1)
        if not 0 <= clamp_ms[0] < clamp_ms[1]:
            raise ValueError(f"HoldEstimator: clamp_ms must be (lo, hi) with 0 <= lo < hi, found {clamp_ms}")
        self.clamp_ms = clamp_ms

    def observe(self, model: str, busy_ms: float, device_ms: float) -> None:
        """One batch of ``model``: ``busy_ms`` from its dispatch to its outputs on the host,
        ``device_ms`` its device time. Batches without both measurements are ignored."""
        if math.isfinite(busy_ms) and math.isfinite(device_ms) and device_ms > 0:
            lo, hi = self.clamp_ms
            self._add(model, (min(hi, max(lo, busy_ms - device_ms)),))

    def hold(self, model: str) -> float | None:
        """``model``'s mean hold (ms) over its window, or None before ``min_batches``."""
        sums = self._known_sums(model)
        return None if sums is None else max(0.0, sums[0] / self.batches(model))

    def holds(self) -> dict[str, float]:
        """Every model's hold that is known yet."""
        return {m: h for m in self._seen if (h := self.hold(m)) is not None}


def slowed(profile: Profile, factor: float) -> Profile:
    """``profile`` with every latency ``factor`` times longer: the model as slow as measured."""
    if factor == 1.0:
        return profile
    return dataclasses.replace(profile, latency_ms=tuple(tuple(v * factor for v in row) for row in profile.latency_ms))


def slowed_store(store: ProfileStore, factors: Mapping[str, float]) -> ProfileStore:
    """``store``'s profiles, each model's slowed by its factor (1 where it has none)."""
    return ProfileStore(profiles=[slowed(p, factors.get(p.model, 1.0)) for p in store])


def device_over_profile(rows) -> dict[str, float]:
    """``{model: device time over profile}`` of ``profile_check`` rows (a bench report's measured vs
    profiled ms per model, SMs and batch), weighted by their batches; rows without both are skipped."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        if r.get("profile_ms") and r.get("measured_ms"):
            s = sums.setdefault(r["model"], [0.0, 0.0])
            s[0] += r["measured_ms"] * r["batches"]
            s[1] += r["profile_ms"] * r["batches"]
    return {m: d / p for m, (d, p) in sorted(sums.items())}


def dstack_rows(report: dict) -> list[dict]:
    """The ``profile_check`` rows of every dstack point (any variant, any load) of a bench report:
    batches on exclusive partitions, whose slowdown is the partition's and not shared streams' contention."""
    return [r for name, res in report.get("policies", {}).items() if _policy_of(name) == "dstack"
            for point in res.get("points", []) for r in point.get("profile_check") or []]


def _policy_of(label: str) -> str:
    """The policy a report's run label names (``"dstack:outputs=views#2"`` -> ``"dstack"``), as
    ``gpuloom.bench.labels`` writes them; read here without importing the bench layer, which sits above."""
    return label.split(":")[0].split("#")[0]


def mean_by(items) -> dict:
    """``{key: mean of value weighted by n}`` over ``(key, value, n)`` items."""
    acc: dict = {}
    for key, value, n in items:
        t = acc.setdefault(key, [0.0, 0])
        t[0] += value * n
        t[1] += n
    return {k: t / n for k, (t, n) in acc.items() if n}


def held_beyond(rows) -> dict[str, float]:
    """``{model: ms a batch held its partition beyond its device time}`` of ``profile_check`` rows,
    weighted by their batches; rows without ``hold_ms`` (reports before the eleventh session) skipped."""
    means = mean_by((r["model"], r["hold_ms"], r["batches"]) for r in rows
                    if r.get("hold_ms") is not None and r.get("batches"))
    # a hold is busy time less device time, each from its own clock: a few rows come out below zero
    return {m: max(0.0, h) for m, h in sorted(means.items())}


def _load_per_model(path: str | Path, what: str, from_rows, rows_needed: str, ok, values: str) -> dict[str, float]:
    """``{model: value}`` from ``path``: a JSON object of them, or a ``gpuloom bench`` report whose
    dstack points' ``profile_check`` rows ``from_rows`` turns into them. Errors name ``what``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: could not read {path}: {e}") from None
    if isinstance(data, dict) and "policies" in data:
        out = from_rows(dstack_rows(data))
        if not out:
            raise ValueError(f"{what}: {path} is a bench report without dstack points that have {rows_needed} rows")
        return out
    if not (isinstance(data, dict) and data and all(isinstance(m, str) and isinstance(v, (int, float))
                                                    and not isinstance(v, bool) and ok(v) for m, v in data.items())):
        raise ValueError(f"{what}: {path} must hold {{model: {values}}} or a gpuloom bench report")
    return {m: float(v) for m, v in data.items()}


def load_holds(path: str | Path) -> dict[str, float]:
    """Per-model holds to plan with (``plan(model_overhead_ms=...)``, ``dstack:holds=PATH``), from
    ``path``: a JSON object ``{model: ms}``, or a ``gpuloom bench`` report, whose dstack points'
    ``profile_check`` rows give how long each model's batches held their partition beyond their device
    time (weighted by batches, over every dstack variant and load of the report)."""
    return _load_per_model(path, "holds", held_beyond, "hold_ms", lambda h: 0 <= h < float("inf"), "ms >= 0")


def load_slowdowns(path: str | Path) -> dict[str, float]:
    """Slowdowns to plan with, from ``path``: a JSON object ``{model: factor}``, or a ``gpuloom
    bench`` report, whose dstack points' ``profile_check`` rows give each model's device time over
    its profile (weighted by batches, over every dstack variant and load of the report)."""
    return _load_per_model(path, "slowdowns", device_over_profile, "profile_check", lambda f: f > 0, "factor > 0")
