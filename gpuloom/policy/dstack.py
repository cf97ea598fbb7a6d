"""``dstack``: run the planner's space-time schedule, fill idle slots, re-plan on drift.

Follows Dhakal et al., "D-STACK: High Throughput DNN Inference by Effective Multiplexing and
Spatio-Temporal Scheduling of GPUs" (IEEE TCC 2024): each model gets a disjoint SM partition sized
where it stops speeding up (its knee) and a batch that fits its SLO; models that share a partition
take turns in a repeating cycle (:func:`gpuloom.plan.plan` makes the :class:`~gpuloom.plan.Schedule`).

At run time, when a partition is free at phase ``phi`` of its cycle (the cycle starts when the
layout is ready):

1. **slot owner first**: the model whose slot contains ``phi`` runs up to its planned batch; no
   other model may take the partition while the owner has requests queued;
2. **work-conserving fill**: otherwise (the owner has nothing queued, or ``phi`` falls in a gap)
   any model with queued work may run -- earliest deadline first, on its home partitions first -- as
   long as its batch ends before the next slot of *another* model in this partition begins (so no
   other model's planned slot is delayed) and before its oldest request's deadline. The batch is the
   largest bucket up to the model's planned batch that fits both; under a backlog, requests too close
   to their deadline for that batch are passed over for younger ones (not dropped);
3. nothing fits: try again at the next arrival or completion, and at the start of the next slot of a
   waiting model on a free partition.

Its queues are in deadline order (``deadline_queues``): "oldest request" below means a queue's head,
its most urgent request, which is its oldest while every request has the model's SLO (a client's
own timeout can put a younger one first).

With the runtime's launch-ahead (``lookahead_ms``), a partition running one batch is offered again
shortly before that batch ends (``on_free``). ``ahead_full=True`` takes such an offer only for a
batch of the model's planned size (or the largest that fits before another model's slot there); a
smaller one goes to another free partition or waits for the running batch to end, as without
launch-ahead. Launch-ahead hides the partition's turnaround (0.4-0.9 ms a batch on the H200) but,
taking whatever is queued early, made 20-30% more, smaller batches (``docs/reports/runtime.md``,
fifth session); under a backlog a full batch is there anyway, so nothing is lost waiting for it.

**Growing batches under a backlog** (``grow=True``). The planned batch is what a model's rate
needs; after a delay (a host stall, a burst) its queue holds more, and batches of the planned size
catch up slowly where every batch also costs the host a fixed turnaround. With ``grow`` a batch may
take more than the planned batch from a backlog, up to the largest profiled bucket, when every
request in it still meets its deadline and it ends before another model's next slot on the
partition: fewer, fuller batches, for as long as the backlog lasts.

**Waiting to fill a batch** (``fill_wait=F``, a fraction of the SLO). Work-conserving dispatch
launches whatever is queued the moment a partition is free, so at a moderate load most batches are
smaller than planned; each costs the host the same turnaround, and on light3 (three small models,
5-10 ms SLOs) dstack launched 1.3x triton's batches and ran its interpreter at 1.02-1.05 core-s per
s (runs 41, 44). With ``fill_wait`` a batch smaller than the full one (planned, or what fits before
another model's slot) waits, like Triton's ``max_queue_delay``, until its oldest request has waited
``F`` x its SLO, or the full batch is queued, and only while the full batch would still end within
the oldest request's deadline.

**Shared lanes** (``lanes="shared"``; the default, ``lanes="auto"``, picks them per plan). On
light3 the partitions idle through each batch's host turnaround (0.45-0.65 ms a batch against 0.6-2 ms of device time, run 46), where
Triton's streams over the whole GPU fill one lane's gap with another's kernels. With ``lanes="shared"``
the plan is made as usual but every model runs on a stream of its own over the whole GPU, deciding
with the latencies of the partition it was planned on (an upper bound: on the H200 light3's batches
ran faster shared than on their 40-52 SM partitions). The bound gives way when every lane is free and
no other model's request waits: a request whose deadline the planned share cannot meet runs alone at the
whole GPU's latencies, and only what cannot make its deadline even so is dropped (a client's short
deadline was dropped on an idle GPU before, sixty-fifth session); while the GPU is busy such a request
is passed over for younger ones of its model.

``lanes="auto"`` picks per plan (:func:`turnaround_share`): shared lanes where the planned batches
would leave the partitions idle through their turnarounds for more than
:data:`AUTO_SHARED_ABOVE` of the GPU's SM-time, partitions elsewhere. With the H200's 0.55 ms
turnaround, light3's plans come to 0.16-0.17 at x4-x8 (shared lanes won there, runs 47-48), and
mix6's to 0.04-0.05 at x0.5-x1 (partitions won there, 1.15x triton): a threshold between the two
measured cases. On the GPU (run 49) it picked those modes and kept light3 at or above triton. By
default ``grow`` follows the mode: on shared lanes batches grow (0.934 against 0.888 without, light3
x8, run 47), on partitions they do not (-0.015, run 46). A re-plan changes the mode only outside
:data:`AUTO_BAND` around it (mix6 at x2-x5 plans at 0.09), so plans near the line do not flip
between layouts.

**Shedding** (``shed=True``, the default). Where the plan serves a model less than its demand
(overload: the planner shares the GPU by weighted max-min fairness), the service refuses that
model's requests beyond the planned rate at submission (:attr:`~gpuloom.policy.base.Policy.admit_rps`,
``Overloaded``, HTTP 429). On the H200 the overloaded mix (12,550 requests/s, about twice what the
GPU serves) queued every request, dropped 75% at their deadlines and served most of the rest late:
the host, not the GPU, was saturated (run 50: 0.061 of the SLO for every policy). Refused requests
still count as demand for re-planning (:meth:`on_refused`). A model the plan gives no slot at all
(``planned_rps`` 0) is not shed by the plan: it is served best effort on whatever is free, as before
(with ``adapt``, a cap may still shed it).

**Admission at the delivered rate** (``adapt=True``, off by default until measured on a GPU). The
plan's rates assume the host keeps up; on the overloaded mix at x0.5 it did not (run 54: nothing
shed, 0.51 of the SLO). With ``adapt`` the runtime reports what became of each model's requests
(:meth:`on_outcomes`), and a model missing more than a fifth of them is admitted at the rate it
delivered on time, then probed upwards while it keeps up; a cut after which the model misses as
large a share is undone (:class:`~gpuloom.policy.delivery.DeliveryCap`). Caps survive re-plans.

**Models slower than their SLO.** A model whose profile misses its SLO even alone on the GPU
(a batch of one too slow, or no period that fits a batch twice: fill, then run) gets nothing from
the planner; next to other models it then never ran, not even on an idle GPU for requests whose own
deadline it could meet (a crude profile timed at load on a busy host made tiny models look so).
Such a model is planned for the lowest SLO it can reach (:func:`~gpuloom.plan.servable`, steps of
1.25x; :attr:`relaxed` says which, asked and planned); its requests that cannot make their own
deadlines are still dropped at once.

A request is dropped (reason ``"deadline"``) only when it can no longer meet its deadline on any
partition, even as a batch of one started now. Arrivals feed a
:class:`~gpuloom.plan.RateEstimator`; every ``check_ms`` the :class:`~gpuloom.plan.Replanner`
decides (hysteresis band, hold time, switch cost) whether measured rates drifted enough to switch
to a new schedule; the runtime then drains the running batches and starts the new layout.

**Slowdowns.** On the H200 every model ran 1.00-1.6x its profile on the 6-model mix's partitions
(bert_base 1.14x at every load), so plans made from the profiles alone were over-optimistic where
the load was highest. ``slowdowns=PATH`` plans (and dispatches) with each model's profile slowed by
a factor from ``PATH``: ``{model: factor}``, or a ``gpuloom bench`` report whose dstack points
measured them (:func:`~gpuloom.plan.slowdown.load_slowdowns`). ``learn_slowdown=True`` learns them
while serving: each batch's device time over its profile's latency for the same batch and SMs feeds
a :class:`~gpuloom.plan.slowdown.SlowdownEstimator` (last 200 batches per model, known after 30),
and at each check the replanner re-plans when one moved by more than 5% from what the plan assumed,
unless the new plan serves less (:class:`~gpuloom.plan.Replanner`). Off by default until measured
on a GPU.

**Holds.** A batch holds its partition beyond its device time (launch, copies, the completion's way
back): on the H200 0.6-1.6 ms, and 2.6-4.4 ms for bert_base, whose batches return 3-6 MB
(runs 53-54). ``batch_overhead_ms`` plans one hold for every model (default: the device's,
:data:`DEFAULT_HOLD_MS` on a real one, the simulated device's own in simulation; ``batch_overhead_ms=0``
plans none); ``holds=PATH`` plans each
model's own, from ``PATH``: ``{model: ms}``, or a ``gpuloom bench`` report whose dstack points
measured them (:func:`~gpuloom.plan.slowdown.load_holds`). On the overloaded mix (run 57), planning
another run's holds and slowdowns served 1.40x / 2.18x plain dstack's goodput at x0.5 / x1: the plan
then knew what the GPU could serve and shed the rest. But holds are the host's: one machine's were
2-3x another's, and a slow machine's holds planned mix6 as overloaded on a fast one (-0.078, run 59).
``learn_holds=True`` learns them while serving, each batch's busy less device time on its
partition (a :class:`~gpuloom.plan.slowdown.HoldEstimator`, last 200 batches per model, known
after 30; a batch launched ahead counts from its predecessor's end, as the backend reports it and
the bench's ``hold_ms`` counts it), and at each check re-plans when one moved by more than 0.5 ms
from what the plan assumed, under the rule of ``learn_slowdown`` (:class:`~gpuloom.plan.Replanner`).
What was learned outlives a re-plan for new rates or models (:meth:`carry_over`). Off by default
until measured on a GPU.

**Re-plans serve on.** dstack defers its layout changes (``defers_layout_change``): after proposing
a re-plan's layout it goes on deciding for its current schedule until the runtime has the new
layout set up (:meth:`adopt_layout`); on a GPU the current layout serves while the new one's graphs
are captured, which takes seconds.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import time
from typing import Mapping, Sequence

from ..plan import Demand, RateEstimator, Replanner, Schedule, plan, servable
from ..plan.schedule import Partition as PlanPartition
from ..plan.planner import REMAINDERS
from ..plan.slowdown import HoldEstimator, SlowdownEstimator, load_holds, load_slowdowns, slowed_store
from ..profile.store import ProfileStore
from .base import Action, Policy, PolicyContext, Queues, hopeless, register
from .delivery import DeliveryCap
from .types import Decision, Drop, Layout, Partition


def _deadline(r) -> float:
    return r.deadline_ms


def _ids(q, j: int, k: int) -> tuple[int, ...]:
    """Ids of ``q[j : j + k]`` (a deque has no slices); a batch of one, the usual one, directly."""
    if k == 1:
        return (q[j].id,)
    return tuple([q[j + t].id for t in range(k)])


def _widest_gap(starts: Sequence[float], cycle: float) -> float:
    """The longest time from one of ``starts`` (sorted phases of a cycle) to the next, around the cycle."""
    if not starts:
        return math.inf
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return max(gaps + [starts[0] + cycle - starts[-1]])


class _PartPlan:
    """One partition's cycle, indexed for fast look-ups (private)."""

    __slots__ = ("sms", "starts", "ends", "models", "other_starts", "own_starts", "widest_gap")

    def __init__(self, part, models: Sequence[str], cycle: float) -> None:
        slots = sorted(part.slots, key=lambda s: s.start_ms)
        self.sms = part.sms
        self.starts = [s.start_ms for s in slots]
        self.ends = [s.end_ms for s in slots]
        self.models = [s.model for s in slots]
        # for a filler x: sorted starts of the slots of every model other than x
        self.other_starts = {x: [s.start_ms for s in slots if s.model != x] for x in models}
        # for a model x: sorted starts of x's own slots
        self.own_starts = {x: [s.start_ms for s in slots if s.model == x] for x in models}
        # for a filler x: the longest time between two consecutive starts of the others' slots (the
        # most a batch of x can take there); inf where none are others'
        self.widest_gap = {x: _widest_gap(starts, cycle) for x, starts in self.other_starts.items()}

    def owner_at(self, phi: float) -> str | None:
        i = bisect.bisect_right(self.starts, phi) - 1
        if i >= 0 and phi < self.ends[i]:
            return self.models[i]
        return None

    def horizon(self, x: str, phi: float, cycle: float) -> float:
        """Time from phase ``phi`` until the next slot of a model other than ``x`` starts (ms)."""
        others = self.other_starts[x]
        if not others:
            return math.inf
        i = bisect.bisect_left(others, phi)
        nxt = others[i] if i < len(others) else others[0] + cycle
        return nxt - phi

    def next_start(self, phi: float, cycle: float, model: str | None = None) -> float:
        """Time from ``phi`` until the next slot start (of ``model``'s slots if given), ms; inf if none."""
        starts = self.starts if model is None else self.own_starts[model]
        if not starts:
            return math.inf
        i = bisect.bisect_right(starts, phi)
        nxt = starts[i] if i < len(starts) else starts[0] + cycle
        return nxt - phi


