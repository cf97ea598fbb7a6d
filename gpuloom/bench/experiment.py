"""Run workloads under policies in simulation: one run, a comparison, and a rate sweep.

Plain Python: a policy runs against :class:`~gpuloom.runtime.sim.SimBackend` fed by latency
profiles. The same policies run against the GPU backend (issue 5).

Example::

    >>> from gpuloom.profile.synthetic import zoo
    >>> from gpuloom.profile.store import ProfileStore
    >>> from gpuloom.bench.workload import Workload, ModelSpec, Arrival
    >>> w = Workload((ModelSpec("mobilenet_v2", 20.0, arrival=Arrival("poisson", rate=200)),), duration_s=2)
    >>> run = simulate(w, ProfileStore(profiles=zoo()), "triton")
    >>> run.metrics.slo_attainment > 0.99
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Mapping, Sequence

from ..policy.base import ModelInfo, Policy, PolicyContext, make_policy
from ..policy.types import Request
from ..profile.store import Profile, ProfileStore
from ..runtime.core import RunRecord, Runtime
from ..runtime.sim import ContentionModel, SimBackend
from .metrics import RunMetrics, compute_metrics
from .workload import Workload, arrival_times, deadlines_ms, validate


@dataclass
class SimRun:
    """One simulated run: the raw record, its metrics and the policy's configuration."""

    record: RunRecord
    metrics: RunMetrics
    policy: dict  # Policy.describe()
    wall_s: float  # seconds the simulation took


@dataclass
class SweepResult:
    """The highest load factor a policy sustains at ``target`` SLO attainment."""

    policy: str
    target: float  # SLO attainment required, e.g. 0.99
    max_factor: float  # highest passing factor found (0 when even the lowest tried failed)
    max_rps: float  # total demanded requests/s at max_factor
    points: list[tuple[float, float]] = field(default_factory=list)  # (factor, attainment), in trial order
    at_max: RunMetrics | None = None  # metrics of the run at max_factor


def _profiles_for(workload: Workload, profiles: ProfileStore | Mapping[str, Profile]) -> dict[str, Profile]:
    if isinstance(profiles, ProfileStore):
        validate(workload, profiles)
        return {m.name: profiles.get(m.name) for m in workload.models}
    missing = [m.name for m in workload.models if m.name not in profiles]
    if missing:
        raise ValueError(f"no profile for {missing}; have {sorted(profiles)}")
    return {m.name: profiles[m.name] for m in workload.models}


def make_context(
    workload: Workload, profiles: Mapping[str, Profile], *, contention: ContentionModel | None = None
) -> PolicyContext:
    """The :class:`PolicyContext` for ``workload``: profiles, SLOs, weights, mean rates, the GPU, and
    what of the simulated device (``contention``) a policy may know: its knee and its holds."""
    first = next(iter(profiles.values()))
    models = {
        m.name: ModelInfo(m.name, profiles[m.name], float(m.slo_ms), float(m.weight), workload.mean_rate(m))
        for m in workload.models
    }
    device = contention or ContentionModel()
    return PolicyContext(
        models=models,
        gpu_sms=first.gpu.sm_count,
        granularity=first.gpu.sm_granularity,
        simulated=True,
        knee_eps=device.knee_eps,
        sim_hold_ms=device.batch_overhead_ms,
        sim_hold_per_ms=device.hold_per_ms,
        sim_model_hold_ms=dict(device.model_overhead_ms),
        sim_hold_per_request_ms=device.hold_per_request_ms,
    )


def make_requests(workload: Workload) -> list[Request]:
    """Every request of ``workload`` in arrival order (ties by model order), ids 0..n-1, each due at
    its model's SLO or, for a model with ``deadline_factors``, at its own drawn multiple of it."""
    times = arrival_times(workload)
    due = deadlines_ms(workload, times)
    # model by model in workload order, then a stable sort by time alone: equal times stay in model
    # order, as a sort by (time, model's position) left them, with far cheaper comparisons
    merged = [(t * 1000.0, m.name, d) for m in workload.models for t, d in zip(times[m.name], due[m.name])]
    merged.sort(key=itemgetter(0))
    return [Request(i, m, t, t + d) for i, (t, m, d) in enumerate(merged)]


def simulate(
    workload: Workload,
    profiles: ProfileStore | Mapping[str, Profile],
    policy: str | Policy,
    *,
    contention: ContentionModel | None = None,
    options: Mapping[str, object] | None = None,
    trace: bool = False,
    device_profiles: ProfileStore | Mapping[str, Profile] | None = None,
    queue_limit: int | None = None,
) -> SimRun:
    """Run ``workload`` under ``policy`` on the simulated GPU.

    Arrivals span ``workload.duration_s``; the policy may keep dispatching for one more (largest)
    SLO so that every request's fate is decided by its deadline, then running batches finish.
    ``device_profiles``: how long batches really take on the simulated GPU, where that differs from
    the ``profiles`` the policy plans with (a GPU slower than its profiles, as measured on the H200).
    ``queue_limit``: refuse a request while this many of its model's are queued or running, as the
    service does (``gpuloom bench`` serves with 1024); None (default) refuses none.
    """
    t0 = time.perf_counter()
    profs = _profiles_for(workload, profiles)
    ctx = make_context(workload, profs, contention=contention)
    pol = make_policy(policy, **(options or {})) if isinstance(policy, str) else policy
    backend = SimBackend(profs if device_profiles is None else _profiles_for(workload, device_profiles),
                         contention=contention)
    requests = make_requests(workload)
    until = workload.duration_s * 1000.0
    rt = Runtime(pol, backend, ctx, trace=trace)
    record = rt.run(requests, until_ms=until, drain_ms=max(m.slo_ms for m in workload.models), queue_limit=queue_limit)
    metrics = compute_metrics(record, models=list(ctx.models))
    return SimRun(record, metrics, pol.describe(), time.perf_counter() - t0)


