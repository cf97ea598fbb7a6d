"""Admission at the rate a model delivers on time, while it misses its SLO (``dstack:adapt=true``).

The plan's admitted rates (``Policy.admit_rps``) assume the host keeps up. On the H200 it did not on
the overloaded mix at x0.5 (run 54): the plan served every demand, so nothing was shed, but one
interpreter launched 459 of the plan's ~550 batches/s and half the requests were dropped or late.
Each of those cost the host a queue entry, a wake-up and an answer, and made the others later.

:class:`DeliveryCap` watches what each model's requests became over each window of ``window_ms``:
on time, or missed (served late, or dropped at their deadline). Rules, per model and window, judged
only on windows with at least ``min_outcomes`` outcomes:

* **Cut.** More than ``trigger`` missed: its admitted rate is capped at the rate it delivered on
  time in that window (the rest would have missed too), at most halving an existing cap per window,
  and never under ``floor`` of its demand nor :data:`MIN_CAP_RPS`.
* **Judge the cut.** Not every miss is the host's. A model whose batches are too slow for its SLO
  at some arrivals misses as large a share at any rate (in the simulated overloaded mix at x0.5,
  mobilenet_v2, 10 ms SLO, missed 30% uncapped and capped alike), and cutting it only sheds
  requests it would have served. So a cut holds for one judged window (which still resolves
  requests admitted before it), and in the next, a model still missing more than ``trigger`` and
  more than ``keep`` of the share it missed when cut has its cap removed, and is not cut again for
  ``block_ms``.
* **Raise.** At most ``recover`` missed: the cap rises by ``raise_factor``; at most ``trigger``:
  by ``creep``; each time by at least ``floor`` of its demand, so a cap near zero recovers too. A
  cap at or above the demand goes. A capped model with too few outcomes to judge is raised as well
  when few requests arrived (little traffic is no reason to refuse); when many arrived, its cap is
  what keeps the outcomes few, and its counts carry over to the next windows until they suffice
  (for up to :data:`CARRY_MS`; then it is raised all the same).

Caps survive a re-plan (the host's capacity did not change); the window's counts and a cut's
pending judgement do not (:meth:`restart`): a layout switch drains the GPU and its misses say
nothing about the host. Pure Python; the runtime feeds it through ``Policy.on_outcomes``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

#: the lowest cap, requests/s: a cap that reached zero could never learn it was wrong
MIN_CAP_RPS = 1.0
#: judged windows a cut waits before it is judged: the first still resolves requests admitted before it
JUDGE_AFTER = 1
#: longest a capped model's counts carry over for want of outcomes (ms); then it is raised as if idle
CARRY_MS = 1000.0


class DeliveryCap:
    """Per-model caps on the admitted rate, from on-time and missed outcomes (module docstring)."""

    def __init__(
        self,
        models: Iterable[str],
        window_ms: float = 250.0,
        trigger: float = 0.2,
        recover: float = 0.05,
        raise_factor: float = 1.25,
        creep: float = 1.05,
        floor: float = 0.1,
        min_outcomes: int = 20,
        keep: float = 2.0 / 3.0,
        block_ms: float = 2000.0,
    ) -> None:
        if (not window_ms > 0 or not 0 <= recover < trigger < 1 or not raise_factor >= creep > 1
                or not 0 < floor <= 1 or not 0 < keep <= 1 or not block_ms >= 0 or min_outcomes < 1):
            raise ValueError(
                f"DeliveryCap: need window_ms > 0, 0 <= recover < trigger < 1, raise_factor >= creep > 1, "
                f"0 < floor <= 1, 0 < keep <= 1, block_ms >= 0 and min_outcomes >= 1, found {window_ms}, {recover}, "
                f"{trigger}, {raise_factor}, {creep}, {floor}, {keep}, {block_ms}, {min_outcomes}")
        self.window_ms = float(window_ms)
        self.trigger, self.recover = float(trigger), float(recover)
        self.raise_factor, self.creep, self.floor = float(raise_factor), float(creep), float(floor)
        self.min_outcomes, self.keep, self.block_ms = int(min_outcomes), float(keep), float(block_ms)
        self._demand = {m: 0 for m in models}  # requests that arrived (admitted or refused) this window
        self._on_time = dict.fromkeys(self._demand, 0)
        self._missed = dict.fromkeys(self._demand, 0)
        # model -> (the share it missed when last cut, judged windows to hold before judging the cut)
        self._judge: dict[str, tuple[float, int]] = {}
        self._carried: dict[str, float] = {}  # model -> ms of counts carried over (a capped model's few outcomes)
        self._blocked: dict[str, float] = {}  # model -> until when it is not cut again (ms)
        self.caps: dict[str, float] = {}  # requests/s; a model without a cap is admitted as the plan says
        self._since = 0.0  # the window's start (ms)
        self.cuts = 0  # windows in which some model's cap was set or lowered (reported)
        self.undone = 0  # cuts undone because they did not pay (reported)

    def arrived(self, model: str, n: int = 1) -> None:
        if model in self._demand:
            self._demand[model] += n

    def outcome(self, model: str, on_time: int, missed: int) -> None:
        if model in self._on_time:
            self._on_time[model] += on_time
            self._missed[model] += missed

    def due(self, now_ms: float) -> bool:
        return now_ms - self._since >= self.window_ms

    def restart(self, now_ms: float) -> None:
        """Forget the window so far and any cut's pending judgement; keep the caps."""
        self._since = now_ms
        self._judge.clear()
        self._carried.clear()
        for counts in (self._demand, self._on_time, self._missed):
            for m in counts:
                counts[m] = 0

    def update(self, now_ms: float) -> bool:
        """Close the window ending at ``now_ms``: adjust the caps; True when they changed."""
        dt_ms = now_ms - self._since
        if dt_ms <= 0:
            return False
        self._since = now_ms
        changed = cut = False
        for m, demand in self._demand.items():
            on_time, missed = self._on_time[m], self._missed[m]
            resolved = on_time + missed
            cap = self.caps.get(m)
            span_s = (self._carried.pop(m, 0.0) + dt_ms) / 1000.0
            if (resolved < self.min_outcomes and cap is not None and demand >= self.min_outcomes
                    and span_s * 1000.0 < CARRY_MS):
                # the cap itself keeps the outcomes few while requests keep coming: carry the counts
                # over until there are enough to judge it (for up to CARRY_MS), rather than raise it blind
                self._carried[m] = span_s * 1000.0
                continue
            self._demand[m] = self._on_time[m] = self._missed[m] = 0
            demand_rps = demand / span_s
            if resolved < self.min_outcomes:  # too few to judge, and little traffic: no reason to refuse it
                if cap is not None:
                    changed |= self._raise(m, cap, self.raise_factor, demand_rps)
                continue
            share = missed / resolved
            judge = self._judge.get(m)
            if judge is not None and cap is not None and judge[1] > 0:
                # the first judged window after a cut still resolves requests admitted before it: hold
                self._judge[m] = (judge[0], judge[1] - 1)
                continue
            self._judge.pop(m, None)
            if judge is not None and cap is not None and share > self.trigger and share > self.keep * judge[0]:
                del self.caps[m]  # the cut did not pay: its misses are not the load's
                self._blocked[m] = now_ms + self.block_ms
                self.undone += 1
                changed = True
            elif share > self.trigger:
                if now_ms < self._blocked.get(m, 0.0):
                    continue
                new = max(on_time / span_s, self.floor * demand_rps, MIN_CAP_RPS)
                if cap is not None:
                    new = min(cap, max(new, cap / 2.0))  # at most halved per window: one bad window is not a trend
                if cap is None or new < cap:
                    self.caps[m] = new
                    self._judge[m] = (share, JUDGE_AFTER)
                    changed = cut = True
            elif cap is not None:
                changed |= self._raise(m, cap, self.raise_factor if share <= self.recover else self.creep, demand_rps)
        self.cuts += cut
        return changed

    def _raise(self, m: str, cap: float, factor: float, demand_rps: float) -> bool:
        new = max(cap * factor, cap + self.floor * demand_rps)
        if new >= demand_rps:
            del self.caps[m]  # it may take what arrives: no cap (and no cut left to judge)
            self._judge.pop(m, None)
        else:
            self.caps[m] = new
        return True

    def admit(self, planned: Mapping[str, float]) -> dict[str, float]:
        """The admitted rates: the plan's (``planned``, models it serves short), each lowered to its cap."""
        out = dict(planned)
        for m, cap in self.caps.items():
            out[m] = min(cap, out.get(m, cap))
        return out
