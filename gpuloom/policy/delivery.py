"""Admission at the rate a model delivers on time, while it misses its SLO (``dstack:adapt=true``).

The plan's admitted rates (``Policy.admit_rps``) assume the host keeps up. On the H200 it did not on
the overloaded mix at x0.5 (run 54): the plan served every demand, so nothing was shed, but one
interpreter launched 458 of the plan's ~550 batches/s and half the requests were dropped or late.
Each of those cost the host a queue entry, a wake-up and an answer, and made the others later.

:class:`DeliveryCap` watches what each model's requests became over each window of ``window_ms``:
on time, or missed (served late, or dropped at their deadline). Where more than ``trigger`` of them
missed, the model's admitted rate is capped at the rate it delivered on time in that window (no
lower than half the old cap, nor than ``floor`` of its demand): the rest would have missed too. Where
at most ``recover`` missed, the cap rises by ``raise_factor`` a window, and goes once it reaches
the model's demand. Multiplicative decrease, multiplicative increase, a dead band between: the cap
follows the host's capacity down within a window and probes back up within a second or two.

Not every miss is the host's. A model whose batches are too slow for its SLO at some arrivals (on
the simulated overloaded mix at x0.5, mobilenet_v2 missed 30% with a 10 ms SLO) misses as much at
any rate, and each cut would only shed requests it would have served. So a cut must pay: where the
window after it delivered less on time than the model usually did uncapped (by more than
``tolerance``), the cap goes and the model is not cut again for ``block_ms``.

Pure Python; the runtime feeds it through ``Policy.on_outcomes``.
"""

from __future__ import annotations

from typing import Iterable, Mapping


#: weight of the newest uncapped window in a model's usual on-time rate (what a cut must keep)
USUAL_WEIGHT = 0.3


class DeliveryCap:
    """Per-model caps on the admitted rate, from on-time and missed outcomes (module docstring)."""

    def __init__(
        self,
        models: Iterable[str],
        window_ms: float = 250.0,
        trigger: float = 0.2,
        recover: float = 0.05,
        raise_factor: float = 1.25,
        floor: float = 0.1,
        min_outcomes: int = 20,
        tolerance: float = 0.1,
        block_ms: float = 2000.0,
    ) -> None:
        if not window_ms > 0 or not 0 <= recover < trigger < 1 or not raise_factor > 1 or not 0 < floor <= 1:
            raise ValueError(f"DeliveryCap: need window_ms > 0, 0 <= recover < trigger < 1, raise_factor > 1 and "
                             f"0 < floor <= 1, found {window_ms}, {recover}, {trigger}, {raise_factor}, {floor}")
        self.window_ms = float(window_ms)
        self.trigger, self.recover = float(trigger), float(recover)
        self.raise_factor, self.floor = float(raise_factor), float(floor)
        self.min_outcomes = int(min_outcomes)
        self.tolerance, self.block_ms = float(tolerance), float(block_ms)
        self._cut_from: dict[str, float] = {}  # model -> its usual on-time rate when it was last cut
        self._usual: dict[str, float] = {}  # model -> on-time rate, averaged over its uncapped windows
        self._blocked: dict[str, float] = {}  # model -> until when a cut is not tried again (ms)
        self._demand = {m: 0 for m in models}  # requests that arrived (admitted or refused) this window
        self._on_time = dict.fromkeys(self._demand, 0)
        self._missed = dict.fromkeys(self._demand, 0)
        self.caps: dict[str, float] = {}  # requests/s; a model without a cap is admitted as the plan says
        self._since = 0.0  # the window's start (ms)
        self.cuts = 0  # windows in which some model's cap was set or lowered (reported)

    def arrived(self, model: str, n: int = 1) -> None:
        if model in self._demand:
            self._demand[model] += n

    def outcome(self, model: str, on_time: int, missed: int) -> None:
        if model in self._on_time:
            self._on_time[model] += on_time
            self._missed[model] += missed

    def due(self, now_ms: float) -> bool:
        return now_ms - self._since >= self.window_ms

    def update(self, now_ms: float) -> bool:
        """Close the window ending at ``now_ms``: adjust the caps; True when they changed."""
        dt_s = (now_ms - self._since) / 1000.0
        self._since = now_ms
        if dt_s <= 0:
            return False
        changed = cut = False
        for m, demand in self._demand.items():
            on_time, missed = self._on_time[m], self._missed[m]
            self._demand[m] = self._on_time[m] = self._missed[m] = 0
            resolved = on_time + missed
            cap = self.caps.get(m)
            demand_rps = demand / dt_s
            delivered = on_time / dt_s
            if cap is None:
                u = self._usual.get(m)
                self._usual[m] = delivered if u is None else u + USUAL_WEIGHT * (delivered - u)
            before = self._cut_from.pop(m, None)
            if before is not None and delivered < (1.0 - self.tolerance) * before:
                del self.caps[m]  # the cut did not pay: the misses were not the load's
                self._blocked[m] = now_ms + self.block_ms
                changed = True
                continue
            if (resolved >= self.min_outcomes and missed > self.trigger * resolved
                    and now_ms >= self._blocked.get(m, 0.0)):
                new = max(delivered, self.floor * demand_rps)
                if cap is not None:
                    new = min(cap, max(new, cap / 2.0))  # at most halved per window: one bad window is not a trend
                if cap is None or new < cap:
                    self.caps[m] = new
                    self._cut_from[m] = self._usual.get(m, delivered)
                    changed = cut = True
            elif cap is not None and missed <= self.recover * max(resolved, 1):
                new = cap * self.raise_factor
                if new >= demand_rps:
                    del self.caps[m]  # it delivers what arrives: no cap
                else:
                    self.caps[m] = new
                changed = True
        self.cuts += cut
        return changed

    def admit(self, planned: Mapping[str, float]) -> dict[str, float]:
        """The admitted rates: the plan's (``planned``, models it serves short), each lowered to its cap."""
        out = dict(planned)
        for m, cap in self.caps.items():
            out[m] = min(cap, out.get(m, cap))
        return out
