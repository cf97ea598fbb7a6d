"""Re-planning online when the measured request rates drift from the ones a schedule was made for.

Two guards keep it from thrashing on noise:

* **hysteresis**: a model counts as drifting only when its measured rate differs from its planned
  rate by more than ``band`` (relative) for ``hold_s`` seconds in a row; back inside the band, its
  timer resets;
* **switch cost**: a new schedule needs new partitions and freshly captured CUDA graphs. While that
  happens (``switch_cost_s`` seconds) we charge the whole current goodput as lost; when the
  partitions keep their SM ranges, only the share of (model, batch, partition) graphs that are new
  (``switch_fraction``). A candidate plan
  is adopted only if the requests it serves *beyond* the current schedule over ``horizon_s`` exceed
  that cost. Only the drifting models' measured rates enter the candidate plan and the gain;
  the others keep their planned rates (their deviation is noise inside the band). Falling rates therefore never trigger a switch (the current plan still serves them);
  rising rates do once they outgrow the current plan's capacity.

**Measured slowdowns** (``check(..., slowdowns=...)``, from :mod:`gpuloom.plan.slowdown`): when a
model's batches run slower than its profile by more than ``slow_band`` beyond what the current plan
assumed (once every planned model's slowdown is known, or ``hold_s`` after the first), a plan made
with the slowed profiles at the planned rates replaces it, if it serves no fewer requests/s than
the current one keeps at the measured latencies (:func:`served_under`) for the models whose
guarantees those leave standing (:func:`broken_guarantees`: their slots fit, their latency bounds
hold). A broken model's share of the current plan is a promise the GPU does not keep, so a plan
made with the measurements may win while planning to serve less: on the H200's overloaded mix
(run 57) such a plan shed the rest and served 1.40x / 2.18x more on time. The measurements are
held against what the current plan was made with. The switch cost does not apply: the current
plan was made for latencies the GPU does not deliver. Waiting for a latency bound to break would be
too late for slowdowns alone: in simulation with the H200's measured slowdowns, bert_base kept
0.949 of its SLO at 6-model x0.9375 under a plan whose bound still held, and 0.999 under the plan
made with them.

**Measured holds** (``check(..., holds=...)``): the same for how long each model's batches hold
their partition beyond their device time (the plan's ``model_overhead_ms``; ``batch_overhead_ms``
where a model has none). A hold that moved by more than ``hold_band_ms`` from what the plan
assumed asks for a plan made with it, under the same rule. Why: a hold is the serving host's
(launch, copies, the completion's way back); on the H200 one machine's were 2-3x another's
(runs 57-60), so a file of holds measured elsewhere planned mix6 as overloaded on a faster host.

Both the estimator and the replanner take the clock as an argument (simulated or real seconds), so
the same objects run in the simulator and on the GPU.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gpuloom.profile.store import ProfileStore

from .planner import plan
from .schedule import Demand, Schedule
from .slowdown import slowed_store


class RateEstimator:
    """Requests/s per model over a sliding window of ``window_s`` seconds.

    Call ``observe(model, t)`` for every arrival (``t`` in seconds, non-decreasing per model) and
    ``rate(model, now)`` to read. Until ``window_s`` has passed since ``start_s`` the rate is the
    count divided by the time elapsed so far.
    """

    def __init__(self, window_s: float = 2.0, *, start_s: float = 0.0) -> None:
        if not window_s > 0:
            raise ValueError(f"RateEstimator: window_s must be > 0 seconds, found {window_s}")
        self.window_s = float(window_s)
        self.start_s = float(start_s)
        self._events: dict[str, deque[tuple[float, int]]] = {}
        self._counts: dict[str, int] = {}

    def observe(self, model: str, t: float, n: int = 1) -> None:
        q = self._events.setdefault(model, deque())
        q.append((t, n))
        self._counts[model] = self._counts.get(model, 0) + n

    def _trim(self, model: str, now: float) -> None:
        q = self._events.get(model)
        if not q:
            return
        horizon = now - self.window_s
        while q and q[0][0] <= horizon:
            _, n = q.popleft()
            self._counts[model] -= n

    def rate(self, model: str, now: float) -> float:
        """Requests/s of ``model`` over the window ending at ``now`` (0.0 if never seen)."""
        self._trim(model, now)
        span = min(self.window_s, now - self.start_s)
        if span <= 0:
            return 0.0
        return self._counts.get(model, 0) / span

    def onset_rate(self, model: str, now: float, min_span_s: float) -> float:
        """Requests/s of ``model`` since its first arrival in the window (over at least ``min_span_s``,
        the feeding interval), or :meth:`rate` where that is higher: for a model whose traffic has just
        come back the window's average is a fraction of it (an eighth, a quarter second into a 2 s
        window), and a plan made for that gives it too little (a review, sixty-fifth session)."""
        r = self.rate(model, now)  # (trims the window)
        q = self._events.get(model)
        if not q:
            return r
        return max(r, self._counts[model] / max(min_span_s, now - q[0][0]))

    def rates(self, now: float) -> dict[str, float]:
        return {m: self.rate(m, now) for m in self._events}


@dataclass(frozen=True)
class ReplanDecision:
    """What ``Replanner.check`` concluded at one instant."""

    replan: bool  # True: switch to ``schedule``
    reason: str  # human-readable why / why not
    schedule: Schedule | None = None  # the new schedule when ``replan``
    gain: float = 0.0  # requests the candidate serves beyond the current plan over the horizon
    cost: float = 0.0  # requests lost while switching (switch_cost_s x current goodput)


def _scaled_busy(partition, factors: Mapping[str, float], extra_ms: Mapping[str, float] | None = None) -> float:
    """ms of ``partition``'s slots in one cycle when each model's take ``factors[model]`` times as long,
    plus ``extra_ms[model]`` each (a hold longer than planned; negative: shorter)."""
    extra = extra_ms or {}
    return sum(max(0.0, s.duration_ms * factors.get(s.model, 1.0) + extra.get(s.model, 0.0)) for s in partition.slots)


def broken_guarantees(schedule: Schedule, factors: Mapping[str, float],
                      extra_ms: Mapping[str, float] | None = None) -> list[str]:
    """The models whose planned guarantee fails when each model's slots take ``factors[model]``
    times their planned time (1 where absent), plus ``extra_ms[model]`` each: their partition's slots
    no longer fit its period (the whole cycle's slots its cycle), or their latency bound (period +
    slots x latency) passes their SLO. A slot's planned batch overhead is scaled with it, which
    overstates the change slightly."""
    extra = extra_ms or {}
    broken: list[str] = []
    for p in schedule.partitions:  # the slots of a whole cycle fit the cycle iff each period's fit the period
        if _scaled_busy(p, factors, extra) > schedule.cycle_ms * (1 + 1e-9):
            broken += [m for m in p.models if m not in broken]
    for mp in schedule.models:
        if mp.sms and mp.model not in broken:
            worst = mp.period_ms + mp.slots_per_cycle * (mp.latency_ms * factors.get(mp.model, 1.0) + extra.get(mp.model, 0.0))
            if worst > mp.slo_ms * (1 + 1e-9):
                broken.append(mp.model)
    return broken


def served_under(schedule: Schedule, factors: Mapping[str, float], rates: Mapping[str, float],
                 extra_ms: Mapping[str, float] | None = None) -> float:
    """Requests/s ``schedule`` serves at ``rates`` when its slots take ``factors`` times longer (and
    ``extra_ms`` more each): a partition whose slots overrun its period serves its models that much
    less (planned batch overhead scaled too, as in :func:`broken_guarantees`)."""
    cap = {}
    for p in schedule.partitions:
        busy = _scaled_busy(p, factors, extra_ms)
        for m in p.models:
            cap[m] = min(1.0, schedule.cycle_ms / busy) if busy > 0 else 1.0
    return sum(min(r, schedule.model(m).planned_rps * cap.get(m, 1.0)) for m, r in rates.items()
               if any(mp.model == m for mp in schedule.models))


#: A plan made with measurements that break the current plan's guarantees may plan to serve less
#: than the current one (which cannot keep its promise), but not less than this share of it: on the
#: H200's overloaded mix the winning plan planned 0.82x (run 54's world, simulated; 1.40x more on
#: time on the GPU, run 57); a plan that gives up most of the load (in the extreme, no partition)
#: is no remedy for bounds that may break by a hair. Not tuned beyond that.
MIN_KEPT_SHARE = 0.5


class Replanner:
    """Keeps a schedule in step with measured rates, with hysteresis and a switch cost.

    ``demands`` give each model's SLO and weight (their rates are the initial plan's).
    ``check(now, rates)`` is called periodically by the policy (e.g. every 100 ms of its clock).
    A model's drift counts once it has lasted ``hold_s``, and no switch comes within ``cooldown_s``
    of the last, except for traffic to a model the schedule gives no slots (:meth:`_unserved_arriving`).
    """

    def __init__(
        self,
        demands: Sequence[Demand],
        profiles: ProfileStore,
        *,
        schedule: Schedule | None = None,
        band: float = 0.2,
        hold_s: float = 2.0,
        switch_cost_s: float = 0.5,
        horizon_s: float = 30.0,
        cooldown_s: float = 5.0,
        min_rate: float = 5.0,
        plan_kwargs: Mapping[str, Any] | None = None,
        slow_band: float = 0.05,
        slowdowns: Mapping[str, float] | None = None,
        switch_fraction: Callable[[Schedule], float | None] | None = None,
        hold_band_ms: float = 0.5,
    ) -> None:
        if not slow_band > 0:
            raise ValueError(f"Replanner: need slow_band > 0 (relative change of a measured slowdown), found {slow_band}")
        if not hold_band_ms > 0:
            raise ValueError(f"Replanner: need hold_band_ms > 0 (change of a measured hold, ms), found {hold_band_ms}")
        if not band > 0 or hold_s < 0 or switch_cost_s < 0 or not horizon_s > 0 or cooldown_s < 0 or not min_rate > 0:
            raise ValueError(
                "Replanner: need band > 0, hold_s >= 0, switch_cost_s >= 0, horizon_s > 0, cooldown_s >= 0, "
                f"min_rate > 0; found band={band}, hold_s={hold_s}, switch_cost_s={switch_cost_s}, "
                f"horizon_s={horizon_s}, cooldown_s={cooldown_s}, min_rate={min_rate}"
            )
        self.base = {d.model: d for d in demands}
        self.profiles = profiles
        self.plan_kwargs = dict(plan_kwargs or {})
        self.band, self.hold_s, self.switch_cost_s = band, hold_s, switch_cost_s
        self.horizon_s, self.cooldown_s, self.min_rate = horizon_s, cooldown_s, min_rate
        self.slow_band = slow_band
        self.hold_band_ms = float(hold_band_ms)
        # the policy's own switch cost of a candidate (0..1), or None for the partition geometry's: a
        # policy that runs some plans on the same shared lanes knows better what a switch rebuilds
        self._switch_override = switch_fraction
        # the slowdowns plans are made with (1 where absent): the current plan's, or newer measured ones
        # that a plan was not adopted for (it served less); revert() restores those of the plan before
        self.slowdowns: dict[str, float] = dict(slowdowns or {})
        # likewise the per-model holds (ms): plan_kwargs' model_overhead_ms, then newer measured ones
        self.holds: dict[str, float] = dict(self.plan_kwargs.pop("model_overhead_ms", None) or {})
        self.schedule = schedule if schedule is not None else plan(list(demands), self._store(), **self.plan_options())
        self.planned_rates = {d.model: d.rate for d in demands}
        self.slowdown_switches = 0  # of ``switches``, those for measured slowdowns
        self.slowdown_note = ""  # what the last look at moved slowdowns concluded
        self._slow_since: float | None = None  # when a slowdown first moved beyond slow_band (waiting for the rest)
        # the slowdowns and holds the current schedule was planned with (those above may be newer)
        self._planned_with: tuple[dict[str, float], dict[str, float]] = (dict(self.slowdowns), dict(self.holds))
        # what revert() restores: the schedule, rates, and what it was planned with, before the last switch
        self._before: tuple[Schedule, dict[str, float], tuple[dict[str, float], dict[str, float]]] | None = None
        self.switches = 0
        self.evaluations = 0  # candidate plans computed
        self.skipped = 0  # checks of drifting rates the current plan serves already (no candidate needed)
        self._since: dict[str, float] = {}
        self._last_switch = float("-inf")
        # models the current schedule serves none of that have had their one look without the hold
        # and the cooldown since it was adopted (:meth:`_unserved_arriving`)
        self._looked_unserved: set[str] = set()
        self._looked_before: set[str] = set()  # ... as it was before the last switch (revert() restores it)

    def drift(self, model: str, rate: float) -> float:
        """Relative distance of a measured rate from the planned one (rates below min_rate count as min_rate)."""
        planned = self.planned_rates[model]
        return abs(rate - planned) / max(planned, self.min_rate)

    def _unserved_arriving(self, rates: Mapping[str, float]) -> set[str]:
        """Models whose requests arrive (beyond the band) although the current schedule gives them no
        slots, not looked at yet since it was adopted: they are re-planned for at once, without the
        hold and the cooldown. A re-plan for measured rates leaves out a model that had no traffic;
        when its traffic came back, its requests fit no gap between the others' slots and were all
        dropped until the hold ran out (2.25 s at 300 requests/s, the sixty-fourth session's review).
        Once each: a model the planner leaves out for want of capacity waits the hold as before, so
        an overload does not plan again at every check (a plan takes ms of the runtime's thread)."""
        served = {mp.model for mp in self.schedule.models if mp.planned_rps > 0}
        return {m for m, r in rates.items()
                if r > 0 and m not in served and m not in self._looked_unserved and self.drift(m, r) > self.band}

    def served(self, schedule: Schedule, rates: Mapping[str, float]) -> float:
        """Requests/s ``schedule`` can serve at ``rates`` (capacity-capped)."""
        return sum(min(r, schedule.model(m).planned_rps) for m, r in rates.items() if m in self.base)

    def switch_fraction(self, candidate: Schedule) -> float:
        """How much of a full switch adopting ``candidate`` costs (0..1).

        Graphs are captured per (model, batch, partition). If the partitions stay the same SM
        ranges, only the (model, batch) pairs new to their partition need capturing: the cost is
        their share of the candidate's pairs. New partitions need everything captured anew: 1.0.
        """
        if self._switch_override is not None:
            given = self._switch_override(candidate)
            if given is not None:
                return min(1.0, max(0.0, float(given)))
        old_parts = {(p.sm_offset, p.sms) for p in self.schedule.partitions}
        new_parts = {(p.sm_offset, p.sms) for p in candidate.partitions}
        if not new_parts <= old_parts:
            return 1.0
        have = {(s.model, s.batch, p.sm_offset) for p in self.schedule.partitions for s in p.slots}
        need = {(s.model, s.batch, p.sm_offset) for p in candidate.partitions for s in p.slots}
        return len(need - have) / len(need) if need else 0.0

    def schedule_models(self) -> list[str]:
        """The models with slots in the current schedule."""
        return [mp.model for mp in self.schedule.models if mp.sms]

    def _store(self) -> ProfileStore:
        """The profiles plans are made from: slowed by the measured slowdowns known so far."""
        return slowed_store(self.profiles, self.slowdowns) if self.slowdowns else self.profiles

    def plan_options(self) -> dict[str, Any]:
        """The planner's options: the given ones, with the per-model holds known so far."""
        return {**self.plan_kwargs, "model_overhead_ms": dict(self.holds) or None}

    def assumed_hold(self, model: str) -> float:
        """The hold (ms) plans are made with for ``model``: its own, else ``batch_overhead_ms``."""
        return self.holds.get(model, float(self.plan_kwargs.get("batch_overhead_ms", 0.0)))

    def _against_plan(self, slowdowns: Mapping[str, float],
                      holds: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """The current schedule as the GPU runs it: each measured slowdown relative to, and each
        measured hold's ms beyond, what the schedule was planned with (not measurements remembered
        since, which a plan was not adopted for)."""
        planned_slow, planned_holds = self._planned_with
        base_hold = float(self.plan_kwargs.get("batch_overhead_ms", 0.0))
        return ({m: f / planned_slow.get(m, 1.0) for m, f in slowdowns.items()},
                {m: h - planned_holds.get(m, base_hold) for m, h in holds.items()})

    def _check_measured(self, now: float, slowdowns: Mapping[str, float] | None,
                        holds: Mapping[str, float] | None) -> ReplanDecision | None:
        """The switch to a plan made with the measured slowdowns and holds (None: not measured; empty:
        none known yet), when one moved beyond its band (``slow_band``, ``hold_band_ms``) and that plan
        serves no less than what the current one keeps at them; else None (``slowdown_note`` says why)."""
        slowdowns = {m: f for m, f in (slowdowns or {}).items() if m in self.base} if slowdowns is not None else None
        holds = {m: h for m, h in (holds or {}).items() if m in self.base} if holds is not None else None
        moved = {m: f for m, f in (slowdowns or {}).items() if abs(f / self.slowdowns.get(m, 1.0) - 1.0) > self.slow_band}
        moved_holds = {m: h for m, h in (holds or {}).items() if abs(h - self.assumed_hold(m)) > self.hold_band_ms}
        if not moved and not moved_holds:
            self._slow_since = None
            return None
        if self._slow_since is None:
            self._slow_since = now
        # one plan for all the measurements: wait (up to hold_s) for the models not measured yet
        waiting = [m for m in self.schedule_models()
                   if (slowdowns is not None and m not in slowdowns) or (holds is not None and m not in holds)]
        if waiting and now - self._slow_since < self.hold_s:
            return None
        if now - self._last_switch < self.cooldown_s:
            return None  # looked at again after the cooldown
        self._slow_since = None
        relative, extra = self._against_plan(slowdowns or {}, holds or {})
        broken = broken_guarantees(self.schedule, relative, extra)
        # the next plan, whichever, is made with them
        self.slowdowns = {**self.slowdowns, **moved}
        self.holds = {**self.holds, **moved_holds}
        said = ", ".join([f"{m} {f:.2f}x" for m, f in sorted(moved.items())]
                         + [f"{m} holds {h:.2f} ms" for m, h in sorted(moved_holds.items())])
        rates = dict(self.planned_rates)
        self.evaluations += 1
        candidate = plan([dataclasses.replace(self.base[m], rate=r) for m, r in rates.items()], self._store(),
                         **self.plan_options())
        now_served = served_under(self.schedule, relative, rates, extra)
        # where the measurements break a model's guarantee, what the current plan "serves" of it is a
        # promise the GPU does not keep: only the models whose guarantees stand count against the new plan
        kept = served_under(self.schedule, relative, {m: r for m, r in rates.items() if m not in broken}, extra)
        # ... but a plan that gives up most of the load is not the remedy for bounds that broke
        # (every model's may break by a hair): a floor of MIN_KEPT_SHARE of what the current one serves
        floor = max(kept, MIN_KEPT_SHARE * now_served)
        then_served = self.served(candidate, rates)
        if then_served < floor:
            why = (f"the current one keeps its guarantees for {kept:.0f} of them" if floor == kept and broken
                   else f"it would give up over {1 - MIN_KEPT_SHARE:.0%} of the {now_served:.0f} the current one serves"
                   if broken else "the current one's guarantees still hold")
            self.slowdown_note = (f"measured ({said}): a plan with them serves less ({then_served:.0f} < "
                                  f"{floor:.0f} requests/s); kept the current one: {why}")
            return None
        self._switch_to(candidate, now, self.planned_rates)
        self.slowdown_switches += 1
        self.slowdown_note = (f"measured ({said}): re-planned with them ({then_served:.0f} requests/s planned; the "
                              f"old plan's {now_served:.0f}, "
                              + (f"its bound broken for {broken})" if broken else "its guarantees standing)"))
        return ReplanDecision(True, self.slowdown_note, candidate, (then_served - now_served) * self.horizon_s, 0.0)

    def _switch_to(self, candidate: Schedule, now: float, rates: Mapping[str, float]) -> None:
        """Make ``candidate`` (planned for ``rates`` with the current slowdowns and holds) current;
        :meth:`revert` can take it back."""
        self._before = (self.schedule, self.planned_rates, self._planned_with)
        self._looked_before = set(self._looked_unserved)
        self._planned_with = (dict(self.slowdowns), dict(self.holds))
        self.schedule = candidate
        self.planned_rates = dict(rates)
        self._since.clear()
        self._looked_unserved.clear()
        self._last_switch = now
        self.switches += 1

    def revert(self) -> None:
        """The last switch's schedule could not be set up: the one before it runs again, with the rates
        slowdowns and holds it was planned for, so the drift that asked for the switch is seen again
        (after the cooldown) instead of being taken for done."""
        if self._before is not None:
            self.schedule, self.planned_rates, self._planned_with = self._before[0], dict(self._before[1]), self._before[2]
            self.slowdowns, self.holds = dict(self._planned_with[0]), dict(self._planned_with[1])
            self._before = None
            self._since.clear()
            # the models looked at without the hold stay looked at: a plan for them that could not be
            # set up is proposed again after the cooldown, not at the next check (a review: a build
            # that failed was retried every 250 ms, each a graph capture beside serving on a GPU)
            self._looked_unserved = self._looked_before

    def check(self, now: float, rates: Mapping[str, float],
              slowdowns: Mapping[str, float] | None = None,
              holds: Mapping[str, float] | None = None,
              onset_rates: Mapping[str, float] | None = None) -> ReplanDecision:
        """Decide at time ``now`` (s) whether to switch plans for the measured ``rates`` (requests/s)
        and, when given, each model's measured ``slowdowns`` (device time over profile) and ``holds``
        (ms a batch holds its partition beyond its device time). ``onset_rates``
        (:meth:`RateEstimator.onset_rate`): what a model the schedule serves none of is planned for when
        its traffic comes back, where higher than its rate."""
        if slowdowns is not None or holds is not None:
            d = self._check_measured(now, slowdowns, holds)
            if d is not None:
                return d
        rates = {m: float(rates.get(m, 0.0)) for m in self.base}
        drifting = []
        unserved = self._unserved_arriving(rates)
        for m, r in rates.items():
            if self.drift(m, r) > self.band:
                since = self._since.setdefault(m, now)
                if now - since >= self.hold_s or m in unserved:
                    drifting.append(m)
            else:
                self._since.pop(m, None)
        if not drifting:
            return ReplanDecision(False, "rates within the hysteresis band")
        if now - self._last_switch < self.cooldown_s and not unserved:
            return ReplanDecision(False, f"cooling down after the switch at {self._last_switch:.1f} s")
        self._looked_unserved |= unserved
        if onset_rates:
            rates = {m: max(r, onset_rates.get(m, 0.0)) if m in unserved else r for m, r in rates.items()}
        # models inside the band keep their planned rate: their deviation is noise, not a trend
        rates = {m: (r if m in drifting else self.planned_rates[m]) for m, r in rates.items()}
        # the current schedule at the latencies measured so far (none remembered: at its planned rates)
        relative, extra = self._against_plan(self.slowdowns, self.holds)
        now_served = served_under(self.schedule, relative, rates, extra)
        if now_served >= sum(rates.values()) * (1 - 1e-9):
            # the current schedule serves every rate already, so no candidate can gain (gain <= 0 <=
            # cost): the same answer as evaluating one, without computing a plan. Serving, that plan
            # took 4-5 ms of the runtime's thread every hold_s while a model ran below its planned
            # rate, a stall on every request in flight (docs/reports/serving.md)
            self._since = {m: now for m in drifting}
            self.skipped += 1
            return ReplanDecision(False, f"{drifting} drifted but the current plan serves every rate already")
        self.evaluations += 1
        candidate = plan(
            [dataclasses.replace(self.base[m], rate=r) for m, r in rates.items()], self._store(), **self.plan_options()
        )
        gain = (self.served(candidate, rates) - now_served) * self.horizon_s
        cost = self.switch_cost_s * self.switch_fraction(candidate) * now_served
        self._since = {m: now for m in drifting}  # wait another hold_s before re-evaluating
        if gain <= cost:
            return ReplanDecision(
                False, f"{drifting} drifted but a new plan gains {gain:.0f} requests <= switch cost {cost:.0f}", None, gain, cost
            )
        self._switch_to(candidate, now, rates)
        return ReplanDecision(True, f"{drifting} drifted: +{gain:.0f} requests over {self.horizon_s:g} s > cost {cost:.0f}", candidate, gain, cost)
