"""The D-STACK planner: batch sizes under SLO and a space-time schedule of one GPU.

Latency model
-------------
Every partition repeats a *period* ``c`` ms; all periods divide the schedule's cycle, so every
pattern repeats within one cycle. A model ``m`` served at ``r`` requests/s owns ``k`` back-to-back
slots of batch ``b`` in one partition of ``s`` SMs; each slot lasts ``L(b, s)`` (the profile). Its
requests are collected for one period while its batch fills, then run in its next ``k`` slots. So
a request

* waits for its batch to fill and for the model's next slot: at most one period, ``c`` (the fill
  time ``b / r`` is spent *inside* that wait: the planner sizes ``k * b >= r * c``, so the requests
  of one period always fit the next period's slots; counting fill and wait separately would count
  the same wait twice), then
* runs: at most ``k * L(b, s)`` (it may ride in the model's last slot of the period).

With ``batch_overhead_ms`` = ``h`` every slot lasts ``L(b, s) + h`` instead: on the H200 a batch held its
partition 0.4-1.2 ms beyond its device time (launch, completion, the runtime's turnaround;
``docs/reports/runtime.md``), and a plan that ignores it can fill a partition past what it delivers.

``worst = c + k * L(b, s) <= SLO`` is the constraint, with ``k * L(b, s) <= c`` (the model's slots
fit in the period). The bound holds for arrivals at the planned rate; Poisson bursts beyond
``k * b`` in one period wait a period more, which is what ``headroom`` (plan
``rate * (1 + headroom)``) and the leftover SMs handed to partitions are for. ``choose_batch`` is
the stand-alone form for one model on its own partition, where there is no shared period:
``worst = b / r (fill) + cycle_ms + L(b, s)``.

Algorithm
---------
1. Cycle candidates ``C = f * loosest SLO`` for four phases ``f`` of one octave. A model may run at
   periods ``C / j`` in ``[SLO / 16, SLO)``: the ladder ``C / 2**i`` (shared, so models can share a
   partition in time) and, per batch bucket ``b`` and ``k`` in {1, 2}, the longest ``C / j`` whose
   arrivals fit ``k * b`` (nothing lost to rounding a batch up to its bucket).
2. Options: for each model, period and partition size (multiples of the granularity), the batch
   bucket ``b`` and slot count ``k = ceil(r c / b)`` that minimize the busy time ``k L(b, s)`` under
   the constraints. The preferred option has the least SM-time per period ``s k L(b, s) / c``
   (the highest throughput per SM; within 3%, the fewest SMs).
3. Packing (first-fit decreasing, space then time): models in decreasing preferred size join an
   existing partition whose period still has room (at that partition's size and period, if that
   costs at most ``join_waste`` x the SM-time of opening one), else open a partition of their
   preferred size; when SMs run out, a partition may grow into the free SMs so the newcomer fits.
   Several strategies (``STRATEGIES``) are tried per cycle candidate; the packing with the least
   SM-time wins. Models whose best option is the whole GPU end up sharing it in time.
4. Leftover SMs go, one granularity step at a time, to the partition they shorten most (relative
   to its slack); the largest partition (``remainder="largest"``; "smallest" was the rule until
   run 41) takes the sub-granularity remainder (132 = 16 * 8 + 4) when it has at least
   ``MIN_SMS_WITH_REMAINDER`` SMs, else the remainder stays idle: on the H200 a 12-SM green context
   of 8 SMs plus the 4-SM remainder failed cuDNN launches (twice, in graph capture;
   docs/reports/runtime.md). The partition with the remainder is carved last and gets the SMs the
   driver's co-scheduled splits leave over; on the H200 those ran cuDNN convolutions 1.4-1.7x
   slower than their count (vgg16 on 20 of them: 17.0 ms at batch 8, vs 13.7 on a 16-SM group)
   while matrix products ran at their count (``scripts/diag_carvings.py``, run 41). Given to the
   largest partition, every partition of mix6's layouts ran within 1.05x of its profile alone
   (bert_base on 36 and 52 SMs 0.998 and 1.012, efficientnet_b0 on 36 0.938; run 42), where the
   smallest one ran 1.47x.
5. Overload: weighted max-min fairness on served fraction of demand. Progressive filling (all
   unfrozen models raised together to ``min(1, weight * level)`` while the packing succeeds, binary
   search on the level; those that cannot rise alone are frozen; repeat), then ``_polish``, because
   the packing heuristic is not perfectly monotone. ``fits`` is the packing search on its own.

Reference: Dhakal et al., "D-STACK: High Throughput DNN Inference by Effective Multiplexing and
Spatio-Temporal Scheduling of GPUs" (2023).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from gpuloom.profile.store import Profile, ProfileError, ProfileStore

from .schedule import Demand, ModelPlan, Partition, PlanError, PlanInfeasible, Schedule, Slot

# candidate cycles as fractions of the loosest SLO: four phases of one octave (each ladder halves down)
TOP_FRACTIONS = (0.84, 0.71, 0.59, 0.5)
_PREF_TOL = 1.03  # sizes within 3% of the least SM-time count as equally efficient: take fewer SMs
MATCHED_PERIODS = True  # also offer each model the cycle divisors that match its batch buckets
# packing strategies tried in turn: (size preference, join a partition if it costs <= this x opening one)
STRATEGIES = (("fewest", 1.15), ("cheapest", 1.15), ("fewest", 3.0), ("tightest", 1.15), ("uniform", 3.0))
_EPS = 1e-9
MIN_SMS_WITH_REMAINDER = 16  # a partition smaller than this does not take the sub-granularity remainder
REMAINDERS = ("largest", "smallest")  # which partition takes the sub-granularity remainder (step 4)


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
    busy: float  # k * L(b, u), ms per period
    b: int
    k: int


@dataclass
class _Part:
    u: int  # granularity units
    c: float  # period, ms
    used: float = 0.0  # ms of the period taken by slots
    members: list[tuple[str, int, int]] = field(default_factory=list)  # (model, batch, k)


class _Planner:
    """Packing state shared by the cycle search and the fairness search (caches options)."""

    def __init__(self, demands: Sequence[Demand], profiles: ProfileStore, gpu_sms: int, g: int, headroom: float,
                 batch_overhead_ms: float = 0.0, min_sms: int = 0, model_overhead_ms: Mapping[str, float] | None = None):
        self.g = g
        self.headroom = headroom
        # added to every slot: the partition is held that much longer (per model where given)
        self.overhead = {d.model: (model_overhead_ms or {}).get(d.model, batch_overhead_ms) for d in demands}
        self.gpu_sms = gpu_sms
        self.U = gpu_sms // g
        self.rem = gpu_sms - self.U * g
        self.models: dict[str, _Model] = {}
        for d in demands:
            prof = profiles.get(d.model)
            lat: dict[int, list[float | None]] = {}
            h = self.overhead[d.model]
            for b in prof.batches:
                row: list[float | None] = [None]
                for u in range(1, self.U + 1):
                    s = self.size(u)
                    row.append(prof.latency(b, s) + h if s >= max(prof.sms[0], min_sms) else None)
                lat[b] = row
            self.models[d.model] = _Model(d, prof, d.rate * (1.0 + headroom), lat)
        self._opt_cache: dict[tuple[str, float, float], dict[int, _Opt]] = {}
        self._period_cache: dict[tuple[str, float, float], list[float]] = {}

    def size(self, u: int) -> int:
        """SMs of a partition of ``u`` units; a whole-GPU partition takes the remainder too."""
        return u * self.g if u < self.U else self.gpu_sms

    def latency(self, name: str, b: int, sms: int) -> float:
        """How long one slot of batch ``b`` holds a partition of ``sms``: the profile plus the overhead."""
        return self.models[name].profile.latency(b, sms) + self.overhead[name]

    def periods(self, name: str, f: float, ladder: Sequence[float]) -> list[float]:
        """Periods a model may run at, all dividing the cycle ``ladder[0]``, shorter than its SLO
        and not absurdly shorter: the ladder's (shared by many models, so they can share a
        partition in time) plus, per batch bucket ``b`` and slot count ``k``, the longest
        ``cycle / j`` whose arrivals fit ``k * b`` (no capacity lost to rounding up to a bucket)."""
        key = (name, f, ladder[0])
        got = self._period_cache.get(key)
        if got is not None:
            return got
        m = self.models[name]
        slo = m.demand.slo_ms
        out = {c for c in ladder if slo / 16.0 <= c < slo}
        rate = m.need_rps * f
        C = ladder[0]
        if rate > 0 and MATCHED_PERIODS:
            for b in m.lat:
                for k in (1, 2):
                    exact = k * b * 1000.0 / rate
                    c = C / max(1, math.ceil(C / exact - 1e-9))
                    if slo / 16.0 <= c < slo:
                        out.add(c)
        got = sorted(out, reverse=True)
        self._period_cache[key] = got
        return got

    def options(self, name: str, f: float, c: float) -> dict[int, _Opt]:
        """Least-busy (b, k) per unit count u serving fraction ``f`` of the demand at period ``c``."""
        key = (name, f, c)
        got = self._opt_cache.get(key)
        if got is not None:
            return got
        m = self.models[name]
        n = m.need_rps * f * c / 1000.0  # requests per period
        limit = min(c, m.demand.slo_ms - c) + _EPS
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

    def all_options(
        self, name: str, f: float, ladder: Sequence[float], only: float | None = None
    ) -> dict[tuple[float, int], _Opt]:
        periods = [only] if only is not None else self.periods(name, f, ladder)
        return {(c, u): o for c in periods for u, o in self.options(name, f, c).items()}

    def pack(
        self, fracs: dict[str, float], ladder: Sequence[float], strategy: tuple[str, float] = STRATEGIES[0]
    ) -> tuple[list[_Part], list[str]]:
        """Place every model with ``fracs[m] > 0``; returns (partitions, models that did not fit).

        ``strategy`` = (preference, join_waste): preference "fewest" takes the fewest SMs among
        options within 3% of the least SM-time, "cheapest" the least SM-time, "uniform" puts every
        model on one period (the longest at most half the tightest SLO: most sharing in time);
        a model joins an existing partition if that costs at most ``join_waste`` x opening one.
        """
        pref_mode, join_waste = strategy
        only = None
        if pref_mode == "uniform":
            slos = [self.models[n].demand.slo_ms for n, f in fracs.items() if f > 0]
            if not slos:
                return [], []
            s_min = min(slos)
            fit = [c for c in ladder if c <= 0.5 * s_min]
            if not fit:
                return [], [n for n, f in fracs.items() if f > 0]
            only = fit[0]
        items = []
        failed: list[str] = []
        for name, f in fracs.items():
            if f <= 0 or self.models[name].need_rps <= 0:
                continue
            opts = self.all_options(name, f, ladder, only)
            if not opts:
                failed.append(name)
                continue
            cost = {cu: cu[1] * o.busy / cu[0] for cu, o in opts.items()}  # SM-fraction of the period
            best = min(cost.values())
            if pref_mode == "cheapest":
                pref = min(opts, key=lambda cu: (cost[cu], cu[1], -cu[0]))
            elif pref_mode == "tightest":  # fewest SMs that can carry the model at all: space first
                pref = min(opts, key=lambda cu: (cu[1], cost[cu], -cu[0]))
            else:
                pref = min((cu for cu in opts if cost[cu] <= best * _PREF_TOL), key=lambda cu: (cu[1], -cu[0]))
            items.append((pref[1], best, name, opts, cost, pref, f))
        items.sort(key=lambda it: (-it[0], -it[1], it[2]))
        parts: list[_Part] = []
        free = self.U
        for _, _, name, opts, cost, pref, f in items:
            slo = self.models[name].demand.slo_ms
            join = None
            for p in parts:
                o = opts.get((p.c, p.u))
                if o is None and p.c < slo and only is None:  # any partition's period will do
                    o = self.options(name, f, p.c).get(p.u)
                if o is None or p.used + o.busy > p.c + _EPS:
                    continue
                jc = p.u * o.busy / p.c
                if join is None or jc < join[0] - _EPS or (abs(jc - join[0]) <= _EPS and p.used > join[1].used):
                    join = (jc, p, o)
            new = None
            if pref[1] <= free:
                new = (cost[pref], pref)
            else:
                fits = [(cost[cu], cu) for cu in opts if cu[1] <= free]
                if fits:
                    new = min(fits)
            if join is not None and (new is None or join[0] <= join_waste * new[0]):
                _, p, o = join
                p.used += o.busy
                p.members.append((name, o.b, o.k))
            elif new is not None:
                c, u = new[1]
                o = opts[(c, u)]
                parts.append(_Part(u=u, c=c, used=o.busy, members=[(name, o.b, o.k)]))
                free -= u
            else:
                extra = self._repair(parts, name, f, free)
                if extra is None:
                    failed.append(name)
                else:
                    free -= extra
        return parts, failed

    def _repair(self, parts: list[_Part], name: str, f: float, free: int) -> int | None:
        """Fit ``name`` by growing one partition with the free units (its members speed up).

        Returns the units used, or None when no partition can take the model that way."""
        best = None
        for p in parts:
            for extra in range(1, free + 1):
                u2 = p.u + extra
                if best is not None and extra >= best[0]:
                    break
                if p.c >= self.models[name].demand.slo_ms:
                    break
                o = self.options(name, f, p.c).get(u2)
                if o is None:
                    continue
                used2 = sum(k * self.latency(n, b, self.size(u2)) for n, b, k in p.members)
                if used2 + o.busy <= p.c + _EPS:
                    best = (extra, p, u2, used2, o)
                    break
        if best is None:
            return None
        extra, p, u2, used2, o = best
        p.u, p.used = u2, used2 + o.busy
        p.members.append((name, o.b, o.k))
        return extra

    def search(
        self, fracs: dict[str, float], ladders: Sequence[Sequence[float]], *, first: bool = False
    ) -> tuple[list[float], list[_Part]] | None:
        """Try every ladder x strategy; the packing with the least SM-time (or the first that fits)."""
        best = None
        for ladder in ladders:
            for strategy in STRATEGIES:
                parts, failed = self.pack(fracs, ladder, strategy)
                if failed:
                    continue
                if first:
                    return list(ladder), parts
                score = self.sm_fraction(parts)
                if best is None or score < best[0] - 1e-12:
                    best = (score, list(ladder), parts)
        return None if best is None else (best[1], best[2])

    def feasible(self, fracs: dict[str, float], ladders: Sequence[Sequence[float]]) -> bool:
        return self.search(fracs, ladders, first=True) is not None

    def sm_fraction(self, parts: list[_Part]) -> float:
        """Planned SM-time / SM-time of the whole GPU (before leftover SMs are handed out)."""
        return sum(p.u * p.used / p.c for p in parts) / self.U

    def grow(self, parts: list[_Part]) -> None:
        """Hand leftover granularity units to the partitions they shorten most, relative to slack."""
        free = self.U - sum(p.u for p in parts)
        while free > 0 and parts:
            best = None
            for p in parts:
                new_used = sum(k * self.latency(n, b, self.size(p.u + 1)) for n, b, k in p.members)
                gain = (p.used - new_used) / p.c
                if gain <= 0.005:
                    continue
                score = gain / max(1.0 - p.used / p.c, 0.05)
                if best is None or score > best[0]:
                    best = (score, p, new_used)
            if best is None:
                return
            _, p, new_used = best
            p.u += 1
            p.used = new_used
            free -= 1


def _ladder(top: float, floor: float) -> list[float]:
    """Periods ``top, top/2, top/4, ...`` down to ``floor``: every one divides ``top``."""
    out = [top]
    while out[-1] / 2.0 >= floor:
        out.append(out[-1] / 2.0)
    return out


def _setup(
    demands: Sequence[Demand],
    profiles: ProfileStore,
    gpu_sms: int | None,
    granularity: int | None,
    cycle_ms: float | None,
    headroom: float,
    batch_overhead_ms: float = 0.0,
    min_sms: int = 0,
    model_overhead_ms: Mapping[str, float] | None = None,
) -> tuple[_Planner, list[Demand], list[list[float]]]:
    """Check the inputs once; the packing state, the models with demand, the candidate ladders."""
    demands = list(demands)
    if not demands:
        raise PlanError("plan() needs at least one Demand")
    if not all(isinstance(d, Demand) for d in demands):
        raise PlanError(f"plan() takes Demand objects, found {sorted({type(d).__name__ for d in demands})}")
    names = [d.model for d in demands]
    if len(set(names)) != len(names):
        raise PlanError(f"each model may appear once in a plan; repeated: {sorted({n for n in names if names.count(n) > 1})}")
    if not 0 <= headroom < math.inf:  # NaN and inf too: they ended in a ZeroDivisionError or a ValueError
        raise PlanError(f"headroom must be a finite number >= 0, found {headroom}")
    if not 0 <= batch_overhead_ms < math.inf:
        raise PlanError(f"batch_overhead_ms must be a finite number of ms >= 0, found {batch_overhead_ms}")
    bad = {m: h for m, h in (model_overhead_ms or {}).items()
           if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < math.inf}
    if bad:
        raise PlanError(f"model_overhead_ms must map model names to ms >= 0, found {bad}")
    profs = []
    for d in demands:
        try:
            profs.append(profiles.get(d.model))
        except ProfileError as e:
            raise PlanError(f"cannot plan {d.model!r}: {e}") from None
    gpu_sms = int(gpu_sms if gpu_sms is not None else max(p.gpu.sm_count for p in profs))
    g = int(granularity if granularity is not None else max(p.gpu.sm_granularity for p in profs))
    if gpu_sms < 1 or g < 1 or g > gpu_sms:
        raise PlanError(f"need 1 <= granularity <= gpu_sms, found granularity={g}, gpu_sms={gpu_sms}")
    if not (isinstance(min_sms, int) and 0 <= min_sms <= gpu_sms):
        raise PlanError(f"min_sms must be an integer in [0, gpu_sms={gpu_sms}], found {min_sms!r}")
    pl = _Planner(demands, profiles, gpu_sms, g, headroom, batch_overhead_ms, min_sms, model_overhead_ms)
    active = [d for d in demands if d.rate > 0]
    s_min = min(d.slo_ms for d in (active or demands))
    s_max = max(d.slo_ms for d in (active or demands))
    if cycle_ms is not None:
        if not cycle_ms > 0:
            raise PlanError(f"cycle_ms must be > 0, found {cycle_ms}")
        ladders = [_ladder(float(cycle_ms), min(cycle_ms, s_min) / 16.0)]
    else:
        ladders = [_ladder(s_max * f, s_min / 16.0) for f in TOP_FRACTIONS]
    return pl, active, ladders


def fits(
    demands: Sequence[Demand],
    profiles: ProfileStore,
    *,
    gpu_sms: int | None = None,
    granularity: int | None = None,
    cycle_ms: float | None = None,
    headroom: float = 0.0,
    batch_overhead_ms: float = 0.0,
    min_sms: int = 0,
    model_overhead_ms: Mapping[str, float] | None = None,
) -> bool:
    """True when the planner's packing search places every demand in full (admission control).

    This is the feasibility test ``plan`` itself uses when it shares an overloaded GPU, so it is
    also the yardstick its fairness claims are checked against. (``plan`` can occasionally serve a
    demand that ``fits`` rejects: rounding batches up to buckets may leave enough capacity.)
    """
    pl, active, ladders = _setup(demands, profiles, gpu_sms, granularity, cycle_ms, headroom, batch_overhead_ms, min_sms,
                                 model_overhead_ms)
    return not active or pl.feasible({d.model: 1.0 for d in active}, ladders)


def servable(
    demands: Sequence[Demand],
    profiles: ProfileStore,
    *,
    step: float = 1.25,
    tries: int = 40,
    **fit_kwargs,
) -> list[Demand]:
    """``demands``, each whose SLO no plan can meet even alone at a trickle of requests (1/s) with its
    SLO raised to the lowest ``slo * step**k`` that can be met.

    ``plan`` gives such a model nothing (it cannot be served within its SLO at any rate); next to
    other models it then never runs, even on an idle GPU and for requests whose own deadline it could
    meet. Planned for its reachable SLO it gets slots like any model, and the runtime still drops the
    requests that cannot make their own deadlines. ``fit_kwargs`` are :func:`fits`'s (the GPU, the
    holds, ``min_sms``). A demand that no SLO below ``slo * step**tries`` makes servable stays as it is.

    Then together: SLOs that each fit alone may still not share the GPU even at a trickle, because a
    partition's period is the cycle halved (``period + k L <= SLO``: two SLOs near their batches'
    latencies can want periods that no one cycle halves to), and the plan then leaves one model out
    beside unused SMs (sixty-fourth session's review: mobilenet_v2 dropped on an idle GPU with 68 SMs
    outside the layout). The SLOs of the models a trickle plan leaves out are raised a ``step`` at a
    time, at most ``tries`` times, until the set fits; only among the models with traffic (``rate >
    0``: an idle one would raise a busy one's SLO) and that can be served alone.
    """
    out = []
    hopeless = set()  # no SLO below slo * step**tries makes these servable even alone
    for d in demands:
        probe = replace(d, rate=1.0)
        if fits([probe], profiles, **fit_kwargs):
            out.append(d)
            continue
        slo = d.slo_ms
        for _ in range(tries):
            slo *= step
            if fits([replace(probe, slo_ms=slo)], profiles, **fit_kwargs):
                d = replace(d, slo_ms=slo)
                break
        else:
            hopeless.add(d.model)
        out.append(d)
    for _ in range(tries):
        # the models with traffic (an idle one, rate 0, is no demand) that can be served at all
        probes = [replace(d, rate=1.0) for d in out if d.rate > 0 and d.model not in hopeless]
        if len(probes) < 2 or fits(probes, profiles, **fit_kwargs):
            break
        left_out = {mp.model for mp in plan(probes, profiles, **fit_kwargs).models if mp.planned_rps <= 0}
        if not left_out:
            break  # every model planned (a bucket's rounding), though fits says no: nothing to raise
        out = [replace(d, slo_ms=d.slo_ms * step) if d.model in left_out else d for d in out]
    return out


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
    batch_overhead_ms: float = 0.0,
    min_sms: int = 0,
    remainder: str = "largest",
    model_overhead_ms: Mapping[str, float] | None = None,
) -> Schedule:
    """Plan one GPU for ``demands``: disjoint SM partitions, each a repeating cycle of slots.

    See the module docstring for the latency model and the algorithm. ``gpu_sms`` and
    ``granularity`` default to the profiles' GPU. ``cycle_ms`` fixes the cycle (partition periods
    are then ``cycle_ms / 2**i``) instead of searching for it. ``headroom`` plans capacity for
    ``rate * (1 + headroom)``. ``batch_overhead_ms`` is added to every slot: the time a batch holds
    its partition beyond its device time (the runtime's launch and turnaround); ``model_overhead_ms``
    gives a model its own (on the H200 bert_base's batches, which return 3-6 MB, held theirs 2.6-4.4
    ms, the others 0.6-1.6 ms; ``gpuloom.plan.slowdown.load_holds``). ``min_sms``: no
    partition smaller than this (on the H200, 8-SM partitions need a second carving for cuDNN and
    ran every partition of their layout slower; docs/reports/runtime.md, ninth session). Under
    overload, served fractions are weighted max-min fair to within ``fair_step`` (a fraction of
    demand). ``remainder``: which partition takes the SMs left under the granularity ("largest" or
    "smallest", module docstring step 4). ``eps`` is the knee tolerance recorded with the schedule
    (the planner minimizes SM-time, which stops paying past a model's knee by construction).

    Raises ``PlanError`` for unknown or repeated models and bad settings.
    """
    t0 = time.perf_counter()
    if not 0 < fair_step <= 0.5:
        raise PlanError(f"fair_step must be in (0, 0.5], found {fair_step}")
    if remainder not in REMAINDERS:
        raise PlanError(f"remainder must be one of {REMAINDERS} (the partition that takes the SMs left under the "
                        f"granularity), found {remainder!r}")
    pl, active, ladders = _setup(demands, profiles, gpu_sms, granularity, cycle_ms, headroom, batch_overhead_ms, min_sms,
                                 model_overhead_ms)
    if not active:
        return _build(pl, [], {}, ladders[0][0], eps, t0, {}, remainder)

    full = {d.model: 1.0 for d in active}
    found = pl.search(full, ladders)
    if found is not None:
        ladder, parts = found
        fracs = full
    else:
        fracs = _fair_share(pl, active, ladders, fair_step)
        found = pl.search(fracs, ladders)
        assert found is not None, f"fair share {fracs} must pack"
        fracs, (ladder, parts) = _polish(pl, active, ladders, fair_step, found)
    pl.grow(parts)
    return _build(pl, parts, fracs, ladder[0], eps, t0, {"periods_ms": [round(c, 4) for c in ladder]}, remainder)


def _fair_share(pl: _Planner, active: list[Demand], ladders: Sequence[Sequence[float]], step: float) -> dict[str, float]:
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
        if pl.feasible(at(hi), ladders):
            frozen.update({m: 1.0 for m in todo})
            break
        tol = step / (2.0 * max(w[m] for m in todo))  # binary search the common level
        while hi - lo > tol:
            mid = 0.5 * (lo + hi)
            if pl.feasible(at(mid), ladders):
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
            if not pl.feasible(trial, ladders):
                stuck.append(m)
        if not stuck and lo == 0.0 and len(todo) > 1:
            # each can rise alone but not all together (a min_sms near the GPU's size leaves room for
            # one partition): give one nothing and fill the others, rather than give every one nothing
            stuck = [_left_out(pl, cur, todo, w, ladders, step)]
        if not stuck:  # the packing is not perfectly monotone: freeze everyone rather than loop
            stuck = list(todo)
        for m in stuck:
            frozen[m] = cur[m]
        todo = [m for m in todo if m not in stuck]
    return frozen


def _left_out(
    pl: _Planner, cur: dict[str, float], todo: list[str], w: dict[str, float], ladders: Sequence[Sequence[float]],
    step: float,
) -> str:
    """The model of ``todo`` (all at 0, each able to rise a ``step`` alone, not all together) that
    :func:`_fair_share` gives nothing: the lowest weight, the last in order among equals, whose absence
    lets the others rise a ``step`` together; else simply the first of that order."""
    order = sorted(todo, key=lambda m: (w[m], -todo.index(m)))
    for m in order:
        trial = dict(cur)
        trial.update({n: min(1.0, cur[n] + step) for n in todo if n != m})
        if pl.feasible(trial, ladders):
            return m
    return order[0]


def _served(pl: _Planner, parts: list[_Part]) -> dict[str, float]:
    """Fraction of each model's (headroom-inflated) demand that a packing's slots can serve."""
    out = {}
    for p in parts:
        for name, b, k in p.members:
            out[name] = min(1.0, k * b * 1000.0 / p.c / pl.models[name].need_rps)
    return out


def _polish(
    pl: _Planner,
    active: list[Demand],
    ladders: Sequence[Sequence[float]],
    step: float,
    found: tuple[list[float], list[_Part]],
) -> tuple[dict[str, float], tuple[list[float], list[_Part]]]:
    """Make a fair packing checkably weighted max-min fair; the packing heuristic is not perfectly
    monotone, so progressive filling alone can stop short. Repeats, until neither applies:

    1. raise the floor: ask every served model for ``min(1, weight * (lowest weighted served
       fraction among short models + step))``; adopt if that packs;
    2. Pareto: raise one short model by ``step`` while everyone keeps what the current slots
       serve them (rounding up to batch buckets often leaves room); lowest weighted fraction first.

    Served fractions are what the adopted slots can serve, so each adoption raises the floor or
    one model by at least ``step`` and the loop ends. Models that cannot be served at all stay at 0.
    """
    w = {d.model: d.weight for d in active}
    served = _served(pl, found[1])
    fr = {d.model: served.get(d.model, 0.0) for d in active}
    alive = [m for m in fr if fr[m] > 0]

    def adopt(trial: dict[str, float]) -> bool:
        nonlocal found, fr
        got = pl.search(trial, ladders)
        if got is None:
            return False
        found = got
        served = _served(pl, got[1])
        fr = {n: served.get(n, 0.0) for n in fr}
        return True

    for _ in range(int(4 / step) * len(active) + 4):
        shorts = [m for m in alive if fr[m] < 1.0 - 1e-9]
        if not shorts:
            break
        level = min(fr[m] / w[m] for m in shorts) + step
        if adopt({n: (min(1.0, w[n] * level) if n in alive else 0.0) for n in fr}):
            continue
        for m in sorted(shorts, key=lambda m: (fr[m] / w[m], m)):
            trial = dict(fr)
            trial[m] = min(1.0, fr[m] + step)
            if adopt(trial):
                break
        else:
            break
    return fr, found


def _build(
    pl: _Planner, parts: list[_Part], fracs: dict[str, float], top: float, eps: float, t0: float, meta: dict,
    remainder: str = "largest",
) -> Schedule:
    """Lay the packed partitions out on SMs and in time, and summarize each model.

    Every period is ``top / j``; the schedule's cycle is the shortest ``top / g`` that all periods
    in use divide. A partition repeats its slot pattern ``cycle / period`` times, and every slot
    is listed.
    """
    # every period is top / j; the cycle is the shortest top / g that all of them divide
    g = 0
    for p in parts:
        g = math.gcd(g, max(1, round(top / p.c)))
    C = top / g if g else top
    parts = sorted(parts, key=lambda p: (-p.u, p.c, -p.used))
    sizes = [p.u * pl.g for p in parts]
    takes = 0 if remainder == "largest" else len(sizes) - 1  # parts are sorted largest first
    if parts and sum(p.u for p in parts) == pl.U and sizes[takes] >= MIN_SMS_WITH_REMAINDER:
        sizes[takes] += pl.rem
    partitions = []
    placed: dict[str, tuple[int, int, int, int, float, float]] = {}  # model -> (partition, sms, batch, k, L, period)
    offset = 0
    for i, (p, sms) in enumerate(zip(parts, sizes)):
        members = sorted(p.members, key=lambda mb: (pl.models[mb[0]].demand.slo_ms, mb[0]))
        pattern = []
        t = 0.0
        for name, b, k in members:
            L = pl.latency(name, b, sms)
            for _ in range(k):
                pattern.append((name, b, t, L))
                t += L
            placed[name] = (i, sms, b, k, L, p.c)
        reps = max(1, round(C / p.c))
        slots = tuple(
            Slot(model=name, batch=b, start_ms=r * p.c + t, duration_ms=L) for r in range(reps) for name, b, t, L in pattern
        )
        partitions.append(Partition(index=i, sm_offset=offset, sms=sms, slots=slots, period_ms=p.c))
        offset += sms
    models = []
    short = []
    for name, m in pl.models.items():
        d = m.demand
        if name in placed:
            i, sms, b, k, L, c = placed[name]
            planned = k * b * 1000.0 / c
            worst = c + k * L
        else:
            i, sms, b, k, L, c, planned, worst = -1, 0, 0, 0, 0.0, 0.0, 0.0, 0.0
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
                period_ms=c,
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