#: the smallest partition dstack plans unless told otherwise. On the H200, a layout with 8-SM
#: partitions needs a second carving for cuDNN and ran every partition slower than profiled; at mix6
#: x0.5 the planner's only such layout held 0.919 and 0.976 of the SLO where planning with this floor
#: held 0.998 and 0.995, two same-run A/Bs (docs/reports/runtime.md, tenth session).
#: ``min_sms=0`` plans as before. On a GPU with fewer SMs than this, the whole GPU is the floor.
DEFAULT_MIN_SMS = 16

#: ``lanes="auto"``: shared lanes when a plan's turnaround share (:func:`turnaround_share`) is above
#: this. Between mix6's 0.04-0.05 (partitions won) and light3's 0.16-0.17 (shared lanes won).
AUTO_SHARED_ABOVE = 0.1
#: ... and a re-plan leaves the mode it runs on only beyond this distance from the threshold
AUTO_BAND = 0.02
#: what dstack runs on unless told: per plan. On the H200 (run 49, one process) auto ran mix6's plans
#: on partitions (share 0.04) as before and light3's on shared lanes (0.16-0.18), 0.943 / 0.798 at x8
#: / x9 against the partitions' 0.772 / 0.700 and triton's 0.905 / 0.795
DEFAULT_LANES = "auto"

