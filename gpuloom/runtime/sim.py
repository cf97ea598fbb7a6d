"""The simulated backend: batches run for their profiled latency on a discrete-event clock.

Contention model (the part that decides how the baselines fare; keep it honest and calibrate it
against the GPU, issue 5). Its parameters live in :class:`ContentionModel`.

* **Exclusive partition** (``Partition.shared=False``, a green context): a batch of ``b`` on ``s``
  SMs runs for ``L(b, s)`` from the profile, whatever else runs on other partitions.
* **Shared lanes** (streams over the same SMs: Triton instances, Clipper containers, Nexus, the
  temporal baseline, the ``ideal`` reference). ``A`` = SMs not owned by exclusive partitions (the
  whole GPU when there are none). A batch alone on them runs for ``L(b, A)``. Each running batch
  *demands* ``demand_fraction`` times its knee ``k = knee(b)`` (the fewest SMs within ``knee_eps`` of
  its whole-GPU latency), or the SMs a policy granted it (``Decision.sms``; then it runs for
  ``L(b, sms)``). While the demands ``K`` fit (``K <= efficiency * A``) nobody slows down; beyond,
  every shared batch progresses ``K / (efficiency * A)`` times slower (SMs divided in proportion to
  demand; a batch alone is never slowed), raised to ``shared_exponent`` (1 by default: the shared SMs'
  throughput stays whole however oversubscribed; above 1 it falls). The factor is recomputed whenever
  the set of running batches changes: a batch's progress is integrated piecewise (processor sharing),
  so a batch that started alone and is joined halfway is slowed only for the second half.
* **Area demand** (``demand="area"``; default ``"knee"``): a shared batch demands instead the SMs it
  keeps busy on average, its smallest SM-time on ``area_min_sms`` or more SMs (its most efficient
  count) over its time on the pool, times ``demand_fraction``; with ``efficiency`` below 1 the shared
  SMs then conserve that SM-time at a fraction of the pool. Past triton's edge on mix6 the cards got
  through that SM-time at 0.62-0.75 (H100) and 0.69-0.77 (H200) of the GPU over mean batches of 3 to 11,
  where the knee's work read 0.82-1.09 and 0.90-1.02 (``scripts/diag_shared_work.py``, fiftieth
  session). As a simulator it fit no more points within 10% than the knee (``docs/reports/runtime.md``),
  so it is an option, not the default.
* **Uneven shares** (``share_weights``; empty by default): oversubscribed shared lanes get the delivered
  SMs in proportion to demand times a per-model weight, none more than it demands, so the lanes slow
  unevenly and the SMs are conserved. Past triton's edge the card slowed bert_base 2.7x its profile and
  the CNNs 4.4-5.5x (``scripts/diag_sim_per_model.py``); weights taken from one card's edge fit fewer
  held-out points than one factor for all (``scripts/sim_share_weights.py``, fifty-first session), so
  it is an option, not the default.
* **Prioritized shared batches** (``Decision.priority`` set; the ``ideal`` bound uses it): before the
  proportional division, SMs go to prioritized batches in priority order (lowest first), each up to
  its demand, losslessly; a batch left with ``s`` SMs below its demand runs at ``L(b, s)`` (below the
  profile's smallest SM count, linearly slower), with none it waits. Unprioritized batches share what
  is left as above.
* **Interference** (memory bandwidth, L2: partitions share them too): every running batch, on any
  kind of partition, is slowed by ``1 + interference * (n - 1)`` with ``n`` batches running. Default 0.

* **Batch overhead** (``batch_overhead_ms``): every batch holds its lane this much longer than its
  GPU time: the host's launch and the completion's way back to the scheduler, during which the lane
  takes no new batch. Measured on the H200 from ``busy_ms - device_ms`` per batch (0.4-0.9 ms with the
  Python runtime, up to 3.3 ms near collapse; ``docs/reports/runtime.md``). It follows the batch's GPU
  work and holds only the lane: the batch's SMs are free for other lanes then (a shared lane's
  turnaround is another lane's GPU time, as on the H200) and it counts in no utilization.
  ``model_overhead_ms`` gives some models their own (pairs of model and ms): on the H200 bert_base's
  partition held each batch 1.5-2.8 ms beyond device time where the others held 0.6-0.9 ms
  (``scripts/sim_measured_hold.py``, eleventh session).
  ``hold_spread`` draws each batch's hold from a lognormal of that mean with this sigma (0: every
  batch the mean). On the H200 the holds have a heavy tail (run 54, light3: mean 0.64, median 0.52,
  p99 2.1 ms, a lognormal of sigma 0.61); SLOs of 5-10 ms feel that tail, SLOs of 25-100 ms mostly
  the mean. Drawn from a generator seeded with ``seed``: a simulation stays repeatable.
  ``hold_per_ms`` lengthens each batch's hold by that much per ms of its GPU time as profiled at
  its launch (``hold_per_request_ms``: per request of the batch). On the H200 the hold grows with
  the batch (run 54's efficientnet_b0 lanes: 0.50 ms at batch 1, 0.99 at batch 8) and the mean hold
  per point with the batch's length (dstack on light3, 1.6 ms batches: 0.67 ms; on mix6, 3.4-5.1 ms
  batches: 0.79-1.12), and the served batches run 1.06-1.09x their profile on dstack's partitions:
  both scale with the batch, which one fixed hold cannot give light3's short batches and mix6's long
  ones at once. Per ms, not per request: fitted per request it was worse (forty-fifth session).
* **Host launch** (``host_launch_ms``): one host thread launches every batch, one after another
  (the Python runtime's loop thread). A batch waits for the launcher to be free, then occupies it
  this long; its lane is busy from the decision on, so queueing on the launcher delays it. Unlike
  ``batch_overhead_ms`` (parallel, per lane), this caps the whole GPU at ``1 / host_launch_ms``
  batches per ms. Tried because the H200 runs started 1,200-1,700 batches/s at overload; fitted
  against them it is best at 0 (``docs/results/runtime/sim_calibration_host.json``), and a fake-GPU
  run found the runtime thread mostly idle, so it stays off by default. With the deadline and light3
  runs in the fit it is not (forty-third session): 0.1 ms with a 1.125 ms hold fits 31 of 35 points
  within 10% against 28 without; with holds that grow with the batch, 0.15 ms
  (:meth:`ContentionModel.h200_runs`). On nexus's one lane the time from
  booking a batch to launching the next measured 0.28 ms per batch (its GPU idle with work queued).
  Same simplification as the batch overhead.
* **Host per request** (``host_request_ms``): the same one host, also busy this long for each
  request of a batch. It stands for the Python interpreter that every request crosses (``submit``,
  the loop's arrival and answer, the bridge over HTTP) and that the GIL serializes: on the H200 the
  runtime's process used 1.1-1.3 CPU-s per s at mix6 x0.75 (``host.thread_cpu`` in runs 15-16,
  ``docs/reports/runtime.md``), and past that load the real runtime collapses where the plain
  model serves everything. The requests' share is added to the host's backlog when their batch is
  launched; it holds the lane only by delaying later launches (that work really happens on other
  threads, at arrival and answer: what matters is the host's total load). Fitted against the 33
  raw-launch mix6 points of runs 11-16, collapses included, it is best at 0 as well: mean |goodput
  error| 0.114 at 0, 0.125 at 0.1 ms, 0.164 at 0.12, 0.233 at 0.15
  (``docs/results/runtime/sim_calibration_host_request.json``). The measured collapse is not a
  fixed capacity: the same point swings by 0.1-0.2 of attainment between runs. Off by default.
* **Host per arrival** (``host_arrival_ms``): the same one host, busy this long for every request
  that enters, whether it is served, late or dropped (a request refused by admission is not
  charged). ``host_request_ms`` charges only requests that run; on the overloaded mix 75% of them
  were dropped at their deadlines, each after costing the interpreter a queue entry, a wake-up and
  an answer (runs 50-51, sixteenth session). Off by default.
* **Host per drop** (``host_drop_ms``): the same one host, busy this long for every request a
  decision drops, after that decision's batches are launched (the runtime answers a decision's drops
  after its launches, ``GPULOOM_LAUNCH_FIRST``). A drop delays only the launches that come after it,
  so a load that drops nothing pays nothing: unlike ``host_arrival_ms`` and ``gil_request_ms``, which
  fitted the overloaded mix but slowed light3 and mix6 too (sixteenth and fifty-third sessions). Why:
  at overload nexus drops about ten requests per request it serves, and its one lane waited for the
  loop between a batch's return and the next launch 0.36-0.39 ms per batch (run 183, H100); told
  that time beside the measured hold, the simulator came within 7.5-11% of nexus's goodput there,
  against 26-31% with the holds alone. Off by default.
* **Drops that yield** (``drop_yield_ms``, ``drop_answer_ms``): the runtime's
  ``GPULOOM_YIELD_ANSWERS``, where the answering of a decision's drops stops for a batch that finished
  meanwhile and launches the next first. Of each drop's ``host_drop_ms``, its answer
  (``drop_answer_ms``) then goes on the one host after its other work, and a launch waits behind at
  most ``drop_yield_ms`` of those answers (the loop looks for finished batches every 0.2 ms of
  answering), their rest moving back by the launch's own time; the drop's other host time (its
  intake, the decisions it sits through) stays ahead of later launches as without the option.
  ``drop_yield_ms=None`` (default): a launch waits for every drop answered before it. Why: the option
  served 29% and 43% more at the overload (runs 202-203); charged as before, the simulator put the
  host's per-drop time 0.046 ms with it against 0.053-0.055 without on the same host, and yielding
  the whole per-drop time put it 53-57% above the measured whatever the time (the answers are 9-11 us
  of the ~50 us a drop costs the host there).
* **Shared interpreter** (``gil_request_ms``, ``gil_batch_ms``): not a queue but a share. Every
  request that enters and every batch launched costs the interpreter this much; over the last
  :data:`GIL_WINDOW_MS` that is its load ``rho`` (at most :data:`GIL_RHO_MAX`), and every batch's
  turnaround (its batch overhead) is stretched by ``1 / (1 - rho)``, as the waits of threads that
  take turns on one lock grow with its load. On the H200 the turnaround grew from 0.5 ms to 2-7 ms
  on the overloaded mix (run 50). Fitted (sixteenth session), 0.06 ms per request and 0.6 per batch
  bring the overloaded mix from a mean goodput error of 1.17 to 0.28, but make mix6 and light3 far
  too slow (mean 0.21); no one setting fits all three. Off by default.

Utilization: a batch *uses* ``min(partition SMs, knee)`` SMs on an exclusive partition (SMs past the
knee do not make it faster); shared batches together use ``min(A, K)``. ``busy_sm_ms`` integrates
that over time.

Defaults (``demand_fraction=1``, ``efficiency=1``, ``interference=0``) are the plain knee model. Checked
against DESIGN.md's one H200 sharing measurement they are *harsher* on shared streams than the
hardware (see :meth:`ContentionModel.design_h200`, ``demand_fraction=0.89``, which fits it); report
both.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from ..profile.store import Profile
from .backend import Backend
from .events import COMPLETION, EventLoop
from ..policy.types import Completion, Decision, Layout, Partition, Request


#: the shared interpreter's load is measured over this many ms of simulated time ...
GIL_WINDOW_MS = 50.0
#: ... and capped here (a turnaround stretched at most 1 / (1 - 0.95) = 20x)
GIL_RHO_MAX = 0.95
#: a dropped request's answer on the one host, ms: the part of ``host_drop_ms`` that yields with the
#: runtime's GPULOOM_YIELD_ANSWERS (``drop_answer_ms``); runs 202-203 (an H100, the overload's nexus)
#: answered 9.2-11.1 us per request
DROP_ANSWER_MS = 0.010
#: how a shared batch's demand is measured (:attr:`ContentionModel.demand`)
DEMANDS = ("knee", "area")


@dataclass(frozen=True)
class ContentionModel:
    """Parameters of the simulator's sharing model (see the module docstring)."""

    knee_eps: float = 0.1  # a batch demands knee(b, knee_eps) SMs when it shares the GPU
    demand_fraction: float = 1.0  # ... times this: the share of its knee a shared batch really occupies
    #: what a shared batch demands: "knee" (``demand_fraction`` times its knee) or "area" (the SMs its
    #: profile's most efficient SM count would keep busy over its whole-GPU time; see the module docstring)
    demand: str = "knee"
    area_min_sms: int = 16  # "area": the fewest SMs the most efficient count is looked for from
    efficiency: float = 1.0  # fraction of the shared SMs delivered when oversubscribed (0, 1]
    #: how the slowdown grows with oversubscription: ``(demand / (efficiency * SMs)) ** shared_exponent``
    #: (1: linear, the shared SMs' throughput stays whole; above 1 it falls as more batches share them)
    shared_exponent: float = 1.0
    interference: float = 0.0  # slowdown per other co-running batch (any partition), >= 0
    switch_ms: float = 0.0  # time until a new layout's partitions accept work, ms
    batch_overhead_ms: float = 0.0  # per batch, a lane's time not on the GPU: host launch + completion turnaround
    host_launch_ms: float = 0.0  # per batch, time of the ONE host thread that launches every batch (serialized)
    host_request_ms: float = 0.0  # per request of a batch, time of that same host (the interpreter, serialized)
    host_arrival_ms: float = 0.0  # per request that enters (served, late or dropped), time of that same host
    host_drop_ms: float = 0.0  # per request a decision drops, time of that same host (after its launches)
    #: None: a launch waits for every drop answered before it; ms: it waits behind at most this much of
    #: their answers (GPULOOM_YIELD_ANSWERS, see "Drops that yield" above) ...
    drop_yield_ms: float | None = None
    drop_answer_ms: float = 0.0  # ... each drop's answer, the part of host_drop_ms that yields
    gil_request_ms: float = 0.0  # per request that enters, interpreter time that stretches every turnaround
    gil_batch_ms: float = 0.0  # per batch launched, likewise (see "Shared interpreter" above)
    model_overhead_ms: tuple[tuple[str, float], ...] = ()  # (model, ms): batch_overhead_ms for that model
    #: (model, weight): oversubscribed shared lanes are slowed unevenly, each getting SMs in proportion
    #: to its demand times its weight (1 where not given; never more than its demand), so a lane of
    #: weight 2 slows half as much as one of weight 1. Empty: one factor for every lane, as before.
    #: Why: past triton's edge the card slowed bert_base 2.7x its profile and the CNNs 4.4-5.5x
    #: (``scripts/diag_sim_per_model.py``, fifty-first session)
    share_weights: tuple[tuple[str, float], ...] = ()
    hold_spread: float = 0.0  # lognormal sigma of each batch's hold around its mean (0: constant)
    hold_per_ms: float = 0.0  # more hold per ms of the batch's GPU time (as profiled at its launch)
    hold_per_request_ms: float = 0.0  # more hold per request of the batch
    seed: int = 0  # of the holds' draws (hold_spread > 0)

    def __post_init__(self) -> None:
        if not (0.0 < self.efficiency <= 1.0):
            raise ValueError(f"ContentionModel.efficiency must be in (0, 1], found {self.efficiency}")
        if not (0.0 < self.demand_fraction <= 1.0):
            raise ValueError(f"ContentionModel.demand_fraction must be in (0, 1], found {self.demand_fraction}")
        if self.demand not in DEMANDS:
            raise ValueError(f"ContentionModel.demand must be one of {', '.join(DEMANDS)}, found {self.demand!r}")
        if self.area_min_sms < 1:
            raise ValueError(f"ContentionModel.area_min_sms must be >= 1, found {self.area_min_sms}")
        if self.drop_yield_ms is not None and not self.drop_yield_ms >= 0.0:
            raise ValueError(f"ContentionModel.drop_yield_ms must be None or >= 0, found {self.drop_yield_ms}")
        if not 0.0 <= self.drop_answer_ms <= self.host_drop_ms:
            raise ValueError("ContentionModel.drop_answer_ms (the yielding part of host_drop_ms) must be in "
                             f"[0, host_drop_ms={self.host_drop_ms}], found {self.drop_answer_ms}")
        if not self.shared_exponent >= 1.0:
            raise ValueError(f"ContentionModel.shared_exponent must be >= 1, found {self.shared_exponent}")
        if min(self.interference, self.knee_eps, self.switch_ms, self.batch_overhead_ms, self.host_launch_ms,
               self.host_request_ms, self.host_arrival_ms, self.host_drop_ms, self.gil_request_ms, self.gil_batch_ms,
               self.hold_spread, self.hold_per_ms, self.hold_per_request_ms) < 0:
            raise ValueError(
                "ContentionModel: knee_eps, interference, switch_ms, batch_overhead_ms, host_launch_ms, "
                "host_request_ms, host_arrival_ms, host_drop_ms, gil_request_ms, gil_batch_ms, hold_spread, "
                "hold_per_ms and hold_per_request_ms must be >= 0, "
                f"found {self.knee_eps}, {self.interference}, {self.switch_ms}, {self.batch_overhead_ms}, "
                f"{self.host_launch_ms}, {self.host_request_ms}, {self.host_arrival_ms}, {self.host_drop_ms}, "
                f"{self.gil_request_ms}, {self.gil_batch_ms}, {self.hold_spread}, {self.hold_per_ms}, "
                f"{self.hold_per_request_ms}"
            )
        bad = [(m, ms) for m, ms in self.model_overhead_ms if not (isinstance(m, str) and ms >= 0)]
        if bad:
            raise ValueError(f"ContentionModel.model_overhead_ms: expected (model name, ms >= 0) pairs, found {bad}")
        bad = [(m, w) for m, w in self.share_weights if not (isinstance(m, str) and w > 0)]
        if bad:
            raise ValueError(f"ContentionModel.share_weights: expected (model name, weight > 0) pairs, found {bad}")

    def overhead_ms(self, model: str) -> float:
        """The batch overhead of ``model``'s batches: its own where given, else ``batch_overhead_ms``."""
        for m, ms in self.model_overhead_ms:
            if m == model:
                return ms
        return self.batch_overhead_ms

    @classmethod
    def design_h200(cls) -> "ContentionModel":
        """Fitted to DESIGN.md's one H200 sharing measurement (resnet50 b8, mobilenet_v2 b8,
        efficientnet_b0 b8, BERT-base b1, 50 rounds each): four plain streams took 1.10x the time of
        partitions sized to the work (277 vs 251 ms). With the shipped H200 profiles the default model
        predicts 1.23x (260 vs 212 ms): whole-knee demands overstate what a shared batch occupies.
        ``demand_fraction=0.89`` reproduces 1.10x (the one-at-a-time time, 1.45x the partitions', is
        matched by the profiles alone). One measurement, one parameter: issue 5 should refit on more
        mixes.
        """
        return cls(demand_fraction=0.89)

    @classmethod
    def h200_runs(cls) -> "ContentionModel":
        """Fitted to the H200 bench runs (``scripts/calibrate_sim.py --rank within``, 35 points: mix6
        runs 66/67/70, its deadline variant run 135, light3 run 54): each batch holds its lane 0.75 ms
        plus 0.1 ms per ms of its GPU time beyond its GPU work, one host thread spends 0.15 ms
        launching each batch, and a shared batch occupies 0.89 of its knee. 33 of the 35 goodputs
        within 10%, worst 20.6% (light3's triton), mean 4.5%
        (``docs/results/runtime/sim_calibration_session45_hold_per_ms.json``, forty-fifth session).
        The forty-third session's fixed 1.125 ms hold with 0.1 ms of launching host fitted 31 (light3's
        dstack and nexus 16-17% low); it is ``--batch-overhead-ms 1.125 --hold-per-ms 0
        --host-launch-ms 0.1`` on top of this preset. Both are far off on the overloaded mix, where
        the host is the limit.
        """
        return cls(demand_fraction=0.89, batch_overhead_ms=0.75, hold_per_ms=0.1, host_launch_ms=0.15)

    @classmethod
    def h100_fast_host(cls) -> "ContentionModel":
        """Fitted to an H100 whose host turns a batch around quickly (runs 171-175, fifty-second
        session: mix6, light3 and the overloaded mix, every policy; ``scripts/calibrate_sim.py --rank
        within``): :meth:`h200_runs` with each batch holding its lane 0.35 ms instead of 0.75 ms (plus
        the same 0.1 ms per ms of GPU time). 75 of 91 goodputs within 10% against the H200 preset's 65:
        light3's nexus and temporal, one lane each, 24-55% short with the longer hold, come within
        10% but one (``docs/results/runtime/sim_calibration_session52_h100_runs171_175.json``). The
        card measured the same: its lanes held a batch 0.20-0.25 ms beyond its GPU time (the median
        over every lane of every point held, ``scripts/host_holds.py``). On runs 167 and 169 (mix6,
        not fitted; a host whose lanes held 0.52-0.66 ms) 17 of 20 within 10% against the H200
        preset's 18, as on the H200 runs (0.60-0.69 ms): the hold is the host's, and 12 of the 16
        runs with holds recorded held 0.45-0.69 ms, so the bench keeps ``h200``.

        Since the fifty-sixth session each request a decision drops also costs the one host 0.04 ms
        (``host_drop_ms``; ``docs/results/runtime/sim_calibration_session56_host_drop_h100_runs173_183_186_187.json``):
        on the overloaded mix nexus drops about ten requests for each it serves, and without it the
        simulator put nexus 42-47% above the measured (runs 173 and 183); with it 3-8%, and 51 of 57
        points of runs 173, 183, 186 and 187 within 10% against 48. Points that drop nothing do not
        move. Not in :meth:`h200_runs`: no overload run of the current runtime on an H200 yet.
        """
        return replace(cls.h200_runs(), batch_overhead_ms=0.35, host_drop_ms=0.04)

    def shared_factor(self, demand_sms: float, shared_sms: float) -> float:
        """How many times slower shared batches run when together they demand ``demand_sms``."""
        return max(1.0, demand_sms / (self.efficiency * shared_sms)) ** self.shared_exponent

    def shared_factors(self, lanes: Sequence[tuple[str, float]], shared_sms: float) -> list[float]:
        """Each of ``lanes`` (``(model, demanded SMs)``, sharing ``shared_sms``) slowed by how many
        times: :meth:`shared_factor` for all alike without :attr:`share_weights`; with them, the
        delivered SMs (``efficiency * shared_sms``) go to the lanes in proportion to demand times
        weight, none getting more than it demands (the rest goes to the others)."""
        total = sum(d for _, d in lanes)
        if not self.share_weights or total <= self.efficiency * shared_sms:
            return [self.shared_factor(total, shared_sms)] * len(lanes)
        weights = dict(self.share_weights)
        w = [weights.get(m, 1.0) for m, _ in lanes]
        left, open_ = self.efficiency * shared_sms, [i for i, (_, d) in enumerate(lanes) if d > 0]
        got = [0.0] * len(lanes)
        while open_:  # water-filling: a lane whose share would exceed its demand gets its demand
            k = left / sum(lanes[i][1] * w[i] for i in open_)
            full = [i for i in open_ if k * w[i] >= 1.0]
            if not full:
                for i in open_:
                    got[i] = k * w[i] * lanes[i][1]
                break
            for i in full:
                got[i] = lanes[i][1]
                left -= lanes[i][1]
            open_ = [i for i in open_ if i not in full]
        return [max(1.0, d / g) ** self.shared_exponent if g > 0 else 1.0 for (_, d), g in zip(lanes, got)]

    def interference_factor(self, n_running: int) -> float:
        return 1.0 + self.interference * max(0, n_running - 1)


