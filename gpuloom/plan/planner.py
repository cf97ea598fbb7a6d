"""The D-STACK planner: batch sizes under SLO and a space-time schedule of one GPU.

Latency model
-------------
Every partition repeats a cycle of ``C`` ms. A model ``m`` served at ``r`` requests/s owns ``k``
back-to-back slots of batch ``b`` in one partition of ``s`` SMs; each slot lasts ``L(b, s)`` (the
profile). Its requests are collected for one cycle while its batch fills, then run in its next
``k`` slots. So a request

* waits for its batch to fill and for the model's next slot: at most one cycle, ``C`` (the fill
  time ``b / r`` is spent *inside* that wait: the planner sizes ``k * b >= r * C``, so the requests
  of one cycle always fit the next cycle's slots; counting fill and cycle separately would count the
  same wait twice), then
* runs: at most ``k * L(b, s)`` (it may ride in the model's last slot of the cycle).

``worst = C + k * L(b, s) <= SLO`` is the constraint, and ``k * L(b, s) <= C`` (the model's slots fit
in the cycle). The bound holds for arrivals at the planned rate; Poisson bursts beyond ``k * b`` in
one cycle wait a cycle more, which is what ``headroom`` (plan ``rate * (1 + headroom)``) and the
leftover SMs handed to partitions are for. ``choose_batch`` is the stand-alone form for one model
on its own partition, where there is no shared cycle: ``worst = b / r (fill) + cycle_ms + L(b, s)``.

Algorithm
---------
1. Cycle: from the tightest SLO ``S``. Candidates ``C = f * S`` (and one that leaves the tightest
   model just its batch-1 latency); each is packed and the one using the least SM-time wins.
2. Options: for each model and each partition size (multiples of the granularity), the batch
   bucket ``b`` and slot count ``k = ceil(r C / b)`` that minimize the model's busy time
   ``k L(b, s)`` under the constraints above. Its preferred size is the one with the least
   SM-time per cycle ``s * k * L(b, s)`` (the highest throughput per SM; within 3%, the fewest SMs).
3. Packing (first-fit decreasing, space then time): models in decreasing preferred size join an
   existing partition whose cycle still has room (and whose size they can use without wasting more
   than 15% SM-time), else open a new partition of their preferred size. Models whose best option
   is the whole GPU end up sharing it in time.
4. Leftover SMs go, one granularity step at a time, to the partition they shorten most (relative
   to its slack); the last partition takes the sub-granularity remainder (132 = 16 * 8 + 4).
5. Overload: progressive filling (weighted max-min on served fraction of demand). All unfrozen
   models are raised together to ``min(1, weight * level)`` while the packing succeeds (binary
   search on the level); those that cannot be raised alone any further are frozen; repeat.

Reference: Dhakal et al., "D-STACK: High Throughput DNN Inference by Effective Multiplexing and
Spatio-Temporal Scheduling of GPUs" (2023).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from gpuloom.profile.store import Profile, ProfileError, ProfileStore

from .schedule import Demand, ModelPlan, Partition, PlanError, PlanInfeasible, Schedule, Slot

CYCLE_FRACTIONS = (0.6, 0.5, 0.4, 0.3, 0.2, 0.12)  # candidate cycle lengths, as fractions of the tightest SLO
_PREF_TOL = 1.03  # sizes within 3% of the least SM-time count as equally efficient: take fewer SMs
_JOIN_WASTE = 1.15  # join a partition rather than open one if it costs at most 15% more SM-time
_EPS = 1e-9


# -- the batch-size optimizer on its own -----------------------------------------------------
def choose_batch(
    profile: Profile,
    rate: float,
    slo_ms: float,
    sms_options: Sequence[int],
    *,
    cycle_ms: float = 0.0,
) -> tuple[int, int, float]:
    """Batch and SM count for one model on a partition of its own.

    Latency model: a request waits for its batch to fill (at most ``b / rate``), then up to
    ``cycle_ms`` for its turn (0 when the partition is the model's alone), then runs ``L(b, s)``:
    ``b / rate + cycle_ms + L(b, s) <= slo_ms``.

    Among the feasible ``(b, s)`` that keep up with ``rate`` (``b / L(b, s) >= rate``), returns the
    one with the highest throughput per SM (ties: fewer SMs, then a smaller batch). If none keeps
    up, the feasible option with the highest throughput. Returns ``(batch, sms, latency_ms)``.

    Raises ``PlanError`` for a non-positive rate or SLO, ``PlanInfeasible`` when no option meets
    the SLO.
    """
    if not rate > 0:
        raise PlanError(f"choose_batch: rate must be > 0 requests/s, found {rate}")
    if not slo_ms > 0:
        raise PlanError(f"choose_batch: slo_ms must be > 0, found {slo_ms}")
    sms_list = sorted({int(s) for s in sms_options if s >= profile.sms[0]})
    if not sms_list:
        raise PlanError(
            f"choose_batch({profile.model}): no SM option >= the profile's smallest {profile.sms[0]}; got {list(sms_options)}"
        )
    keep_up: list[tuple[float, int, int, float]] = []
    other: list[tuple[float, int, int, float]] = []
    for s in sms_list:
        for b in profile.batches:
            lat = profile.latency(b, s)
            if b * 1000.0 / rate + cycle_ms + lat > slo_ms + _EPS:
                continue
            thr = b * 1000.0 / lat
            if thr >= rate:
                keep_up.append((-thr / s, s, b, lat))
            else:
                other.append((-thr, s, b, lat))
    if keep_up:
        _, s, b, lat = min(keep_up)
    elif other:
        _, s, b, lat = min(other)
    else:
        raise PlanInfeasible(
            f"{profile.model}: no batch in {list(profile.batches)} on {sms_list} SMs meets SLO {slo_ms:g} ms at "
            f"{rate:g} requests/s (fastest: batch {profile.batches[0]} fills in {1000.0 / rate:.2f} ms + cycle "
            f"{cycle_ms:.2f} ms + {profile.min_latency():.2f} ms)"
        )
    return b, s, lat


# -- the space-time planner ------------------------------------------------------------------
@dataclass
class _Model:
    demand: Demand
    profile: Profile
    need_rps: float  # rate * (1 + headroom)
    lat: dict[int, list[float | None]]  # batch bucket -> latency (ms) per unit count u (index u; None: too few SMs)


@dataclass
class _Opt:
    busy: float  # k * L(b, u), ms per cycle
    b: int
    k: int


@dataclass
class _Part:
    u: int  # granularity units
    used: float = 0.0  # ms of the cycle taken by slots
    members: list[tuple[str, int, int]] = field(default_factory=list)  # (model, batch, k)


class _Planner:
    def __init__(self, demands: Sequence[Demand], profiles: ProfileStore, gpu_sms: int, g: int, headroom: float):
        self.g = g
        self.headroom = headroom
        self.gpu_sms = gpu_sms
        self.U = gpu_sms // g
        self.rem = gpu_sms - self.U * g
        self.models: dict[str, _Model] = {}
        for d in demands:
            prof = profiles.get(d.model)
            lat: dict[int, list[float | None]] = {}
            for b in prof.batches:
                row: list[float | None] = [None]
                for u in range(1, self.U + 1):
                    s = u * g if u < self.U else gpu_sms  # a whole-GPU partition takes the remainder too
                    row.append(prof.latency(b, s) if s >= prof.sms[0] else None)
                lat[b] = row
            self.models[d.model] = _Model(d, prof, d.rate * (1.0 + headroom), lat)
        self._opt_cache: dict[tuple[str, float, float], dict[int, _Opt]] = {}

    def size(self, u: int) -> int:
        return u * self.g if u < self.U else self.gpu_sms

    def latency(self, name: str, b: int, sms: int) -> float:
        return self.models[name].profile.latency(b, sms)

    def options(self, name: str, n: float, C: float) -> dict[int, _Opt]:
        """Least-busy (b, k) per unit count u for ``n`` requests per cycle of ``C`` ms."""
        key = (name, n, C)
        got = self._opt_cache.get(key)
        if got is not None:
            return got
        m = self.models[name]
        slo = m.demand.slo_ms
        limit = min(C, slo - C) + _EPS
        out: dict[int, _Opt] = {}
        for b, row in m.lat.items():
            k = max(1, math.ceil(n / b - 1e-9))
            for u in range(1, self.U + 1):
                L = row[u]
                if L is None:
                    continue
                busy = k * L
                if busy > limit:
                    continue
                cur = out.get(u)
                if cur is None or busy < cur.busy - _EPS or (abs(busy - cur.busy) <= _EPS and k < cur.k):
                    out[u] = _Opt(busy, b, k)
        self._opt_cache[key] = out
        return out

    def per_cycle(self, name: str, frac: float, C: float) -> float:
        return self.models[name].need_rps * frac * C / 1000.0

    def pack(self, fracs: dict[str, float], C: float) -> tuple[list[_Part], list[str]]:
        """Place every model with ``fracs[m] > 0``; returns (partitions, models that did not fit)."""
        items = []
        for name, f in fracs.items():
            if f <= 0 or self.models[name].need_rps <= 0:
                continue
            opts = self.options(name, self.per_cycle(name, f, C), C)
            if not opts:
                items.append((0, 0.0, name, opts, 0))
                continue
            best = min(u * o.busy for u, o in opts.items())
            pref = min(u for u, o in opts.items() if u * o.busy <= best * _PREF_TOL)
            items.append((pref, best, name, opts, pref))
        items.sort(key=lambda it: (-it[0], -it[1], it[2]))
        parts: list[_Part] = []
        free = self.U
        failed: list[str] = []
        for pref, _, name, opts, _ in items:
            if not opts:
                failed.append(name)
                continue
            join = None
            for p in parts:
                o = opts.get(p.u)
                if o is None or p.used + o.busy > C + _EPS:
                    continue
                cost = p.u * o.busy
                if join is None or cost < join[0] - _EPS or (abs(cost - join[0]) <= _EPS and p.used > join[1].used):
                    join = (cost, p, o)
            new = None
            if pref <= free:
                new = (pref * opts[pref].busy, pref)
            else:
                fits = [(u * o.busy, u) for u, o in opts.items() if u <= free]
                if fits:
                    new = min(fits)
            if join is not None and (new is None or join[0] <= _JOIN_WASTE * new[0]):
                _, p, o = join
                p.used += o.busy
                p.members.append((name, o.b, o.k))
            elif new is not None:
                u = new[1]
                o = opts[u]
                parts.append(_Part(u=u, used=o.busy, members=[(name, o.b, o.k)]))
                free -= u
            else:
                failed.append(name)
        return parts, failed

    def feasible(self, fracs: dict[str, float], C: float) -> bool:
        return not self.pack(fracs, C)[1]

    def used_units(self, parts: list[_Part]) -> int:
        return sum(p.u for p in parts)

    def sm_time(self, parts: list[_Part], C: float) -> float:
        return sum(p.u * p.used for p in parts) / (self.U * C)

    def grow(self, parts: list[_Part], C: float) -> None:
        """Hand leftover granularity units to the partitions they shorten most, relative to slack."""
        free = self.U - self.used_units(parts)
        while free > 0 and parts:
            best = None
            for p in parts:
                new_used = sum(k * self.latency(n, b, self.size(p.u + 1)) for n, b, k in p.members)
                gain = p.used - new_used
                if gain <= 0.005 * C:
                    continue
                score = gain / max(C - p.used, 0.05 * C)
                if best is None or score > best[0]:
                    best = (score, p, new_used)
            if best is None:
                return
            _, p, new_used = best
            p.u += 1
            p.used = new_used
            free -= 1


def plan(
    demands: Sequence[Demand],
    profiles: ProfileStore,
    *,
    gpu_sms: int | None = None,
    granularity: int | None = None,
    eps: float = 0.1,
    cycle_ms: float | None = None,
    headroom: float = 0.0,
    fair_step: float = 0.02,
) -> Schedule:
    """Plan one GPU for ``demands``: disjoint SM partitions, each a repeating cycle of slots.

    See the module docstring for the latency model and the algorithm. ``gpu_sms`` and
    ``granularity`` default to the profiles' GPU. ``cycle_ms`` fixes the cycle instead of choosing
    it. ``headroom`` plans capacity for ``rate * (1 + headroom)``. Under overload, served fractions
    are weighted max-min fair to within ``fair_step`` (a fraction of demand). ``eps`` is the knee
    tolerance recorded with the schedule (the planner itself optimizes SM-time, which stops paying
    past the knee by construction).

    Raises ``PlanError`` for unknown models, duplicate models or inconsistent profiles.
    """
    t0 = time.perf_counter()
    demands = list(demands)
    if not demands:
        raise PlanError("plan() needs at least one Demand")
    names = [d.model for d in demands]
    if len(set(names)) != len(names):
        raise PlanError(f"each model may appear once in a plan; repeated: {sorted({n for n in names if names.count(n) > 1})}")
    if headroom < 0:
        raise PlanError(f"headroom must be >= 0, found {headroom}")
    profs = []
    for d in demands:
        try:
            profs.append(profiles.get(d.model))
        except ProfileError as e:
            raise PlanError(f"cannot plan {d.model!r}: {e}") from None
    gpus = {(p.gpu.sm_count, p.gpu.sm_granularity) for p in profs}
    gpu_sms = int(gpu_sms if gpu_sms is not None else max(s for s, _ in gpus))
    g = int(granularity if granularity is not None else max(gr for _, gr in gpus))
    if gpu_sms < 1 or g < 1 or g > gpu_sms:
        raise PlanError(f"need 1 <= granularity <= gpu_sms, found granularity={g}, gpu_sms={gpu_sms}")
    pl = _Planner(demands, profiles, gpu_sms, g, headroom)
    active = [d for d in demands if d.rate > 0]

    if not active:
        C = cycle_ms if cycle_ms is not None else min(d.slo_ms for d in demands) * CYCLE_FRACTIONS[1]
        return _build(pl, [], {}, C, eps, t0, {})

    if cycle_ms is not None:
        if not cycle_ms > 0:
            raise PlanError(f"cycle_ms must be > 0, found {cycle_ms}")
        candidates = [float(cycle_ms)]
    else:
        tight = min(active, key=lambda d: d.slo_ms)
        s_min = tight.slo_ms
        candidates = [s_min * f for f in CYCLE_FRACTIONS]
        l1 = pl.models[tight.model].profile.min_latency()
        if s_min > l1:
            candidates.append(0.5 * (s_min - l1))
        candidates = sorted(set(candidates), reverse=True)

    full = {d.model: 1.0 for d in active}
    best = None
    for C in candidates:
        parts, failed = pl.pack(full, C)
        if not failed:
            score = pl.sm_time(parts, C)
            if best is None or score < best[0] - 1e-12:
                best = (score, C, parts)
    if best is not None:
        _, C, parts = best
        fracs = full
    else:
        C = min(candidates, key=lambda c: _load_bound(pl, full, c))
        fracs = _fair_share(pl, active, C, fair_step)
        parts, failed = pl.pack(fracs, C)
        assert not failed, f"fair share {fracs} must pack"
    pl.grow(parts, C)
    return _build(pl, parts, fracs, C, eps, t0, {"candidates_ms": candidates})


def _load_bound(pl: _Planner, fracs: dict[str, float], C: float) -> float:
    """SM-time per cycle the models need at their most efficient size, ignoring fragmentation."""
    total = 0.0
    for name, f in fracs.items():
        opts = pl.options(name, pl.per_cycle(name, f, C), C)
        total += min(u * o.busy for u, o in opts.items()) / (pl.U * C) if opts else 1.0
    return total


def _fair_share(pl: _Planner, active: list[Demand], C: float, step: float) -> dict[str, float]:
    """Weighted max-min fractions of demand by progressive filling (see the module docstring)."""
    w = {d.model: d.weight for d in active}
    frozen: dict[str, float] = {}
    todo = [d.model for d in active]
    lo = 0.0
    while todo:

        def at(level: float) -> dict[str, float]:
            f = dict(frozen)
            f.update({m: min(1.0, w[m] * level) for m in todo})
            return f

        hi = max(1.0 / w[m] for m in todo)
        if pl.feasible(at(hi), C):
            frozen.update({m: 1.0 for m in todo})
            break
        # binary search the common level to within step / (2 max weight)
        tol = step / (2.0 * max(w[m] for m in todo))
        while hi - lo > tol:
            mid = 0.5 * (lo + hi)
            if pl.feasible(at(mid), C):
                lo = mid
            else:
                hi = mid
        cur = at(lo)
        stuck = []
        for m in todo:
            if cur[m] >= 1.0:
                stuck.append(m)
                continue
            trial = dict(cur)
            trial[m] = min(1.0, cur[m] + step)
            if not pl.feasible(trial, C):
                stuck.append(m)
        if not stuck:  # the packing is not perfectly monotone: freeze everyone rather than loop
            stuck = list(todo)
        for m in stuck:
            frozen[m] = cur[m]
        todo = [m for m in todo if m not in stuck]
    return frozen


def _build(
    pl: _Planner, parts: list[_Part], fracs: dict[str, float], C: float, eps: float, t0: float, meta: dict
) -> Schedule:
    """Lay the packed partitions out on SMs and in time, and summarize each model."""
    parts = sorted(parts, key=lambda p: (-p.u, -p.used))
    sizes = [p.u * pl.g for p in parts]
    if parts and sum(p.u for p in parts) == pl.U:
        sizes[-1] += pl.rem
    partitions = []
    placed: dict[str, tuple[int, int, int, int, float]] = {}  # model -> (partition, sms, batch, k, L)
    offset = 0
    for i, (p, sms) in enumerate(zip(parts, sizes)):
        members = sorted(p.members, key=lambda mb: (pl.models[mb[0]].demand.slo_ms, mb[0]))
        slots = []
        t = 0.0
        for name, b, k in members:
            L = pl.latency(name, b, sms)
            for _ in range(k):
                slots.append(Slot(model=name, batch=b, start_ms=t, duration_ms=L))
                t += L
            placed[name] = (i, sms, b, k, L)
        partitions.append(Partition(index=i, sm_offset=offset, sms=sms, slots=tuple(slots)))
        offset += sms
    models = []
    short = []
    for name, m in pl.models.items():
        d = m.demand
        if name in placed:
            i, sms, b, k, L = placed[name]
            planned = k * b * 1000.0 / C
            worst = C + k * L
        else:
            i, sms, b, k, L, planned, worst = -1, 0, 0, 0, 0.0, 0.0, 0.0
        served = 1.0 if m.need_rps <= 0 else min(1.0, planned / m.need_rps)
        if served < 1.0 - 1e-9:
            short.append((name, 1.0 - served))
        models.append(
            ModelPlan(
                model=name,
                batch=b,
                sms=sms,
                partition=i,
                latency_ms=L,
                demand_rps=d.rate,
                planned_rps=planned,
                slo_ms=d.slo_ms,
                served_fraction=served,
                slots_per_cycle=k,
                worst_ms=worst,
                weight=d.weight,
            )
        )
    short.sort(key=lambda x: -x[1])
    gpu_names = {m.profile.gpu.name for m in pl.models.values()}
    meta = dict(meta)
    meta.update(
        {
            "planner": "dstack",
            "eps": eps,
            "plan_ms": round((time.perf_counter() - t0) * 1000.0, 3),
            "headroom": pl.headroom,
        }
    )
    return Schedule(
        gpu_sms=pl.gpu_sms,
        granularity=pl.g,
        cycle_ms=C,
        partitions=tuple(partitions),
        models=tuple(models),
        short=tuple(short),
        gpu=" / ".join(sorted(gpu_names)),
        meta=meta,
    )