#: a batch's host turnaround on the H200 (launch, completion, the loop's turn): 0.45-0.65 ms a batch
#: beyond its device time on light3 (run 46), which ``turnaround_share`` charges every planned batch
DEFAULT_TURNAROUND_MS = 0.55


def auto_lanes(share: float, current: str | None = None) -> str:
    """``lanes="auto"``'s choice for a plan of turnaround ``share``: shared lanes above
    :data:`AUTO_SHARED_ABOVE`, else partitions; a re-plan running on ``current`` leaves it only beyond
    :data:`AUTO_BAND` of the threshold."""
    if current == "shared" and share >= AUTO_SHARED_ABOVE - AUTO_BAND:
        return "shared"
    if current == "partitions" and share <= AUTO_SHARED_ABOVE + AUTO_BAND:
        return "partitions"
    return "shared" if share > AUTO_SHARED_ABOVE else "partitions"


def turnaround_share(sched: Schedule, turnaround_ms: float = DEFAULT_TURNAROUND_MS) -> float:
    """The share of the GPU's SM-time ``sched``'s partitions would idle through batch turnarounds:
    each model's batches per second (its demand, up to what the plan serves, over its planned batch)
    times ``turnaround_ms``, weighted by its partition's SMs."""
    if sched.gpu_sms <= 0:
        return 0.0
    idle = 0.0
    for mp in sched.models:
        if mp.partition >= 0 and mp.batch >= 1:
            idle += mp.sms * min(mp.demand_rps, mp.planned_rps) / mp.batch * turnaround_ms / 1000.0
    return idle / sched.gpu_sms


#: the hold dstack plans into every batch's slot on a real device unless told (``batch_overhead_ms``;
#: until the fifty-third session it planned none): a batch holds its partition beyond its device time
#: while the host launches it and learns it is done. 1.125 ms is the forty-third session's calibrated
#: hold. On fast hosts it held at least the hold-free plan's load in every mix6 run since run 143, and
#: in an A/B/A/B in separate processes (run 176, H100) light3 x8.75 against x8.25 in both pairs and
#: 1.39-1.40x the overloaded mix's goodput; on a slow host (run 147, mix6 x1) it split, one pair each
#: (docs/reports/runtime.md). In simulation dstack plans the simulated device's own fixed hold instead
#: (``PolicyContext.sim_hold_ms``: none on the plain device), as ``ideal`` is told it.
DEFAULT_HOLD_MS = 1.125


#: which partition takes the SMs left under the granularity (``planner.plan``'s ``remainder``). On
#: the H200 they are what the driver's co-scheduled splits leave over, and ran cuDNN convolutions
#: 1.4-1.7x slower than their count: given to the smallest partition (vgg16's 16 + 4) they made it
#: the slowest of its layout (run 41, ``scripts/diag_carvings.py``).
DEFAULT_REMAINDER = "largest"