#: the ``--contention`` presets fitted on measured runs, by name (``plain``, the bare model, is not one)
FITTED_PRESETS: dict[str, Callable[[], ContentionModel]] = {"h200": ContentionModel.h200_runs,
                                                             "h100-fast-host": ContentionModel.h100_fast_host}


class _Run:
    """A batch in flight (mutable bookkeeping, private to the simulator)."""

    __slots__ = ("decision", "part", "start", "base", "demand", "useful", "remaining", "rate", "version", "seq", "tail",
                 "independent")

    def __init__(self, decision: Decision, part: Partition, start: float, base: float, demand: float, useful: float,
                 tail: float = 0.0):
        self.decision = decision
        self.part = part
        self.start = start
        self.base = base  # ms it takes uncontended
        self.demand = demand  # SMs it demands from the shared pool (shared lanes only)
        self.useful = useful  # SMs it can use (utilization)
        self.remaining = 1.0  # fraction of its work left
        self.rate = 0.0  # fraction per ms
        self.version = 0
        self.seq = 0  # submission order, breaks priority ties
        self.tail = tail  # ms the lane stays held after the GPU work (batch_overhead_ms), SMs free
        self.independent = False  # its speed neither depends on nor changes the others' (SimBackend._independent)


class SimBackend(Backend):
    """Runs batches on a simulated clock using latency profiles and a :class:`ContentionModel`.

    ``profiles`` maps model name -> :class:`Profile`. Deterministic: the only draws (the holds'
    spread, :attr:`ContentionModel.hold_spread`) come from a generator seeded by the model.
    """

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        *,
        gpu_sms: int | None = None,
        granularity: int | None = None,
        contention: ContentionModel | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("SimBackend needs at least one profile")
        first = next(iter(profiles.values()))
        self.profiles = dict(profiles)
        self.gpu_sms = int(gpu_sms or first.gpu.sm_count)
        self.granularity = int(granularity or first.gpu.sm_granularity)
        self.contention = contention or ContentionModel()
        self.loop = EventLoop()
        self._on_completion: Callable[[Completion], None] | None = None
        self._layout: Layout | None = None
        self._running: dict[int, _Run] = {}  # partition index -> run (one batch per partition)
        self._orphans: list[_Run] = []  # batches of a previous layout still draining
        self._held: dict[int, _Run] = {}  # partition index -> run whose GPU work is done, lane still held
        self._held_orphans: list[_Run] = []  # the same, of a previous layout
        self._orphan_pool = 0  # SMs the orphans' shared lanes shared (the layout they were launched on)
        self._t_last = 0.0
        self._busy_now = 0.0  # SMs in use since _t_last
        self._busy = 0.0  # integrated SM-ms
        self._knee: dict[tuple[str, int], int] = {}
        self._area: dict[tuple[str, int, float], float] = {}  # see demand_sms
        self._lat: dict[tuple[str, int, float], float] = {}
        self._excl: dict[tuple[str, int, int], tuple[float, float]] = {}  # see _exclusive
        # model -> how long its batches hold their lane after their GPU work (the batch overhead, ms)
        self._tails = {m: self.contention.overhead_ms(m) for m in self.profiles}
        self._holds = random.Random(self.contention.seed) if self.contention.hold_spread > 0 else None
        self._seq = 0
        self._dependent = 0  # runs whose speed depends on the others (shared lanes, or interference)
        self._launcher_free = 0.0  # when the one host launching thread is next free (host_launch_ms)
        # whether batches queue on that one host thread at all (off by default; see _through_host)
        self._arrival_ms = self.contention.host_arrival_ms
        self._gil = self.contention.gil_request_ms > 0.0 or self.contention.gil_batch_ms > 0.0
        self._gil_log: deque[tuple[float, float]] = deque()  # (time, interpreter ms) in the window
        self._gil_sum = 0.0
        self._drop_ms = self.contention.host_drop_ms
        self._drop_yield = self.contention.drop_yield_ms
        self._drops_end = 0.0  # when the one host's yielding answers of drops would end (drop_yield_ms)
        self._one_host = self.contention.host_launch_ms > 0.0 or self.contention.host_request_ms > 0.0 \
            or self._arrival_ms > 0.0 or self._drop_ms > 0.0

    # -- Backend ------------------------------------------------------------------------------
    def start(self, on_completion: Callable[[Completion], None]) -> None:
        self._on_completion = on_completion

    def _hold_factor(self) -> float:
        """One batch's hold over the mean hold: lognormal with sigma ``hold_spread`` and mean 1."""
        sigma = self.contention.hold_spread
        return math.exp(sigma * self._holds.gauss(0.0, 1.0) - 0.5 * sigma * sigma)

    def configure(self, layout: Layout) -> float:
        if layout.gpu_sms != self.gpu_sms:
            raise ValueError(f"layout made for {layout.gpu_sms} SMs, the simulated GPU has {self.gpu_sms}")
        if self._layout is not None and any(r.part.shared for r in self._running.values()):
            # shared batches of the old layout run on to the end on the SMs its lanes shared; a new
            # layout of exclusive partitions has none to share (dstack lanes=auto leaving shared lanes)
            self._orphan_pool = max(self._orphan_pool if self._orphans else 0, self._layout.shared_sms)
        self._orphans.extend(self._running.values())
        self._running = {}
        self._held_orphans.extend(self._held.values())
        self._held = {}
        self._layout = layout
        return self.loop.now + self.contention.switch_ms

    def partitions(self) -> Sequence[Partition]:
        return self._layout.partitions if self._layout else ()

    def submit(self, decision: Decision, requests: Sequence[Request]) -> None:
        assert self._layout is not None, "submit before configure"
        part = self._layout.partitions[decision.partition]
        assert decision.partition not in self._running and decision.partition not in self._held, \
            f"partition {decision.partition} is busy"
        b = decision.batch
        if part.shared:
            a = self._layout.shared_sms
            if decision.sms is not None:
                demand = float(min(decision.sms, a))
                base = self.latency(decision.model, b, demand)
            else:
                demand = float(min(self.demand_sms(decision.model, b, a) * self.contention.demand_fraction, a))
                base = self.latency(decision.model, b, a)
            useful = demand
        else:
            base, useful = self._exclusive(decision.model, b, part.sms)
            demand = 0.0
        # the tail: the lane is busy after the GPU work, the GPU is not; part of it grows with the batch
        tail = self._tails[decision.model] + self.contention.hold_per_ms * base \
            + self.contention.hold_per_request_ms * len(requests)
        if self._one_host:
            base = self._through_host(base, len(requests))
        self._settle()
        if self._holds is not None and tail > 0.0:
            tail *= self._hold_factor()
        if self._gil:
            self._gil_add(self.contention.gil_batch_ms)
            tail *= self._gil_stretch()
        run = _Run(decision, part, self.loop.now, base, demand, useful, tail)
        self._seq += 1
        run.seq = self._seq
        self._running[decision.partition] = run
        run.independent = self._independent(run)
        if run.independent:  # fast path: nobody else's speed changes
            run.rate = 1.0 / base
            run.version = 1
            self.loop.schedule(self.loop.now + base, COMPLETION, self._finish, run, 1)
            self._busy_now += useful
        else:
            self._dependent += 1
            self._rerate()

    def note_arrival(self) -> None:
        if self._arrival_ms > 0.0:  # the one host's backlog, which later launches wait behind
            self._host_ahead(self._arrival_ms)
        if self._gil:
            self._gil_add(self.contention.gil_request_ms)

    def note_drops(self, n: int) -> None:
        if self._drop_ms <= 0.0:
            return
        answer = 0.0 if self._drop_yield is None else self.contention.drop_answer_ms
        # answered after the decision's launches: later launches wait behind them ...
        self._host_ahead((self._drop_ms - answer) * n)
        if answer > 0.0:  # ... but for the answers that yield: after everything else, launches overtake them
            self._drops_end = max(self._launcher_free, self._drops_end) + answer * n

    def _host_ahead(self, ms: float, start: float | None = None) -> None:
        """``ms`` of the one host's work from ``start`` (when it is next free) on, ahead of the yielding
        answers of drops still due, which move back by as much."""
        start = max(self.loop.now, self._launcher_free) if start is None else start
        if self._drops_end > start:
            self._drops_end += ms
        self._launcher_free = start + ms

    def _gil_add(self, ms: float) -> None:
        if ms > 0.0:
            self._gil_log.append((self.loop.now, ms))
            self._gil_sum += ms

    def _gil_stretch(self) -> float:
        """``1 / (1 - rho)``: the shared interpreter's load over the last window stretches turnarounds."""
        log, start = self._gil_log, self.loop.now - GIL_WINDOW_MS
        while log and log[0][0] < start:
            self._gil_sum -= log.popleft()[1]
        rho = min(GIL_RHO_MAX, max(0.0, self._gil_sum) / GIL_WINDOW_MS)
        return 1.0 / (1.0 - rho)

    def _through_host(self, base: float, n_requests: int) -> float:
        """``base`` (ms the batch holds its lane) plus what the one host thread delays it by
        (``host_launch_ms``, ``host_request_ms``, and the arrivals' ``host_arrival_ms`` already in its
        backlog): FIFO, the batch waits for the host's backlog, then launches. Only with ``_one_host``."""
        h = self.contention.host_launch_ms
        start = max(self.loop.now, self._launcher_free)
        own = h + self.contention.host_request_ms * n_requests
        if self._drops_end > start:  # drops' answers due (drop_yield_ms): the launch waits for the loop
            start += min(self._drops_end - start, self._drop_yield)  # to look, and their rest for it
        self._host_ahead(own, start)  # the requests' share adds to the backlog ...
        return base + start - self.loop.now + h  # ... but holds the lane only through what it delays

    def _independent(self, run: _Run) -> bool:
        """An exclusive batch without interference neither slows nor is slowed by anything."""
        return not run.part.shared and self.contention.interference == 0.0

    def busy_sm_ms(self) -> float:
        self._settle()
        return self._busy

    # -- profile lookups (cached: the hot path of a simulation) ------------------------------
    def knee(self, model: str, batch: int) -> int:
        key = (model, batch)
        k = self._knee.get(key)
        if k is None:
            k = self._knee[key] = self.profiles[model].knee(batch, self.contention.knee_eps)
        return k

    def demand_sms(self, model: str, batch: int, pool: float) -> float:
        """SMs a shared batch demands on a pool of ``pool`` SMs, before ``demand_fraction``: its knee,
        or (``demand="area"``) its smallest SM-time on ``area_min_sms``..``pool`` SMs over its time on the
        pool: the SMs it keeps busy on average if the SMs it could use no better were free to others."""
        if self.contention.demand == "knee":
            return float(self.knee(model, batch))
        key = (model, batch, pool)
        v = self._area.get(key)
        if v is None:
            area = self.profiles[model].min_sm_time(batch, self.contention.area_min_sms, pool)
            v = self._area[key] = min(float(pool), area / self.latency(model, batch, pool))
        return v

    def latency(self, model: str, batch: int, sms: float) -> float:
        key = (model, batch, sms)
        v = self._lat.get(key)
        if v is None:
            v = self._lat[key] = self.profiles[model].latency(batch, sms)
        return v

    def _exclusive(self, model: str, batch: int, sms: int) -> tuple[float, float]:
        """(ms, SMs it can use) of a batch alone on an exclusive partition of ``sms`` SMs: one look-up
        per batch submitted, where the latency and the knee took one each."""
        key = (model, batch, sms)
        v = self._excl.get(key)
        if v is None:
            v = self._excl[key] = (self.latency(model, batch, sms), float(min(sms, self.knee(model, batch))))
        return v

    # -- progress bookkeeping ----------------------------------------------------------------
    def _all_runs(self):
        yield from self._running.values()
        yield from self._orphans

    def _settle(self) -> None:
        """Advance every run's progress and the utilization integral to ``now``."""
        now = self.loop.now
        dt = now - self._t_last
        if dt > 0:
            if self._dependent:  # independent runs finish at their scheduled time; no progress to track
                for r in self._all_runs():
                    r.remaining -= r.rate * dt
            self._busy += self._busy_now * dt
        self._t_last = now

    def _rerate(self) -> None:
        """Recompute every run's speed after the running set changed; reschedule changed finishes."""
        runs = list(self._all_runs())
        cm = self.contention
        layout = self._layout
        left = float(layout.shared_sms if layout else self.gpu_sms)
        if self._orphans and any(r.part.shared for r in self._orphans):
            left = max(left, float(self._orphan_pool))  # the old layout's shared SMs, while its batches drain
        inf = cm.interference_factor(len(runs))
        now = self.loop.now
        speeds: list[tuple[_Run, float]] = []
        busy = 0.0
        prio = sorted(
            (r for r in runs if r.part.shared and r.decision.priority is not None),
            key=lambda r: (r.decision.priority, r.seq),
        )
        for r in prio:  # prioritized shared batches take SMs first, up to their demand
            s = min(r.demand, left)
            left -= s
            busy += s
            speeds.append((r, 0.0 if s <= 0 else 1.0 / (self._slowed(r, s) * inf)))
        demand = 0.0
        plain = []
        for r in runs:
            if not r.part.shared:
                speeds.append((r, 1.0 / (r.base * inf)))
                busy += r.useful
            elif r.decision.priority is None:
                plain.append(r)
                demand += r.demand
        if plain:
            if left <= 0:
                factors = [float("inf")] * len(plain)
            elif len(plain) == 1:  # a batch alone is never slowed
                factors = [1.0]
            elif cm.share_weights:
                factors = cm.shared_factors([(r.decision.model, r.demand) for r in plain], left)
            else:  # one factor for all (the usual case)
                factors = [cm.shared_factor(demand, left)] * len(plain)
            for r, sf in zip(plain, factors):
                speeds.append((r, 1.0 / (r.base * inf * sf)))
            busy += min(left, demand)
        for r, rate in speeds:
            if rate != r.rate:
                r.rate = rate
                r.version += 1
                if rate > 0:
                    self.loop.schedule(now + max(0.0, r.remaining) / rate, COMPLETION, self._finish, r, r.version)
        self._busy_now = busy

    def _slowed(self, r: _Run, sms: float) -> float:
        """Uncontended time (ms) of ``r``'s batch on ``sms`` SMs (at most its demand)."""
        if sms >= r.demand:
            return r.base
        prof = self.profiles[r.decision.model]
        lo = prof.sms[0]
        if sms >= lo:
            return prof.latency(r.decision.batch, sms)
        return self.latency(r.decision.model, r.decision.batch, lo) * lo / sms

    def _finish(self, run: _Run, version: int) -> None:
        """The batch's GPU work is done: its SMs are free; the lane is released now, or after its tail."""
        if version != run.version:
            return  # superseded by a re-rate
        self._settle()
        run.remaining = 0.0
        current = self._running.get(run.decision.partition) is run
        if current:
            del self._running[run.decision.partition]
        else:
            self._orphans.remove(run)
        if run.independent:
            self._busy_now -= run.useful
        else:
            self._dependent -= 1
            self._rerate()
        if run.tail > 0.0:
            if current:
                self._held[run.decision.partition] = run
            else:
                self._held_orphans.append(run)
            self.loop.schedule(self.loop.now + run.tail, COMPLETION, self._release, run)
            return
        self._complete(run)

    def _release(self, run: _Run) -> None:
        """The batch's tail is over: the lane takes work again."""
        if self._held.get(run.decision.partition) is run:
            del self._held[run.decision.partition]
        else:
            self._held_orphans.remove(run)
        self._complete(run)

    def _complete(self, run: _Run) -> None:
        assert self._on_completion is not None
        now = self.loop.now
        self._on_completion(Completion(run.decision, run.start, now, device_ms=now - run.start - run.tail))

    def running(self) -> int:
        """Batches in flight (including those of a replaced layout)."""
        return len(self._running) + len(self._orphans) + len(self._held) + len(self._held_orphans)