def compare(
    workload: Workload,
    profiles: ProfileStore | Mapping[str, Profile],
    policies: Sequence[str],
    *,
    contention: ContentionModel | None = None,
) -> list[SimRun]:
    """One simulated run per policy, same arrivals."""
    return [simulate(workload, profiles, p, contention=contention) for p in policies]


def sweep_rate(
    workload: Workload,
    profiles: ProfileStore | Mapping[str, Profile],
    policy: str,
    *,
    target: float = 0.99,
    rel_tol: float = 0.03,
    lo: float = 1 / 64,
    hi: float = 64.0,
    contention: ContentionModel | None = None,
    options: Mapping[str, object] | None = None,
    device_profiles: ProfileStore | Mapping[str, Profile] | None = None,
    queue_limit: int | None = None,
) -> SweepResult:
    """Highest ``Workload.scaled`` factor at which ``policy`` (built with ``options``) keeps SLO
    attainment >= ``target`` (on a GPU as fast as ``device_profiles`` where given, with ``queue_limit``,
    see :func:`simulate`).

    Doubles (or halves) from factor 1 to bracket the threshold, then bisects (geometrically) until
    the bracket is within ``rel_tol``. Attainment need not be monotone in load; the result is the
    highest *tried* passing factor below the first failing bracket.
    """
    if not (0 < target <= 1):
        raise ValueError(f"target attainment must be in (0, 1], found {target}")
    points: list[tuple[float, float]] = []
    runs: dict[float, SimRun] = {}

    def ok(f: float) -> bool:
        run = simulate(workload.scaled(f), profiles, policy, contention=contention, options=options,
                       device_profiles=device_profiles, queue_limit=queue_limit)
        runs[f] = run
        points.append((f, run.metrics.slo_attainment))
        return run.metrics.slo_attainment >= target

    f = 1.0
    if ok(f):
        good, bad = f, None
        while good * 2 <= hi:
            if ok(good * 2):
                good *= 2
            else:
                bad = good * 2
                break
    else:
        good, bad = 0.0, f
        while bad / 2 >= lo:
            if ok(bad / 2):
                good = bad / 2
                break
            bad /= 2
    if good > 0 and bad is not None:
        while bad / good > 1 + rel_tol:
            mid = (good * bad) ** 0.5
            if ok(mid):
                good = mid
            else:
                bad = mid
    best = runs.get(good)
    return SweepResult(
        policy=policy,
        target=target,
        max_factor=good,
        max_rps=workload.total_rate() * good,
        points=points,
        at_max=best.metrics if best else None,
    )


def fluid_bound(
    workload: Workload,
    profiles: ProfileStore | Mapping[str, Profile],
    *,
    hi: float = 256.0,
    rel_tol: float = 0.002,
    knee_eps: float = 0.1,
) -> float:
    """A capacity bound on the load factor: the largest ``f`` at which ``workload.scaled(f)`` fits a
    fluid GPU.

    Each request of model ``m`` (mean rate ``r``) costs at least ``c_m(r)`` SM-milliseconds: the least
    ``s * L(b, s) / b`` over profile batches ``b`` and SM counts ``s`` (plus ``knee(b) * L(b, whole
    GPU)``, what the contention model charges a shared batch) whose batch can fill and run within the
    SLO, ``(b - 1) / r + L(b, s) <= SLO``. The load fits when ``sum r * f * c_m(r * f) <= SMs * 1000``.
    Queueing, bursts and packing are ignored, so no policy should sustain much more (Poisson luck can
    let one slightly exceed it with batches larger than the mean rate fills).
    """
    profs = _profiles_for(workload, profiles)
    gpu = next(iter(profs.values())).gpu.sm_count
    rates = {m.name: workload.mean_rate(m) for m in workload.models}
    slo = {m.name: float(m.slo_ms) for m in workload.models}

    def cost(m: str, r: float) -> float:
        p = profs[m]
        best = float("inf")
        for b in p.batches:
            fill = (b - 1) / r * 1000.0 if r > 0 else (0.0 if b == 1 else float("inf"))
            options = [(s, p.latency(b, s)) for s in p.sms] + [(min(gpu, p.knee(b, knee_eps)), p.full_latency(b))]
            for s, lat in options:
                if fill + lat <= slo[m]:
                    best = min(best, s * lat / b)
        return best

    def fits(f: float) -> bool:
        return sum(r * f * cost(m, r * f) for m, r in rates.items() if r > 0) <= gpu * 1000.0

    lo = 0.0
    f = 1.0
    if fits(f):
        lo = f
        while lo * 2 <= hi and fits(lo * 2):
            lo *= 2
        up = lo * 2
    else:
        up = f
        while up > 1e-6 and not fits(up / 2):
            up /= 2
        lo = up / 2
    while lo > 0 and up / lo > 1 + rel_tol:
        mid = (lo * up) ** 0.5
        if fits(mid):
            lo = mid
        else:
            up = mid
    return lo