@register
class DStackPolicy(Policy):
    name = "dstack"
    deadline_queues = True  # its head is its most urgent request, whatever deadlines clients give
    defers_layout_change = True  # serve the current schedule while a re-plan's layout is built

    def __init__(
        self,
        headroom: float = 0.0,
        replan: bool = True,
        check_ms: float = 250.0,
        window_s: float = 2.0,
        band: float = 0.2,
        hold_s: float = 2.0,
        switch_cost_s: float = 0.5,
        schedule: Schedule | None = None,
        batch_overhead_ms: float | None = None,
        slo_margin: float = 0.0,
        min_sms: int | None = None,
        ahead_full: bool = False,
        learn_slowdown: bool = False,
        slowdowns: str | Mapping[str, float] | None = None,
        remainder: str = DEFAULT_REMAINDER,
        grow: bool | str | None = None,
        fill_wait: float = 0.0,
        lanes: str | None = None,
        turnaround_ms: float = DEFAULT_TURNAROUND_MS,
        shed: bool = True,
        adapt: bool = False,
        holds: str | Mapping[str, float] | None = None,
        learn_holds: bool = False,
    ) -> None:
        if headroom < 0 or check_ms <= 0 or not (batch_overhead_ms is None or batch_overhead_ms >= 0) \
                or not 0 <= slo_margin < 1:
            raise ValueError(f"dstack: need headroom >= 0, check_ms > 0, batch_overhead_ms >= 0 and 0 <= slo_margin < 1, "
                             f"found {headroom}, {check_ms}, {batch_overhead_ms}, {slo_margin}")
        if grow == "auto":
            grow = None
        for flag, v in (("replan", replan), ("ahead_full", ahead_full), ("learn_slowdown", learn_slowdown),
                        ("grow", True if grow is None else grow), ("shed", shed),
                        ("adapt", adapt), ("learn_holds", learn_holds)):
            if not isinstance(v, bool):  # "False" from a command line must not read as True
                also = " or auto (on shared lanes only)" if flag == "grow" else ""
                raise ValueError(f"dstack: {flag} must be true or false{also}, found {v!r}")
        if min_sms is not None and not (isinstance(min_sms, int) and not isinstance(min_sms, bool) and min_sms >= 0):
            raise ValueError(f"dstack: min_sms must be an integer >= 0 (the smallest partition planned), found {min_sms!r}")
        self.min_sms = min_sms  # None: DEFAULT_MIN_SMS, or the whole GPU if it has fewer SMs
        if remainder not in REMAINDERS:
            raise ValueError(f"dstack: remainder must be one of {REMAINDERS} (the partition that takes the SMs "
                             f"left under the granularity), found {remainder!r}")
        self.remainder = remainder
        if isinstance(fill_wait, bool) or not isinstance(fill_wait, (int, float)) or not 0 <= fill_wait < 1:
            raise ValueError(f"dstack: fill_wait is a fraction of the SLO, 0 <= fill_wait < 1, found {fill_wait!r}")
        if lanes is None:  # measured learning reads a batch's time on its own partition
            lanes = "partitions" if learn_slowdown or learn_holds else DEFAULT_LANES
        if lanes not in ("partitions", "shared", "auto"):
            raise ValueError(f"dstack: lanes must be 'partitions' (the plan's disjoint SM partitions), 'shared' "
                             f"(a stream per model over the whole GPU) or 'auto' (per plan), found {lanes!r}")
        if isinstance(turnaround_ms, bool) or not isinstance(turnaround_ms, (int, float)) or not turnaround_ms >= 0:
            raise ValueError(f"dstack: turnaround_ms must be a number >= 0, found {turnaround_ms!r}")
        self.lanes = lanes  # the rule; self.mode is what the current plan runs on
        self.mode = "shared" if lanes == "shared" else "partitions"
        self._planned = False  # a first plan's mode is chosen without the re-plans' band
        self.turnaround_ms = float(turnaround_ms)
        for flag, v in (("learn_slowdown", learn_slowdown), ("learn_holds", learn_holds)):
            if v and lanes != "partitions":
                raise ValueError(f"dstack: {flag}=true needs lanes=partitions (on shared lanes a batch's time on "
                                 "the contended whole GPU says nothing about its planned partition)")
        self.fill_wait = float(fill_wait)  # a partial batch waits this fraction of its SLO to fill (module docstring)
        self._filling: set[str] = set()  # models holding a partial batch back to fill it
        self.grow_rule = grow  # None: grow on shared lanes only (module docstring)
        self.shed = shed  # refuse a short model's requests beyond its planned rate (module docstring)
        if adapt and not shed:
            raise ValueError("dstack: adapt=true needs shed=true (it lowers the rates that shedding admits)")
        self.adapt = adapt  # also cap each model at what it delivers on time while it misses (module docstring)
        self.wants_outcomes = adapt
        self.delivery: DeliveryCap | None = None
        # adapt: outcomes before this do not count; inf until a new layout's first decision (_adopt)
        self._quiet_until: float | None = None
        self.ahead_full = bool(ahead_full)  # launch ahead only batches of the planned size (module docstring)
        self._ahead_parts: set[int] = set()  # offered ahead (on_free), their batch still running
        self.headroom = float(headroom)
        self._given_hold_ms = batch_overhead_ms  # None: the device's (resolved by layout)
        #: planned into every slot (planner.plan)
        self.batch_overhead_ms = DEFAULT_HOLD_MS if batch_overhead_ms is None else float(batch_overhead_ms)
        # plan each model for SLO x (1 - slo_margin): the planner's worst case then leaves that much of
        # the SLO to what it does not model (host turnaround, arrival bursts); deadlines stay the SLO
        self.slo_margin = float(slo_margin)
        self.replan = bool(replan)
        self.learn_slowdown = bool(learn_slowdown)  # re-plan with measured slowdowns (module docstring)
        # the slowdowns the current schedule was planned with (read now: a bad file fails at construction)
        self._given_slow = dict(load_slowdowns(slowdowns) if isinstance(slowdowns, str) else (slowdowns or {}))
        if any(isinstance(f, bool) or not (isinstance(f, (int, float)) and 0 < f < math.inf)
               for f in self._given_slow.values()):
            raise ValueError(f"dstack: slowdowns must be finite factors > 0, found {self._given_slow}")
        for flag, v in (("learn_slowdown", learn_slowdown), ("learn_holds", learn_holds)):
            if v and not replan:
                raise ValueError(f"dstack: {flag}=true needs replan=true (what it learns takes effect in a re-plan)")
        self.learn_holds = learn_holds  # re-plan with measured holds (module docstring)
        self._slow: dict[str, float] = dict(self._given_slow)
        # per-model holds planned into each model's slots instead of batch_overhead_ms (module docstring)
        self._given_holds = dict(load_holds(holds) if isinstance(holds, str) else (holds or {}))
        if any(isinstance(h, bool) or not (isinstance(h, (int, float)) and 0 <= h < math.inf)
               for h in self._given_holds.values()):
            raise ValueError(f"dstack: holds must be ms >= 0 per model, found {self._given_holds}")
        self.holds: dict[str, float] = dict(self._given_holds)  # the current plan's (learn_holds: learned)
        self.slowness: SlowdownEstimator | None = None
        self.hold_learner: HoldEstimator | None = None
        self._sent: dict[int, int] = {}  # id(decision) -> its partition's SMs, while it runs (learning)
        # a re-plan being set up: its layout, schedule, slowdowns and holds
        self._pending: tuple[Layout, Schedule, dict[str, float], dict[str, float]] | None = None
        self.check_ms = float(check_ms)
        self.window_s, self.band, self.hold_s, self.switch_cost_s = window_s, band, hold_s, switch_cost_s
        self._given = schedule
        self._wake: float | None = None
        self._now = 0.0
        self._next_check = 0.0
        self._waiting: set[str] = set()  # models left queued by the last decision
        self._dirty = True  # re-examine every model on every free partition at the next decision
        self._fresh_parts: set[int] = set()  # partitions freed since the last decision
        self._fresh_models: set[str] = set()  # models whose queue filled since the last decision
        self.replans = 0
        self.relaxed: dict[str, tuple[float, float]] = {}  # model -> (SLO asked, SLO planned): see layout()
        # host time of the re-plan checks (a check that plans runs the planner): on a GPU they run on
        # the runtime's thread, holding the interpreter while requests wait to be submitted and launched
        self.check_wall_ms = {"checks": 0, "total": 0.0, "max": 0.0}

    # -- setup ------------------------------------------------------------------------------
    def carry_over(self, previous: Policy) -> None:
        """Keep learning where ``previous`` (a dstack this one replaces in the same runtime) left off:
        its slowdown and hold estimators, so that the first plan already uses what they know instead
        of learning it again and re-planning (a GPU re-plan captures a new layout: seconds)."""
        # a copy: the old policy serves on while the new layout builds, and what it sees then (a host
        # busy capturing graphs) is not what this one's plan should start from
        if isinstance(previous, DStackPolicy):
            if self.learn_slowdown and self.replan and previous.slowness is not None:
                self.slowness = copy.deepcopy(previous.slowness)
            if self.learn_holds and self.replan and previous.hold_learner is not None:
                self.hold_learner = copy.deepcopy(previous.hold_learner)

    def floor_sms(self, gpu_sms: int) -> int:
        """The smallest partition to plan on a GPU of ``gpu_sms`` SMs: the chosen ``min_sms``, else
        :data:`DEFAULT_MIN_SMS` (no more than the GPU has)."""
        return self.min_sms if self.min_sms is not None else min(DEFAULT_MIN_SMS, gpu_sms)

    def layout(self, ctx: PolicyContext) -> Layout:
        self.store = ProfileStore(profiles=[i.profile for i in ctx.models.values()])
        if self._given_hold_ms is None:  # the device's hold (DEFAULT_HOLD_MS)
            self.batch_overhead_ms = float(ctx.sim_hold_ms) if ctx.simulated else DEFAULT_HOLD_MS
        demands = [Demand(m, i.rate, i.slo_ms * (1.0 - self.slo_margin), i.weight) for m, i in ctx.models.items()]
        self._sent.clear()  # a previous run's batches that never completed
        if self.learn_slowdown and self.replan and self.slowness is None:
            self.slowness = SlowdownEstimator(window=200, min_batches=30)
        if self.learn_holds and self.replan and self.hold_learner is None:
            self.hold_learner = HoldEstimator(window=200, min_batches=30)
        for est in (self.slowness, self.hold_learner):
            if est is not None:  # a model unloaded and loaded again under its name may be another model
                est.forget_all_but(ctx.models)
        # what was given, overridden by what learning carried over from a predecessor knows already
        # (not for a schedule given ready-made: it was planned without them)
        learned = self._given is None
        holds = {**self._given_holds, **(self.hold_learner.holds() if learned and self.hold_learner is not None else {})}
        slow = {**self._given_slow, **(self.slowness.factors() if learned and self.slowness is not None else {})}
        kwargs = {"gpu_sms": ctx.gpu_sms, "granularity": ctx.granularity, "eps": ctx.knee_eps, "headroom": self.headroom,
                  "batch_overhead_ms": self.batch_overhead_ms, "min_sms": self.floor_sms(ctx.gpu_sms),
                  "model_overhead_ms": {m: h for m, h in holds.items() if m in ctx.models} or None,
                  "remainder": self.remainder}
        self._slow = {m: f for m, f in slow.items() if m in ctx.models}
        self.holds = dict(kwargs["model_overhead_ms"] or {})
        planning = slowed_store(self.store, self._slow) if self._slow else self.store
        if self._given is None:
            fit = {k: v for k, v in kwargs.items() if k not in ("eps", "remainder")}
            asked = {d.model: d.slo_ms for d in demands}
            demands = servable(demands, planning, **fit)
            # models no plan serves within their SLO, planned for the SLO they can reach (module docstring)
            self.relaxed = {d.model: (asked[d.model], d.slo_ms) for d in demands if d.slo_ms != asked[d.model]}
        sched = self._given or plan(demands, planning, **kwargs)
        self.replanner = Replanner(
            demands, self.store, schedule=sched, band=self.band, hold_s=self.hold_s,
            switch_cost_s=self.switch_cost_s, plan_kwargs=kwargs, slowdowns=self._slow,
            switch_fraction=self._switch_fraction,
        ) if self.replan else None
        self.estimator = RateEstimator(self.window_s)
        self._arrived = {m: 0 for m in ctx.models}  # arrivals since the last check
        self.delivery = DeliveryCap(ctx.models) if self.adapt else None
        self._next_check = self.check_ms
        return self._adopt(sched, 0.0)

    def _adopt(self, sched: Schedule, now_ms: float) -> Layout:
        """Index ``sched`` and return its layout; its cycles start at ``now_ms``."""
        if sched.gpu_sms != self.ctx.gpu_sms:
            raise ValueError(f"dstack: schedule for {sched.gpu_sms} SMs, the GPU has {self.ctx.gpu_sms}")
        if not sched.partitions:
            # nothing could be planned within its SLO (e.g. every model is slower than its SLO even
            # alone on the whole GPU): serve best effort on one whole-GPU partition without slots;
            # requests that cannot make their deadline are dropped as usual, with the reason
            sched = dataclasses.replace(sched, partitions=(PlanPartition(0, 0, sched.gpu_sms, ()),))
        self.mode = self._mode_for(sched)
        self._planned = True
        self.schedule = sched
        self._plan_admit = {mp.model: mp.planned_rps for mp in sched.models
                            if 0 < mp.planned_rps < mp.demand_rps} if self.shed else {}
        if self.delivery is not None:
            # caps survive a re-plan; outcomes do not count until a window after the new layout's
            # first decision: the switch drains the GPU, and what was queued meanwhile misses
            self._quiet_until = math.inf
            self.admit_rps = self.delivery.admit(self._plan_admit)
        else:
            self.admit_rps = self._plan_admit
        self.epoch = now_ms
        self.cycle = sched.cycle_ms
        self._ahead_parts = set()  # a new layout's partitions start empty
        self._pending = None
        models = list(self.ctx.models)
        parts = self._lanes(sched)
        self.parts = [_PartPlan(p, models, sched.cycle_ms) for p in parts]
        # where each model has slots of its own: where a waiting model's slot may begin (_fill's wake-up)
        self._slotted = {m: [i for i, pp in enumerate(self.parts) if pp.own_starts[m]] for m in models}
        self._rows: dict[tuple[str, int], list[tuple[int, float]]] = {}
        self._l1 = {
            m: [self._hold_ms(m, i.profile.batches[0], p.sms) for p in parts]
            for m, i in self.ctx.models.items()
        }
        if self.mode == "shared":  # each model its own lane, slots or none (_lanes indexes them like models)
            self.pref = {m: [i] for i, m in enumerate(models)}
        else:
            home = {m: [p.index for p in parts if m in p.models] for m in models}
            self.pref = {m: home[m] + [p.index for p in parts if p.index not in home[m]] for m in models}
        # each model's latency row (_lat_row) on each partition, by index: what _fill hands _batch
        self._row_at = {m: [self._lat_row(m, p.sms) for p in parts] for m in models}
        planned = {mp.model: mp for mp in sched.models}
        self.cap = {}
        for m, info in self.ctx.models.items():
            mp = planned.get(m)
            self.cap[m] = mp.batch if mp is not None and mp.batch >= 1 else info.profile.batches[0]
        # a batch of one of m as fast as it can run where m may run: when a request is hopeless. On
        # shared lanes that is alone on the whole GPU (_fill runs one there when every lane is free)
        if self.mode == "shared":
            self._alone_row = {m: self._lat_row(m, sched.gpu_sms) for m in models}
            self.fastest = {m: self._alone_row[m][0][1] for m in models}
        else:
            self._alone_row = {}
            self.fastest = {m: min(self._l1[m][i] for i in self.pref[m]) for m in models}
        return self._layout_of(sched, self.mode)

    def _mode_for(self, sched: Schedule) -> str:
        """What ``sched`` runs on: the ``lanes`` option, or for ``"auto"`` the rule in the docstring."""
        if self.lanes != "auto":
            return self.lanes
        # a re-plan leaves the current mode only outside the band
        return auto_lanes(turnaround_share(sched, self.turnaround_ms), self.mode if self._planned else None)

    def _switch_fraction(self, candidate: Schedule) -> float | None:
        """What adopting ``candidate`` rebuilds, for the replanner's switch cost: nothing from shared
        lanes to shared lanes (every model has every bucket captured on its lane already), everything
        between shared lanes and partitions; ``None`` (the partition geometry's) between partitions."""
        new = self._mode_for(candidate)
        if self.mode == "shared" and new == "shared":
            return 0.0
        if self.mode != new:
            return 1.0
        return None

    @property
    def grow(self) -> bool:
        """Whether batches may grow past the planned one now: the ``grow`` option, or by default on
        shared lanes only (there it won, runs 47-49; on partitions it lost 0.015, run 46)."""
        return self.mode == "shared" if self.grow_rule is None else self.grow_rule

    def _lanes(self, sched: Schedule) -> list[PlanPartition]:
        """What the policy dispatches onto: the planned partitions, or on shared lanes one lane per
        model, indexed like :meth:`_layout_of`'s, with the SMs and slots of the partition the model
        was planned on (its latencies there)."""
        if self.mode != "shared":
            return list(sched.partitions)
        out = []
        for i, m in enumerate(self.ctx.models):
            home = next((p for p in sched.partitions if m in p.models), None)
            sms = home.sms if home is not None else max(p.sms for p in sched.partitions)
            slots = tuple(x for x in home.slots if x.model == m) if home is not None else ()
            out.append(PlanPartition(i, 0, sms, slots))
        return out

    def _layout_of(self, sched: Schedule, mode: str) -> Layout:
        """The runtime's layout for ``sched`` run on ``mode``: one exclusive partition per planned
        one, or one shared lane per model."""
        if mode == "shared":
            return Layout.shared_lanes(sched.gpu_sms, list(self.ctx.models))
        layout_parts = []
        for p in sched.partitions:
            owner = p.models[0] if len(p.models) == 1 else None
            layout_parts.append(Partition(p.index, p.sm_offset, p.sms, shared=False, owner=owner, label=f"p{p.index}[{p.sm_offset}:{p.sm_offset + p.sms}]"))
        return Layout(tuple(layout_parts), sched.gpu_sms)

    # -- events -----------------------------------------------------------------------------
    def on_refused(self, model: str, n: int, now_ms: float) -> None:
        if model in self._arrived:
            self._arrived[model] += n  # demand all the same: re-plans see it
        if self.delivery is not None:
            self.delivery.arrived(model, n)
            self._close_window(now_ms)

    def on_outcomes(self, model: str, on_time: int, missed: int, now_ms: float) -> None:
        quiet = self._quiet_until
        if quiet is not None and now_ms < quiet:
            return  # a layout switch's drain and its aftermath (_adopt)
        self.delivery.outcome(model, on_time, missed)  # only called with adapt (wants_outcomes)
        self._close_window(now_ms)

    def _close_window(self, now_ms: float) -> None:
        """adapt: at the end of each window, the caps from its outcomes (policy/delivery.py)."""
        delivery = self.delivery
        if self._quiet_until is not None:  # settling after a new layout: count from its end
            if now_ms < self._quiet_until:
                return
            self._quiet_until = None
            delivery.restart(now_ms)
            return
        if delivery.due(now_ms) and delivery.update(now_ms):
            self.admit_rps = delivery.admit(self._plan_admit)  # replaced, never mutated: client threads read it

    def on_arrival(self, request, now_ms: float) -> None:
        m = request.model
        self._arrived[m] += 1  # fed to the rate estimator at the next check (every check_ms)
        if self.delivery is not None:
            self.delivery.arrived(m)
            self._close_window(now_ms)
        if m not in self._waiting or self._ahead_parts or m in self._filling:
            # had nothing queued: it may fit somewhere now; or a partition offered ahead, or a batch
            # held back to fill (fill_wait), waits for a full batch, which this arrival may complete
            self._fresh_models.add(m)

    def on_completion(self, completion, now_ms: float) -> None:
        d = completion.decision
        self._fresh_parts.add(d.partition)  # this partition came free
        self._ahead_parts.discard(d.partition)
        # the SMs it ran on, noted at dispatch: after a re-plan a partition index means other SMs
        sms = self._sent.pop(id(d), None) if self._sent else None
        if sms is not None and completion.device_ms > 0:
            if self.slowness is not None:
                self.slowness.observe(d.model, completion.device_ms, self.ctx.models[d.model].profile.latency(d.batch, sms))
            if self.hold_learner is not None:
                self.hold_learner.observe(d.model, completion.end_ms - completion.start_ms, completion.device_ms)

    def on_free(self, partition: int, now_ms: float) -> None:
        self._fresh_parts.add(partition)  # it takes its next batch ahead of its running one's end
        if self.ahead_full:
            self._ahead_parts.add(partition)

    # -- deciding ---------------------------------------------------------------------------
    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        self._now = now_ms
        if self._quiet_until == math.inf:  # adapt: the new layout's first decision; outcomes count a window later
            self._quiet_until = now_ms + self.delivery.window_ms
        # Incremental decisions: only models that may have become dispatchable are examined -- a
        # model whose queue was empty at the last call (new arrivals), and, when a partition came
        # free, every model left waiting. A wake-up (a waiting model's slot begins) or a new layout
        # re-examines everything.
        wake = self._wake
        full = self._dirty or (wake is not None and now_ms >= wake)
        fresh_parts, fresh_models = self._fresh_parts, self._fresh_models
        if full:
            cands = [m for m, q in queues.items() if q]
            self._dirty = False
            wake = None
        elif fresh_parts:
            wanted = self._waiting | fresh_models
            cands = [m for m, q in queues.items() if q and m in wanted]
        elif fresh_models:
            cands = [m for m in fresh_models if queues[m]]
        else:
            return []
        if fresh_parts:
            self._fresh_parts = set()
        if fresh_models:
            self._fresh_models = set()
        out: list[Action] = []
        pos: dict[str, int] = {}  # next undecided request of each candidate
        head: dict[str, float] = {}  # its deadline
        fastest = self.fastest
        for m in cands:
            q = queues[m]
            dl = q[0].deadline_ms
            if now_ms + fastest[m] > dl:
                dead = hopeless(q, now_ms, fastest[m])
                out.append(Drop(m, dead, "deadline"))
                if len(dead) < len(q):
                    pos[m] = len(dead)
                    head[m] = q[len(dead)].deadline_ms
                else:
                    self._waiting.discard(m)
            else:
                pos[m] = 0
                head[m] = dl
        if pos:
            wake = self._fill(now_ms, queues, free, pos, head, wake, out)
        self._wake = wake
        return out

    def _fill(self, now_ms, queues, free, pos, head, wake, out) -> float | None:
        """Dispatch candidates (``pos``) onto free partitions; returns the next wake-up time."""
        cycle = self.cycle
        phi = (now_ms - self.epoch) % cycle if cycle > 0 else 0.0
        parts = self.parts
        shared = self.mode == "shared"
        free_idx = {p.index for p in free}
        owners: dict[int, str | None] = {}
        waiting = self._waiting
        for m in (sorted(pos, key=head.__getitem__) if len(pos) > 1 else list(pos)):  # earliest deadline first
            q = queues[m]
            self._filling.discard(m)  # held back again below if its batch is still partial
            l1s, rows = self._l1[m], self._row_at[m]
            first_left = pos[m]  # the oldest request of m this decision leaves queued
            # where m's batch fits no gap between others' slots now: when one would (ms from now), for
            # a model without slots of its own (a re-plan for measured rates may leave one out), or one
            # whose own next slot comes too late for its oldest request (a client's short deadline)
            gap_opens = math.inf
            gap_matters = None  # (worked out at the first such gap)
            # m's home partitions first (static order), then the others
            for idx in self.pref[m]:
                if idx not in free_idx:
                    continue
                i = pos[m]
                pp = parts[idx]
                # quick reject: not even a batch of one fits before the deadline
                l1, row = l1s[idx], rows[idx]
                head_late = l1 > q[i].deadline_ms - now_ms + 1e-9
                if head_late and shared and len(free_idx) == len(parts) and self._alone(m, queues):
                    # on shared lanes, the GPU idle and no other model's request waiting, m's batch runs
                    # alone on the whole GPU, faster than its planned share: a client's deadline too short
                    # for the share may still be met
                    alone = self._alone_row[m]
                    if alone[0][1] <= q[i].deadline_ms - now_ms + 1e-9:
                        row, l1, head_late = alone, alone[0][1], False
                if head_late:
                    if not shared or len(q) - i == 1:
                        continue
                    # on shared lanes a head the planned share cannot serve in time waits to run alone (or
                    # is dropped once hopeless even so): _batch passes it over for younger requests, so it
                    # does not hold its model's lane while the GPU is busy
                horizon = math.inf  # ms until another model's next slot here: none where every slot is m's
                if pp.other_starts[m]:
                    # a partition whose current slot belongs to another model with queued requests is
                    # that model's; and not even a batch of one of m fits before another's next slot
                    o = owners.get(idx, 0)
                    if o == 0:
                        o = owners[idx] = pp.owner_at(phi)
                    if o is not None and o != m and (o in pos or (o not in head and queues[o])):
                        continue
                    horizon = pp.horizon(m, phi, cycle) + 1e-9
                    if l1 > horizon:
                        if horizon < gap_opens and l1 <= pp.widest_gap[m] + 1e-9:
                            if gap_matters is None:
                                gap_matters = self._own_slot_too_late(m, q[i].deadline_ms, now_ms, phi)
                            if gap_matters:
                                # it fits once the next slot has begun (its owner may have nothing to
                                # run then): look again at that moment, not only when a drop or an
                                # arrival is due (on an idle server such requests waited out their
                                # deadline, then 504)
                                gap_opens = horizon
                        continue
                if len(q) - i == 1 and not head_late:
                    # one request left, the usual case: _batch would answer (1, i), as l1 (the hold of
                    # its smallest bucket) fits the deadline and the horizon (both checked above)
                    k, j = 1, i
                else:
                    k, j = self._batch(m, q, i, row, horizon, now_ms)
                if k and idx in self._ahead_parts and k < self._fullest(m, row, horizon):
                    continue  # offered ahead: only a full batch goes now, a smaller one elsewhere or later
                if k and self.fill_wait and j == i and j + k == len(q):
                    hold = self._fill_until(m, q[i], row, horizon, k)
                    if hold is not None:  # a partial batch that may wait to fill: not here, not elsewhere
                        self._filling.add(m)
                        if wake is None or hold < wake:
                            wake = hold
                        break
                if k:
                    self._ahead_parts.discard(idx)
                    dec = Decision(m, _ids(q, j, k), k, idx)
                    out.append(dec)
                    if self.slowness is not None or self.hold_learner is not None:  # read when it completes
                        self._sent[id(dec)] = pp.sms
                    free_idx.discard(idx)
                    if first_left == i and j == i:  # nothing passed over: the oldest left moves on
                        first_left = j + k
                    if j + k < len(q):
                        pos[m] = j + k
                    else:
                        del pos[m]
                        break
            if first_left < len(q):
                # m keeps queued requests (not placed, or passed over for a fuller batch of younger
                # ones): re-examine it when a partition comes free, and at the latest when its oldest
                # can no longer make its deadline, so that it is dropped then even if nothing else
                # happens (without this, requests passed over at the end of a burst stayed queued)
                waiting.add(m)
                t = min(q[first_left].deadline_ms - self.fastest[m], now_ms + gap_opens) + 1e-3
                if wake is None or t < wake:
                    wake = t
            else:
                waiting.discard(m)
        slotted = [m for m in pos if m not in self._filling] if self._filling else pos  # a filling one has its wake-up
        if slotted and free_idx:
            # wake when a waiting model's own slot begins on a free partition (fills are retried then
            # and at every arrival and completion)
            # at least 1 us ahead: at a slot's start phi may come out a hair below it (floating point),
            # and a wake-up at now would be discarded, and with it the drop wake-up it replaced
            t = max(self._next_own_slot(slotted, free_idx, phi), 1e-3) + now_ms
            if math.isfinite(t) and (wake is None or t < wake):
                wake = t
        return wake

    @staticmethod
    def _alone(m: str, queues: Queues) -> bool:
        """Whether no model but ``m`` has a request waiting (a batch of ``m`` started now on an idle
        GPU keeps it to itself until another's request arrives)."""
        return not any(q for o, q in queues.items() if q and o != m)

    def _own_slot_too_late(self, m: str, deadline_ms: float, now_ms: float, phi: float) -> bool:
        """Whether a request of ``m`` due at ``deadline_ms`` misses it even from ``m``'s own next slot
        (on any of its partitions, run there as fast as ``m`` runs anywhere); True without slots."""
        own = min((self.parts[j].next_start(phi, self.cycle, m) for j in self._slotted[m]), default=math.inf)
        return now_ms + own + self.fastest[m] > deadline_ms

    def _next_own_slot(self, models, free_idx: set[int], phi: float) -> float:
        """ms from phase ``phi`` until the first slot of one of ``models`` begins on a free
        partition; inf if none has slots there."""
        soonest = math.inf
        for m in models:
            for idx in self._slotted[m]:
                if idx in free_idx:
                    t = self.parts[idx].next_start(phi, self.cycle, m)
                    if t < soonest:
                        soonest = t
        return soonest

    def _batch(self, m: str, q, i: int, row: list[tuple[int, float]], horizon: float, now_ms: float) -> tuple[int, int]:
        """``(k, j)``: run ``q[j : j + k]`` of ``m`` now on a partition where its batches take
        ``row`` (:meth:`_lat_row`; ``k = 0``: nothing fits).

        The largest batch up to the planned one (with ``grow``, up to the largest bucket when its
        requests are the oldest and all in time) that ends within ``horizon`` (ms to the next slot of
        another model there, plus the comparisons' 1e-9; the caller has it already) and before the
        deadline of its oldest request. Under a backlog the oldest requests may be too close to their
        deadline for a full batch: they are skipped (not dropped -- they may still run alone
        elsewhere, or are dropped once hopeless) in favour of a full batch of younger ones, so that
        overload does not shrink every batch to the few requests that still have time.
        """
        cap = self.cap[m]
        backlog = len(q) - i
        enough = min(backlog, row[-1][0] if self.grow else cap)  # a bucket this large takes every request it may
        slack0 = q[i].deadline_ms - now_ms + 1e-9
        best_k, best_j = 0, i
        for b, lat in row:
            if lat > horizon:
                break  # latency grows with the batch
            if self.grow and b > cap:
                # grow: past the planned batch only with the oldest requests, every one in time
                if lat > slack0:
                    break
                k, j = min(b, backlog), i
            else:
                j = i if lat <= slack0 else bisect.bisect_left(q, now_ms + lat - 1e-9, lo=i, key=_deadline)
                k = min(b, cap, len(q) - j)
            if k > best_k:
                best_k, best_j = k, j
            if b >= enough:
                break
        return best_k, best_j

    def _fill_until(self, m: str, oldest, row: list[tuple[int, float]], horizon: float, k: int) -> float | None:
        """When a partial batch of ``k`` of ``m`` (``oldest`` first) stops waiting to fill
        (``fill_wait``): ``None`` to launch it now -- it is full, its oldest request has waited long
        enough, or a full batch started then would end past that request's deadline."""
        full = self._fullest(m, row, horizon)
        if k >= full:
            return None
        until = oldest.arrival_ms + self.fill_wait * self.ctx.models[m].slo_ms
        if until <= self._now:
            return None
        lat = next(lat for b, lat in row if b >= full)
        if until + lat > oldest.deadline_ms or until - self._now + lat > horizon:
            return None  # waiting would cost the oldest its deadline, or the batch its place before another's slot
        return until

    def _fullest(self, m: str, row: list[tuple[int, float]], horizon: float) -> int:
        """The largest batch of ``m`` (up to its planned one) that a partition where its batches
        take ``row`` could run now within ``horizon`` (before another model's slot): what counts as
        full for a partition offered ahead (``ahead_full``)."""
        best = 0
        for b, lat in row:
            if lat > horizon:
                break
            best = min(b, self.cap[m])
        return best

    def _lat_row(self, m: str, sms: int) -> list[tuple[int, float]]:
        """(bucket, L(bucket, sms) + batch overhead) for ``m``, cached: how long a batch holds a partition."""
        key = (m, sms)
        row = self._rows.get(key)
        if row is None:
            prof = self.ctx.models[m].profile
            row = self._rows[key] = [(b, self._hold_ms(m, b, sms)) for b in prof.batches]
        return row

    def _hold_ms(self, m: str, b: int, sms: int) -> float:
        """How long a batch of ``b`` of ``m`` holds a partition of ``sms``: its profiled latency (times
        the slowdown the schedule was planned with) plus the planned batch overhead (what the planner
        puts in every slot)."""
        return self.ctx.models[m].profile.latency(b, sms) * self._slow.get(m, 1.0) + self.holds.get(m, self.batch_overhead_ms)

    def next_wakeup(self, now_ms: float) -> float | None:
        self._now = now_ms
        t = self._wake if self._wake is not None and self._wake > now_ms else None
        if self.replanner is not None:
            # a check already due was missed: layout_change() ran on a bare wake-up, with the last
            # decide's time. Ask to be woken just after now, or the runtime (which ignores wake-ups
            # not in the future) would leave the check to the next completion
            check = max(self._next_check, now_ms + 1e-3)
            t = check if t is None or check < t else t  # the sooner
        return t

    def layout_change(self) -> Layout | None:
        if self.replanner is None or self._now < self._next_check:
            return None
        now_s = self._now / 1000.0
        self._next_check = self._now + self.check_ms
        for m, n in self._arrived.items():
            if n:
                self.estimator.observe(m, now_s, n)
                self._arrived[m] = 0
        if self._pending is not None:
            return None  # one re-plan at a time: its layout is still being set up (a GPU build takes seconds)
        rates = {m: self.estimator.rate(m, now_s) for m in self.ctx.models}
        onset = {m: self.estimator.onset_rate(m, now_s, self.check_ms / 1000.0) for m in self.ctx.models}
        t0 = time.perf_counter()
        d = self.replanner.check(now_s, rates, self.slowness.factors() if self.slowness is not None else None,
                                 self.hold_learner.holds() if self.hold_learner is not None else None, onset)
        took = (time.perf_counter() - t0) * 1e3
        cw = self.check_wall_ms
        cw["checks"] += 1
        cw["total"] += took
        cw["max"] = max(cw["max"], took)
        if not d.replan:
            return None
        self.replans += 1
        mode = self._mode_for(d.schedule)
        if self.mode == "shared" and mode == "shared":
            # the lanes stay the same (one per model over the whole GPU): take the new plan's batches and
            # latencies now, with no layout change for the runtime to drain and set up
            self._slow, self.holds = dict(self.replanner.slowdowns), dict(self.replanner.holds)
            self._dirty = True
            self._adopt(d.schedule, self._now)
            self._wake = self._now + 1e-3  # decide again at once for the new plan, not at the old wake-up
            return None
        # decide for the current schedule until the runtime has the new one set up (adopt_layout): on a
        # GPU it goes on serving the old layout while the new one's graphs are captured
        layout = self._layout_of(d.schedule, mode)
        self._pending = (layout, d.schedule, dict(self.replanner.slowdowns), dict(self.replanner.holds))
        return layout

    def adopt_layout(self, layout: Layout, now_ms: float) -> None:
        if self._pending is None or self._pending[0] is not layout:
            return
        _, sched, slow, holds = self._pending
        self._slow, self.holds = slow, holds  # dispatch with the latencies the new plan assumed
        self._dirty = True
        self._adopt(sched, now_ms)

    def layout_failed(self, layout: Layout) -> None:
        if self._pending is not None and self._pending[0] is layout:
            self._pending = None
            self.replanner.revert()  # the plan that still runs is the one to drift from

    def describe(self) -> dict:
        return {
            "name": self.name,
            "cycle_ms": self.cycle,
            "partitions": [(p.sms, list(p.models)) for p in self.schedule.partitions],
            "lanes": self.mode,
            "lanes_rule": self.lanes,
            "turnaround_share": round(turnaround_share(self.schedule, self.turnaround_ms), 4),
            "batch": dict(self.cap),
            "batch_overhead_ms": self.batch_overhead_ms,  # the hold planned into every slot
            "replans": self.replans,
            # served for real only: in a simulation the host's time is no part of the result (and would
            # make two runs of one simulation differ)
            **({"replan_checks": {"checks": self.check_wall_ms["checks"], "max_ms": round(self.check_wall_ms["max"], 2),
                                  "total_ms": round(self.check_wall_ms["total"], 1)}}
               if not self.ctx.simulated else {}),
            "slowdowns": {m: round(f, 3) for m, f in sorted(self._slow.items())},
            "short": list(self.schedule.short),
            "grow": self.grow,
            "fill_wait": self.fill_wait,
            "admit_rps": {m: round(r, 1) for m, r in sorted(self._plan_admit.items())},
            "adapt": self.adapt,
            **({"holds": {m: round(h, 3) for m, h in sorted(self.holds.items())}} if self.holds else {}),
            # what learning measured and the last look at it concluded (learn_slowdown, learn_holds)
            **({"learned_holds": {m: round(h, 3) for m, h in sorted(self.hold_learner.holds().items())},
                "given_holds": {m: round(h, 3) for m, h in sorted(self._given_holds.items())}}
               if self.hold_learner is not None else {}),
            **({"measured_note": self.replanner.slowdown_note}
               if (self.slowness is not None or self.hold_learner is not None) and self.replanner is not None else {}),
            **({"delivery_caps": {m: round(r, 1) for m, r in sorted(self.delivery.caps.items())},
                "delivery_cuts": self.delivery.cuts, "delivery_undone": self.delivery.undone}
               if self.delivery is not None else {}),
        }
