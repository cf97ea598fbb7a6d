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

Both the estimator and the replanner take the clock as an argument (simulated or real seconds), so
the same objects run in the simulator and on the GPU.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpuloom.profile.store import ProfileStore

from .planner import plan
from .schedule import Demand, Schedule


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


class Replanner:
    """Keeps a schedule in step with measured rates, with hysteresis and a switch cost.

    ``demands`` give each model's SLO and weight (their rates are the initial plan's).
    ``check(now, rates)`` is called periodically by the policy (e.g. every 100 ms of its clock).
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
    ) -> None:
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
        self.schedule = schedule if schedule is not None else plan(list(demands), profiles, **self.plan_kwargs)
        self.planned_rates = {d.model: d.rate for d in demands}
        self.switches = 0
        self.evaluations = 0  # candidate plans computed
        self.skipped = 0  # checks of drifting rates the current plan serves already (no candidate needed)
        self._since: dict[str, float] = {}
        self._last_switch = float("-inf")

    def drift(self, model: str, rate: float) -> float:
        """Relative distance of a measured rate from the planned one (rates below min_rate count as min_rate)."""
        planned = self.planned_rates[model]
        return abs(rate - planned) / max(planned, self.min_rate)

    def served(self, schedule: Schedule, rates: Mapping[str, float]) -> float:
        """Requests/s ``schedule`` can serve at ``rates`` (capacity-capped)."""
        return sum(min(r, schedule.model(m).planned_rps) for m, r in rates.items() if m in self.base)

    def switch_fraction(self, candidate: Schedule) -> float:
        """How much of a full switch adopting ``candidate`` costs (0..1).

        Graphs are captured per (model, batch, partition). If the partitions stay the same SM
        ranges, only the (model, batch) pairs new to their partition need capturing: the cost is
        their share of the candidate's pairs. New partitions need everything captured anew: 1.0.
        """
        old_parts = {(p.sm_offset, p.sms) for p in self.schedule.partitions}
        new_parts = {(p.sm_offset, p.sms) for p in candidate.partitions}
        if not new_parts <= old_parts:
            return 1.0
        have = {(s.model, s.batch, p.sm_offset) for p in self.schedule.partitions for s in p.slots}
        need = {(s.model, s.batch, p.sm_offset) for p in candidate.partitions for s in p.slots}
        return len(need - have) / len(need) if need else 0.0

    def check(self, now: float, rates: Mapping[str, float]) -> ReplanDecision:
        """Decide at time ``now`` (s) whether to switch plans for the measured ``rates`` (requests/s)."""
        rates = {m: float(rates.get(m, 0.0)) for m in self.base}
        drifting = []
        for m, r in rates.items():
            if self.drift(m, r) > self.band:
                since = self._since.setdefault(m, now)
                if now - since >= self.hold_s:
                    drifting.append(m)
            else:
                self._since.pop(m, None)
        if not drifting:
            return ReplanDecision(False, "rates within the hysteresis band")
        if now - self._last_switch < self.cooldown_s:
            return ReplanDecision(False, f"cooling down after the switch at {self._last_switch:.1f} s")
        # models inside the band keep their planned rate: their deviation is noise, not a trend
        rates = {m: (r if m in drifting else self.planned_rates[m]) for m, r in rates.items()}
        if all(r <= self.schedule.model(m).planned_rps for m, r in rates.items()):
            # the current schedule serves every rate already, so no candidate can gain (gain <= 0 <=
            # cost): the same answer as evaluating one, without computing a plan. Serving, that plan
            # took 4-5 ms of the runtime's thread every hold_s while a model ran below its planned
            # rate, a stall on every request in flight (docs/reports/serving.md)
            self._since = {m: now for m in drifting}
            self.skipped += 1
            return ReplanDecision(False, f"{drifting} drifted but the current plan serves every rate already")
        self.evaluations += 1
        candidate = plan(
            [dataclasses.replace(self.base[m], rate=r) for m, r in rates.items()], self.profiles, **self.plan_kwargs
        )
        now_served = self.served(self.schedule, rates)
        gain = (self.served(candidate, rates) - now_served) * self.horizon_s
        cost = self.switch_cost_s * self.switch_fraction(candidate) * now_served
        self._since = {m: now for m in drifting}  # wait another hold_s before re-evaluating
        if gain <= cost:
            return ReplanDecision(
                False, f"{drifting} drifted but a new plan gains {gain:.0f} requests <= switch cost {cost:.0f}", None, gain, cost
            )
        self.schedule = candidate
        self.planned_rates = dict(rates)
        self._since.clear()
        self._last_switch = now
        self.switches += 1
        return ReplanDecision(True, f"{drifting} drifted: +{gain:.0f} requests over {self.horizon_s:g} s > cost {cost:.0f}", candidate, gain, cost)
