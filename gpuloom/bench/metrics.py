"""Metrics of one run: per model and overall throughput, goodput, SLO attainment, latency
percentiles, drops by reason, SM utilization and Jain's fairness index.

Definitions (``duration`` = the arrival window of the run, s):

* throughput = served requests / duration; goodput = requests served within their SLO / duration;
* SLO attainment = requests served within their SLO / requests arrived (drops, failures and requests
  still queued at the end count as misses);
* latency percentiles over served requests (linear interpolation between order statistics);
* SM utilization = useful SM-seconds (SMs a batch can use, at most its knee, x time; see
  ``gpuloom.runtime.sim``) / (SMs x simulated time);
* fairness = Jain's index ``(sum x)^2 / (n sum x^2)`` over each model's served fraction of its demand
  ``x = attainment`` (1 = every model gets the same share). With ``weights``, ``x = attainment /
  weight`` instead; that index is below 1 whenever weights differ and every model is fully served, so
  the experiments report the unweighted index.

Requests are conserved: arrived = served + dropped + failed + queued at the end (asserted).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from ..policy.types import Result, Status


@dataclass(frozen=True)
class ModelMetrics:
    model: str
    arrived: int
    served: int
    on_time: int  # served within the SLO
    dropped: int
    failed: int
    queued: int  # still queued or running when the run ended
    drops: dict[str, int]  # reason -> count
    demand_rps: float  # arrived / duration, requests/s
    throughput_rps: float
    goodput_rps: float
    slo_attainment: float  # on_time / arrived (1.0 when nothing arrived)
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float  # mean batch size served requests ran in


@dataclass(frozen=True)
class RunMetrics:
    policy: str
    duration_s: float
    models: tuple[ModelMetrics, ...]
    arrived: int
    served: int
    on_time: int
    dropped: int
    failed: int
    queued: int
    drops: dict[str, int]
    throughput_rps: float
    goodput_rps: float
    slo_attainment: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    sm_utilization: float  # 0..1
    fairness: float  # Jain's index over weighted served fractions, 1/n..1
    meta: dict = field(default_factory=dict, compare=False)

    def model(self, name: str) -> ModelMetrics:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(f"no model {name!r}; have {[m.model for m in self.models]}")

    def to_json(self) -> dict:
        return asdict(self)


def finite_values(v):
    """``v`` (numbers, dicts, lists) with every NaN and infinity as None: JSON has neither (``json.dumps``
    writes ``NaN``, which no parser but Python's reads). One place for the bench's report, the
    commands' ``--out`` JSON and ``gpuloom load --json``."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite_values(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_values(x) for x in v]
    return v


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending ``sorted_values``; NaN when empty."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def geomean(xs) -> float:
    """Geometric mean of the positive values of ``xs`` (a speedup that was not measured, None or 0, is
    left out rather than failing the summary; callers report how many values they averaged); NaN
    when none is left."""
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index of ``xs`` (1.0 for equal values; 1.0 for an empty or all-zero list)."""
    xs = list(xs)
    s2 = sum(x * x for x in xs)
    if not xs or s2 == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * s2)


# the statuses as module constants: _Tally.of reads them per request (an Enum attribute costs more)
_SERVED, _DROPPED, _FAILED, _QUEUED = Status.SERVED, Status.DROPPED, Status.FAILED, Status.QUEUED


@dataclass
class _Tally:
    """What :func:`_summarize` reports of some requests, counted in one pass over their results
    (a 60 s run of mix6 has ~135k; a pass per figure took a tenth of the simulation's time)."""

    n: int = 0  # requests
    lat: list[float] = field(default_factory=list)  # latency of each served request, ms
    batch_sum: int = 0  # of the batch sizes the served requests ran in
    on_time: int = 0
    failed: int = 0
    queued: int = 0
    drops: Counter = field(default_factory=Counter)  # reason -> requests

    @classmethod
    def of(cls, results: Sequence[Result]) -> "_Tally":
        t = cls(n=len(results))
        lat, drops = t.lat, t.drops
        batch_sum = on_time = failed = queued = 0
        for r in results:
            status = r.status
            if status == _SERVED:
                lat.append(r.latency_ms)
                batch_sum += r.batch
                if r.on_time:
                    on_time += 1
            elif status == _DROPPED:
                drops[r.reason] += 1
            elif status == _FAILED:
                failed += 1
            elif status == _QUEUED:
                queued += 1
        t.batch_sum, t.on_time, t.failed, t.queued = batch_sum, on_time, failed, queued
        return t

    @classmethod
    def total(cls, tallies: Sequence["_Tally"]) -> "_Tally":
        """The tally of all of ``tallies``' requests together (without a second pass over them)."""
        t = cls()
        for x in tallies:
            t.n += x.n
            t.lat += x.lat
            t.batch_sum += x.batch_sum
            t.on_time += x.on_time
            t.failed += x.failed
            t.queued += x.queued
            t.drops.update(x.drops)
        return t


def _summarize(name: str, t: _Tally, duration_s: float) -> ModelMetrics:
    lat = sorted(t.lat)
    served = len(lat)
    n, on_time = t.n, t.on_time
    dropped = sum(t.drops.values())
    assert n == served + dropped + t.failed + t.queued, f"{name}: requests not conserved"
    return ModelMetrics(
        model=name,
        arrived=n,
        served=served,
        on_time=on_time,
        dropped=dropped,
        failed=t.failed,
        queued=t.queued,
        drops=dict(sorted(t.drops.items())),
        demand_rps=n / duration_s,
        throughput_rps=served / duration_s,
        goodput_rps=on_time / duration_s,
        slo_attainment=on_time / n if n else 1.0,
        p50_ms=percentile(lat, 50),
        p95_ms=percentile(lat, 95),
        p99_ms=percentile(lat, 99),
        mean_batch=t.batch_sum / served if served else 0.0,
    )


def compute_metrics(record, *, models: Sequence[str] | None = None, weights: Mapping[str, float] | None = None) -> RunMetrics:
    """Metrics of a :class:`~gpuloom.runtime.core.RunRecord`.

    ``models`` fixes the order (and includes models that received nothing); ``weights`` the fairness
    weights (default 1).
    """
    duration_s = record.until_ms / 1000.0
    if duration_s <= 0:
        raise ValueError(f"a run needs a positive duration, found {record.until_ms} ms")
    by_model: dict[str, list[Result]] = {m: [] for m in (models or [])}
    for r in record.results:
        by_model.setdefault(r.request.model, []).append(r)
    tallies = {m: _Tally.of(rs) for m, rs in by_model.items()}
    per = tuple(_summarize(m, t, duration_s) for m, t in tallies.items())
    overall = _summarize("all", _Tally.total(list(tallies.values())), duration_s)
    weights = weights or {}
    fair = jain([m.slo_attainment / weights.get(m.model, 1.0) for m in per if m.arrived])
    util = record.busy_sm_ms / (record.gpu_sms * record.end_ms) if record.end_ms > 0 else 0.0
    assert overall.arrived == len(record.results)
    return RunMetrics(
        policy=record.policy,
        duration_s=duration_s,
        models=per,
        arrived=overall.arrived,
        served=overall.served,
        on_time=overall.on_time,
        dropped=overall.dropped,
        failed=overall.failed,
        queued=overall.queued,
        drops=overall.drops,
        throughput_rps=overall.throughput_rps,
        goodput_rps=overall.goodput_rps,
        slo_attainment=overall.slo_attainment,
        p50_ms=overall.p50_ms,
        p95_ms=overall.p95_ms,
        p99_ms=overall.p99_ms,
        sm_utilization=util,
        fairness=fair,
        meta={"dispatches": record.dispatches, "end_ms": record.end_ms, "layouts": len(record.layouts)},
    )
