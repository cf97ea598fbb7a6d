"""The runtime: per-model request queues and the loop that feeds a policy and a backend.

The loop is one idea: *handle every event of this instant, then let the policy decide*. Events are
arrivals (scheduled here), completions (scheduled by the backend) and policy wake-ups. Everything
else is a named helper. The same loop drives the simulated backend and (issue 5) the GPU backend:
the backend's :class:`~gpuloom.runtime.events.EventLoop` decides whether time jumps or passes.

Books are kept per request: every request that arrives ends the run SERVED, DROPPED (with the
policy's reason), FAILED (with the backend's error) or still QUEUED; :meth:`Runtime.run` asserts the
sum.

Two ways to drive it:

* :meth:`Runtime.run` replays a precomputed, sorted list of requests (simulation, experiments);
* online serving (:meth:`Runtime.start` / :meth:`Runtime.submit` / :meth:`Runtime.stop`): the loop runs
  in its own thread on a :class:`~gpuloom.runtime.events.RealtimeLoop`, other threads submit
  requests, and every request's :class:`Result` (with the backend's output) goes to a callback. The
  policy cannot tell the two apart. :meth:`Runtime.reconfigure` swaps in a new policy/model set
  (model load and unload) while serving.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..policy.base import Policy, PolicyContext, PolicyError
from ..policy.types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status, TraceEntry
from .admission import TokenBucket
from .backend import Backend
from .events import ARRIVAL, WAKEUP, RealtimeLoop

log = logging.getLogger(__name__)

#: Online mode: called on the runtime's thread with each request's final Result and the backend's
#: output for it (None unless SERVED by a backend that produces data).
ResultCallback = Callable[[Result, Any], None]
#: Online mode, optional: called instead of ResultCallback where several requests are answered at
#: once (a batch completes, a policy drops a block), with their (Result, output) pairs in order.
ResultsCallback = Callable[[list], None]

_INF = float("inf")
# the statuses as module constants: the loop reads them per request (an Enum attribute costs more)
_SERVED, _DROPPED, _FAILED, _QUEUED = Status.SERVED, Status.DROPPED, Status.FAILED, Status.QUEUED


def _describe(layout: Layout) -> str:
    """One line for the log: each partition's SMs and, where it has one, the model it is for."""
    parts = []
    for p in layout.partitions:
        name = p.label or f"p{p.index}"
        if p.owner is not None and not p.label.startswith(p.owner):  # a shared lane's label names it already
            name += f" {p.owner}"
        parts.append(name + (" (shared)" if p.shared else ""))
    return f"{len(parts)} partition{'s' if len(parts) != 1 else ''}: " + ", ".join(parts)


def _has_index(parts: Sequence[Partition], index: int) -> bool:
    """Whether one of ``parts`` has ``index`` (a plain loop: a generator under any() cost the
    simulator 3% of its time, once per batch)."""
    for p in parts:
        if p.index == index:
            return True
    return False


@dataclass
class RunRecord:
    """Everything a run produced; metrics are computed from it (``gpuloom.bench.metrics``)."""

    policy: str
    results: list[Result]  # one per request, by request id
    until_ms: float  # arrivals were generated up to here
    end_ms: float  # the clock when the run stopped (after draining)
    gpu_sms: int
    busy_sm_ms: float  # useful SM-milliseconds (see the backend)
    layouts: list[tuple[float, Layout]]  # (time, layout) every time the layout changed
    dispatches: int  # batches submitted
    trace: list[TraceEntry] = field(default_factory=list)  # only with trace=True

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)


#: the longest a hosted runtime's loop runs events in one go before the host's other work (HTTP: reading
#: the next requests, health checks) gets a turn (Runtime.host_on); one CPU batch alone may take longer
PUMP_SLICE_S = 0.001

#: run()'s drop reason for a request refused at its model's ``queue_limit`` (the service's ``Overloaded``)
OVERLOADED = "overloaded"

#: yielding answers (GPULOOM_YIELD_ANSWERS=1): a decision's drops are answered in chunks of at most
#: this many requests (a completed batch's answers stay one call: over HTTP each call is a reply to
#: the workers, and run 192 chunked those too), and after at least YIELD_CHECK_S of answering the
#: loop asks its backend whether a batch has finished meanwhile (Backend.completion_due); if so it
#: stops, books that batch and launches the partition's next before answering the rest. A check
#: queries each batch in flight (a few us each): the interval keeps that under about a tenth of the
#: answering it interrupts
YIELD_CHUNK = 8
YIELD_CHECK_S = 0.0002
#: ... and when it stopped, the loop comes back to the rest this long after (ms) if no completion has
#: run by then: it sleeps meanwhile, so a watcher thread waiting for the GIL to post gets it (a thread
#: wake-up is 20 us on the H100s' hosts, and the watcher copies the outputs before it posts)
YIELD_RESUME_MS = 0.3


def launches_first(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (the process's by default) leaves launch-first on: all but
    ``GPULOOM_LAUNCH_FIRST=0`` (a backend whose submit runs a batch whole has it off regardless)."""
    env = os.environ if environ is None else environ
    return env.get("GPULOOM_LAUNCH_FIRST", "1") != "0"


#: GPULOOM_YIELD_ANSWERS where it is not set: on since the sixty-fifth session. Reports made before
#: ran with it off and recorded it only when set (:data:`REPORT_YIELD_DEFAULT`)
YIELD_DEFAULT = "1"
#: ... so a report's settings without the key read as off; reports since record it always
#: (``gpuloom.bench.machine.gpuloom_settings``)
REPORT_YIELD_DEFAULT = "0"


def yields_answers(environ: Mapping[str, str] | None = None, *, default: str = YIELD_DEFAULT) -> bool:
    """Whether ``environ`` (the process's by default) has the runtime yield answers:
    ``GPULOOM_YIELD_ANSWERS=1`` (``default`` where it is not set; any other value is off, as before the
    default changed), with launch-first on (the option
    stops only the answers that launch-first puts after a decision's launches). A bench report's
    simulation reads its recorded settings through this with ``default=REPORT_YIELD_DEFAULT``, as the
    runtime reads its own (``ContentionModel.drop_yield_ms``)."""
    env = os.environ if environ is None else environ
    return env.get("GPULOOM_YIELD_ANSWERS", default) == "1" and launches_first(env)


def _resume_answers() -> None:
    """A wake-up of the loop: the event itself does nothing; the answers a finished batch interrupted
    go on after it (``Runtime._after_event``)."""


def _running_loop() -> Any:
    """The asyncio event loop running on the calling thread, or None."""
    import asyncio

    return asyncio._get_running_loop()


class Runtime:
    """Drives ``policy`` against ``backend`` over a list of requests.

    ``ctx`` describes the models (profiles, SLOs, rates); ``trace=True`` records every event for tests.
    """

    def __init__(self, policy: Policy, backend: Backend, ctx: PolicyContext, *, trace: bool = False) -> None:
        self.policy = policy
        self.backend = backend
        self.ctx = ctx
        self.loop = backend.loop
        self.queues: dict[str, deque[Request]] = {m: deque() for m in ctx.models}
        self._trace_on = trace
        self.trace: list[TraceEntry] = []
        self._results: dict[int, Result] = {}
        self._pending: dict[int, Request] = {}  # queued, not yet dispatched or dropped
        # partition -> its batches (decision, requests, policy), the running one first; a second one
        # only with launch-ahead (see _open_lane)
        self._inflight: dict[int, list[tuple[Decision, list[Request], Policy]]] = {}
        self._open_at: dict[int, float] = {}  # partition running one batch -> when it takes the next
        #: launch-ahead (ms): an exclusive partition takes its next batch this long before its running
        #: batch is predicted to end, so the device runs them back to back while the host turns round
        self.lookahead_ms = float(getattr(backend, "lookahead_ms", 0.0))
        self._parts: Sequence[Partition] = ()
        self._ready_ms = 0.0  # the current layout accepts work from here (and once old batches drain)
        self._orphans = 0  # batches of a previous layout still running
        self._orphan_reqs: dict[int, tuple[list[Request], Policy]] = {}  # id(decision) -> its requests, policy
        self._layout_token = 0  # the latest layout asked for; a prepared older one is not swapped in
        self._preparing = False  # a backend is building the next layout (no dispatch meanwhile)
        self._switch_pending = False  # a reconfigure's layout is being built while the old policy serves
        self._held_layout: Layout | None = None  # what the old policy re-planned to while a switch was pending
        #: a re-plan's layout that a policy with ``defers_layout_change`` proposed and still decides
        #: without: it hears of it in ``adopt_layout`` once it is set up
        self._proposed: Layout | None = None
        #: the policy whose layout the current ``on_layout`` call reports (the new one, when a
        #: reconfigure's layout failed and the old policy goes on)
        self.layout_policy: Policy = policy
        self._broken = ""  # online: why the last layout failed (requests fail at once until a new one works)
        # online mode (start/submit/stop); unused by run()
        self._online = False
        self._on_result: ResultCallback | None = None
        self._on_results: ResultsCallback | None = None
        self._on_layout: Callable[[Layout, BaseException | None], None] | None = None
        self._submit_lock = threading.Lock()
        self._refused: dict[str, int] = {}  # model -> requests refused at submission, for the policy
        self._buckets: dict[str, TokenBucket] = {}  # run(): admission at the policy's admit_rps
        self._note_arrival = backend.note_arrival  # run(): the simulator's host cost per request
        self._note_drops = backend.note_drops  # ... and per request a decision dropped
        self._next_id = 0
        self._queue_limit: int | None = None  # run(): requests of a model queued or running before refusal
        self._closed = False  # no more submissions
        self._closing = False  # the loop exits once everything entered is answered
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # online serving has ended (the loop exited, answered everything)
        #: host_on: the event loop (asyncio's interface) that steps this runtime's loop instead of its thread
        self._host: Any = None
        self._host_timer: Any = None  # the host's call for the next timed event
        self._pump_queued = False
        self._step_lock = threading.Lock()  # held by whoever steps the loop: the runtime's thread, or one pump
        self._host_lock = threading.Lock()  # guards the hand-overs: _host and _thread_stepping
        self._thread_stepping = False  # a thread of the runtime's steps the loop (or is about to)
        self._want_host: Any = None  # the host the last host_on asked for (a take_back since cancels it)
        self._last_ms = 0.0  # _account's last reading
        self.error: BaseException | None = None  # what stopped the online loop, if it crashed
        self.idle: dict[str, float] = {"queued_ms": 0.0, "idle_queued_ms": 0.0, "idle_ms": 0.0, "total_ms": 0.0}
        self._wake_ms = float("inf")
        self._stop_ms = float("inf")  # no dispatch after this
        self._layouts: list[tuple[float, Layout]] = []
        self._dispatches = 0
        self._free: list[Partition] | None = None  # cache of the free partitions
        self._woke = True  # a wake-up fired (or the run just started): poll the policy's timers
        #: online: completed batches' results, and requests a decision dropped, not yet answered. A
        #: completion frees its partition and the loop decides (launches that partition's next batch)
        #: before it answers them, and a decision launches its batches before it answers its drops,
        #: unless the backend's submit runs a batch whole (``Backend.submit_blocks``) or
        #: GPULOOM_LAUNCH_FIRST=0 (for an A/B): the answers, an HTTP reply each, then do not keep the
        #: partition idle
        self._answers_due: list[list[Result]] = []
        self._launch_first = launches_first() and not getattr(backend, "submit_blocks", False)
        #: GPULOOM_YIELD_ANSWERS (on unless 0): the answers held back stop for a batch that
        #: finished meanwhile (_answer_due). Why: at overload a decision's dozens of drops, answered
        #: after its launch, kept a short batch that completed meanwhile on its lane (mobilenet_v2's
        #: hold 0.7 -> 1.5 ms, run 183). Measured on an H100 (run 192, a very slow host): nexus's lane
        #: held 0.14-0.24 ms less per batch but served no more (1,148 / 1,132 against 1,155 req/s), and
        #: over HTTP mix6 kept 0.290 of in-process goodput against 0.506 without (one pair: the chunks
        #: are more answer calls, each a reply to the HTTP workers; since then only drops are chunked).
        #: In process at the overload since: +15% (run 196), -12% (198), +29% and +43% (202-203).
        #: On by default since HTTP and mix6 were measured with it (H100, runs 205-206): over HTTP two
        #: pairs at mix6 x1, 0.726 / 0.634 of in-process goodput against 0.563 / 0.787 without (means
        #: 0.680 / 0.675); in process dstack +0.8% and triton +2.9% at x1.0625 (dstack held it only with)
        self._yield_answers = self._launch_first and yields_answers()
        self.answer_yields = 0  # times the answers stopped for a finished batch
        # online: the loop's wall time handing results to their callers, and how many (what a
        # dropped request costs the host, which the simulator's host_drop_ms charges: fitted per host
        # before, 0.04-0.06 ms, runs 173-198; now measured in every point)
        self.answer_ms = 0.0
        self.answered = 0
        # and taking requests in (queued, or answered at once): with the answers, the host's work per
        # request apart from its batches' (the loop's whole CPU per request is mostly per-batch work
        # where few requests drop: run 164's mix6 72-98 us against the overload's 16-28)
        self.intake_ms = 0.0
        self.taken_in = 0

    # -- the loop ---------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], *, until_ms: float, drain_ms: float = 0.0,
            queue_limit: int | None = None) -> RunRecord:
        """Serve ``requests`` (sorted by arrival, arrivals <= ``until_ms``).

        The policy may dispatch until ``until_ms + drain_ms``; batches running then are allowed to
        finish; whatever is still queued is reported QUEUED.

        ``queue_limit``: a request that arrives while this many of its model's are queued or running
        is refused (DROPPED, reason ``"overloaded"``), as the service refuses it with ``Overloaded``
        (``InferenceService(queue_limit=...)``); None refuses none.
        """
        self._check_requests(requests, until_ms)
        if queue_limit is not None and (not isinstance(queue_limit, int) or queue_limit < 1):
            raise ValueError(f"queue_limit must be a positive int or None, got {queue_limit!r}")
        self._queue_limit = queue_limit
        self.backend.start(self._on_completion)
        self._set_layout(self.policy.setup(self.ctx))
        self._stop_ms = until_ms + drain_ms
        if requests:
            self.loop.schedule(requests[0].arrival_ms, ARRIVAL, self._on_arrival, requests, 0)
        loop = self.loop
        stop = self._stop_ms
        while loop.step():
            now = loop.now
            if now <= stop and loop.peek() != now:
                self._decide()
        return self._record(requests, until_ms)

    # -- online serving ---------------------------------------------------------------------
    def start(
        self,
        on_result: ResultCallback,
        *,
        on_layout: Callable[[Layout, BaseException | None], None] | None = None,
        on_results: ResultsCallback | None = None,
    ) -> None:
        """Serve online: run the loop in a background thread until :meth:`stop`.

        Needs a backend on a :class:`RealtimeLoop`. ``on_result(result, output)`` is called on the
        loop's thread once per submitted request (SERVED, DROPPED or FAILED; never QUEUED) -- keep it
        short (set a future). ``on_results(answers)``, when given, takes its place where several
        requests are answered at once (a batch's completion, a drop): one call with their
        ``(result, output)`` pairs, in order, so the receiver can book them in one go (one lock, not
        one per request). ``on_layout(layout, error)`` is called whenever a layout was set up (or
        failed to be). The policy is set up from ``ctx`` on the loop's thread.
        """
        if not isinstance(self.loop, RealtimeLoop):
            raise TypeError(f"online serving needs a backend on a RealtimeLoop; {type(self.backend).__name__} "
                            f"runs on {type(self.loop).__name__} (use Runtime.run for simulated time)")
        if self._thread is not None:
            raise RuntimeError("Runtime.start was called twice")
        self._online = True
        self._on_result = on_result
        self._on_results = on_results
        self._on_layout = on_layout
        self.loop.open()
        self._thread_stepping = True
        self._thread = threading.Thread(target=self._serve, name=f"gpuloom-runtime-{self.policy.name}", daemon=True)
        self._thread.start()

    def submit(self, model: str, payloads: Sequence[Any] = (None,), *, timeout_ms: float) -> list[Request]:
        """Thread-safe: enqueue one request per entry of ``payloads`` for ``model``; returns them.

        Each request arrives now and is due ``timeout_ms`` later (its deadline, what policies drop
        by). ``payloads`` go to the backend (:meth:`Backend.attach`): the input rows of each request.
        Raises RuntimeError after :meth:`stop`. An unknown model is answered DROPPED("unknown model").
        """
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the runtime is stopped; it takes no more requests")
            now = self.loop.wall_ms()
            deadline = now + float(timeout_ms)
            attach = self.backend.attach
            reqs = []
            for p in payloads:
                r = Request(self._next_id, model, now, deadline)
                self._next_id += 1
                if p is not None:
                    attach(r.id, p)
                reqs.append(r)
            self.loop.post(ARRIVAL, self._on_online_arrivals, reqs)
        return reqs

    def cancel(self, request_ids: Sequence[int], reason: str) -> None:
        """Thread-safe: those of ``request_ids`` still queued leave their queues, answered
        DROPPED(``reason``); the others are left as they are (in a batch, or answered). The service
        cancels the requests it answered as expired, so that they take no GPU time after."""
        self.loop.post(WAKEUP, self._cancel, tuple(request_ids), reason)

    def _cancel(self, request_ids: tuple[int, ...], reason: str) -> None:
        by_model: dict[str, list[int]] = {}
        for rid in request_ids:
            r = self._pending.get(rid)
            if r is not None:
                by_model.setdefault(r.model, []).append(rid)
        for model, ids in by_model.items():  # a drop the policy did not decide: answered as its drops are
            self._drop(Drop(model, tuple(ids), reason))

    def is_queued(self, request_id: int) -> bool:
        """Any thread: whether the request waits in its model's queue (not yet in a batch, dropped or
        answered); a moment's answer (one dict lookup, atomic in CPython)."""
        return request_id in self._pending

    def note_refused(self, model: str, n: int) -> None:
        """Thread-safe: ``n`` requests of ``model`` were refused before :meth:`submit` (the policy's
        ``admit_rps``); the policy hears of them with the next arrivals (``on_refused``)."""
        with self._submit_lock:
            self._refused[model] = self._refused.get(model, 0) + n

    def reconfigure(self, policy: Policy, ctx: PolicyContext) -> None:
        """Thread-safe: serve ``ctx.models`` with ``policy`` (a fresh object) from now on.

        New models get queues; requests still queued for models that left ``ctx`` are DROPPED
        ("model unloaded"). Batches running finish; their requests are answered as usual.
        """
        self.loop.post(WAKEUP, self._reconfigure, policy, ctx)

    def stop(self, *, drain: bool = True, timeout_s: float = 30.0) -> bool:
        """Stop serving; returns True when every request entered was answered.

        ``drain=True``: the policy keeps dispatching until the queues are empty (at most
        ``timeout_s``), then whatever is left is DROPPED("shutdown"). ``drain=False``: queued requests
        are DROPPED("shutdown") at once. Running batches always finish (their wait is bounded by
        ``timeout_s`` too).
        """
        with self._submit_lock:
            self._closed = True
        if self._thread is None:
            return True
        self.loop.post(WAKEUP, self._begin_close, drain)
        if not self._wait_done(timeout_s) and drain:
            self.loop.post(WAKEUP, self._begin_close, False)
            self._wait_done(max(1.0, timeout_s))
        self.loop.shut()
        return self._done.is_set()

    def _wait_done(self, timeout_s: float) -> bool:
        """Wait until serving ended. A host that stopped running (its event loop ended before this
        runtime did), or whose own thread waits here, hands the loop back to a thread of the
        runtime's own, which finishes the work."""
        end = time.monotonic() + timeout_s
        while True:
            host = self._host
            if host is not None and (host.is_closed() or not host.is_running() or _running_loop() is host):
                self.take_back()
            if self._done.wait(max(0.0, min(0.05, end - time.monotonic()))):
                return True
            if time.monotonic() >= end:
                return False

    @property
    def layout_swaps(self) -> int:
        """Layouts switched to so far, the first included (each switch drains the running batches)."""
        return len(self._layouts)

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def _serve(self, resume: bool = False) -> None:
        """The runtime's thread: step the loop until serving ends, or until :meth:`host_on` handed it
        to a host (then it returns, nothing ended). ``resume``: taken back from a host."""
        loop = self.loop
        handed = False
        with self._step_lock:  # (a pump still running on the host finishes its slice first)
            try:
                if not resume:
                    self.backend.start(self._on_completion)
                    self._set_layout(self.policy.setup(self.ctx))
                    self._stop_ms = float("inf")
                    self._last_ms = loop.wall_ms()
                while loop.step():
                    if self._after_event():
                        break
                    if self._host is not None:  # _hand_over ran: hand the loop over, unless taken back since
                        with self._host_lock:
                            if self._host is not None:
                                self._thread_stepping = False
                                self._pump_queued = False  # (a pump queued on an earlier host will never run)
                                loop.host_by(self._pump_soon)
                                handed = True
                        if handed:
                            break
            except BaseException as e:  # noqa: BLE001 - answer every request, then report
                self._end_crashed(e)
                return
            if not handed:
                self._ended()
                return
        self._pump_soon()  # the step lock is free: the host's first pump takes it

    def _after_event(self) -> bool:
        """After each event: decide (unless another event is due at the same time), integrate the
        idle time; True once a stop has everything answered."""
        loop = self.loop
        if loop.peek() != loop.now:
            if loop.cpu is None:  # (charge() checks too; this spares a call per step)
                self._decide()
                if self._answers_due:
                    self._answer_due(self._yield_answers)
            else:  # InferenceService.loop_cpu: the decisions are most of the loop's own work
                loop.charge(self._decide)
                if self._answers_due:
                    loop.charge(self._answer_due, self._yield_answers)
        self._last_ms = self._account(self._last_ms)
        return self._closing and self._all_answered()

    def _end_crashed(self, e: BaseException) -> None:
        """The loop crashed: fail every request it holds, then end (whatever the failing raises)."""
        try:
            self._crashed(e)
        finally:
            self._ended()

    def _crashed(self, e: BaseException) -> None:
        loop = self.loop
        log.exception("the runtime loop crashed", exc_info=e)
        self.error = e
        msg = f"runtime loop crashed: {type(e).__name__}: {e}"
        self._answer_due()  # batches that completed are answered with their outputs, not failed
        self._fail_pending(msg)
        for lane in list(self._inflight.values()):
            for d, reqs, _ in lane:
                for r in reqs:
                    self._finish(Result(r, Status.FAILED, loop.now, msg))
        self._inflight = {}
        for reqs, _ in list(self._orphan_reqs.values()):
            for r in reqs:
                self._finish(Result(r, Status.FAILED, loop.now, msg))
        self._orphan_reqs = {}

    def _ended(self) -> None:
        with self._submit_lock:
            self._closed = True
        with self._host_lock:
            host, self._host = self._host, None
            self.loop.host_by(None)
        timer, self._host_timer = self._host_timer, None
        if timer is not None and host is not None and _running_loop() is host:
            timer.cancel()  # (it would only find the loop ended, but it keeps this runtime alive till then)
        self.loop.shut()
        self._done.set()

    # -- hosted on another event loop ---------------------------------------------------------
    def host_on(self, host: Any) -> None:
        """Thread-safe: run this runtime's loop on ``host``, an asyncio event loop running on its own
        thread, instead of on the runtime's thread, from the next event on.

        Why: a request submitted from the host's thread (an HTTP handler) is then decided and, with
        an inline launch, computed on that thread, and its future completed there: no hand-off to
        the runtime's thread and back per request (as KServe runs a model on its event loop). The
        price: the host's other work waits while a batch runs. Only for loops nobody else sleeps on:
        no other process posts the waker, no device posts it (the CPU device with inline launches).
        If the host stops before the runtime does, :meth:`stop` gives the loop back to a thread.
        """
        if self._thread is None:
            raise RuntimeError("host_on needs a started runtime (Runtime.start)")
        with self._host_lock:
            self._want_host = host
        self.loop.post(WAKEUP, self._hand_over, host)

    @property
    def hosted(self) -> bool:
        """Whether a host's event loop steps this runtime's loop now (:meth:`host_on`)."""
        return self._host is not None

    def on_host_thread(self) -> bool:
        """Whether the caller runs on the thread of the event loop hosting this runtime's loop."""
        host = self._host
        return host is not None and _running_loop() is host

    def _hand_over(self, host: Any) -> None:
        with self._host_lock:
            if (self._done.is_set() or self._host is not None or not self._thread_stepping
                    or self._want_host is not host):  # (a take_back since host_on cancelled it)
                return
            self._host = host  # _serve sees it after this event and returns; the host's first pump follows

    def _pump_soon(self) -> None:
        """Any thread: have the host run :meth:`_pump` (once for a burst of posts)."""
        host = self._host
        if host is None or (self._pump_queued and not host.is_closed()):  # (a closed host runs none)
            return
        self._pump_queued = True
        try:
            if _running_loop() is host:
                host.call_soon(self._pump)
            else:
                host.call_soon_threadsafe(self._pump)
        except RuntimeError:  # the host's loop is closed: a thread of the runtime's takes the loop back
            self._pump_queued = False
            log.warning("the event loop hosting the runtime's loop is closed; a thread of the runtime's steps it again")
            self.take_back()

    def _pump(self) -> None:
        """On the host's thread: run the events due now (for at most ``PUMP_SLICE_S`` past the first),
        then ask the host to call again when the next timed one is due (posts call back through
        :meth:`_pump_soon`)."""
        self._pump_queued = False
        host = self._host
        if host is None or _running_loop() is not host:  # taken back or ended (or a call left on an old host)
            return
        if not self._step_lock.acquire(blocking=False):  # the runtime's thread is finishing its last event
            host.call_later(0.0005, self._pump)
            return
        loop = self.loop
        yield_at = time.perf_counter() + PUMP_SLICE_S
        try:
            while True:
                if self._host is not host:  # taken back meanwhile (stop() from another thread)
                    return
                wait_ms = loop.ready_in()
                if wait_ms is None:
                    break
                if wait_ms > 0.0:
                    timer = self._host_timer
                    if timer is not None:
                        timer.cancel()
                    self._host_timer = None if wait_ms == float("inf") else host.call_later(wait_ms / 1000.0, self._pump)
                    return
                loop.run_next()
                if self._after_event():
                    break
                if time.perf_counter() > yield_at:  # (a batch ran) the host's own work goes first, then on
                    self._pump_queued = True
                    host.call_soon(self._pump)
                    return
            self._ended()  # (under the step lock: no take_back may start a stepper on an ended loop)
        except BaseException as e:  # noqa: BLE001 - answer every request, then report
            self._end_crashed(e)
        finally:
            self._step_lock.release()

    def take_back(self) -> None:
        """Thread-safe: give the loop back to a thread of the runtime's own, if a host steps it
        (:meth:`host_on`): when the host stops, or must stay free while the runtime drains (a server's
        graceful stop answers new connections meanwhile). The new thread starts stepping once the
        host's current pump, if any, has returned."""
        with self._host_lock:
            self._want_host = None
            if self._host is None:
                return
            self._host = None
            self._pump_queued = False
            self.loop.host_by(None)
            if self._thread_stepping:  # the runtime's thread has not handed over yet: it just goes on
                return
            self._thread_stepping = True
            self._thread = threading.Thread(target=self._serve, args=(True,),
                                            name=f"gpuloom-runtime-{self.policy.name}", daemon=True)
            self._thread.start()

    def _account(self, last: float) -> float:
        """Integrate idle time: with requests queued, and with no batch running at all (ms)."""
        now = self.loop.wall_ms()
        dt = now - last
        running = bool(self._inflight) or self._orphans > 0
        acc = self.idle
        acc["total_ms"] += dt
        if not running:
            acc["idle_ms"] += dt
        if self._pending:
            acc["queued_ms"] += dt
            if not running:
                acc["idle_queued_ms"] += dt
        return now

    def _all_answered(self) -> bool:
        return not self._pending and not self._inflight and not self._orphans and not self._answers_due

    def _answer_due(self, can_yield: bool = False) -> None:
        """Answer the requests held back while the loop decided (completed batches' and dropped
        ones, oldest first). ``can_yield``: drops in chunks, stopping once a batch has finished
        meanwhile (``YIELD_CHUNK``); the rest stays due, answered after the loop has booked that batch
        and decided, or ``YIELD_RESUME_MS`` later."""
        due, self._answers_due = self._answers_due, []
        if not can_yield:
            for results in due:
                self._finish_all(results)
            return
        clock, ready = time.perf_counter, self.backend.completion_due
        checked = clock()
        i = 0
        while i < len(due):
            results = due[i]
            if len(results) > YIELD_CHUNK and results[0].status is _DROPPED:
                part, due[i] = results[:YIELD_CHUNK], results[YIELD_CHUNK:]
            else:
                part = results
                i += 1
            self._finish_all(part)
            if i < len(due) and clock() - checked >= YIELD_CHECK_S:
                if ready():
                    # (answers held back while these were answered come after them: oldest first)
                    self._answers_due = due[i:] + self._answers_due
                    self.answer_yields += 1
                    loop = self.loop  # (a wall-clock loop's now is when this event began)
                    now = max(loop.now, loop.wall_ms()) if isinstance(loop, RealtimeLoop) else loop.now
                    loop.schedule(now + YIELD_RESUME_MS, WAKEUP, _resume_answers)
                    return
                checked = clock()

    def _on_online_arrivals(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        self._take_arrivals(reqs)
        self.intake_ms += (time.perf_counter() - t0) * 1000.0
        self.taken_in += len(reqs)

    def _take_arrivals(self, reqs: list[Request]) -> None:
        if self._refused:
            with self._submit_lock:
                refused, self._refused = self._refused, {}
            for m, n in refused.items():
                self.policy.on_refused(m, n, self.loop.now)
        for r in reqs:
            if self._closing and not self._drain:
                self._finish(Result(r, Status.DROPPED, self.loop.now, "shutdown"))
            elif r.model not in self.queues:
                self._finish(Result(r, Status.DROPPED, self.loop.now, "unknown model"))
            elif self._broken:
                self._finish(Result(r, Status.FAILED, self.loop.now, self._broken))
            else:
                _enqueue(self.queues[r.model], r, self.policy.deadline_queues)
                self._pending[r.id] = r
                self.policy.on_arrival(r, self.loop.now)

    def _reconfigure(self, policy: Policy, ctx: PolicyContext) -> None:
        """Serve ``ctx`` with ``policy``. Where the backend builds while serving and a layout is up,
        the old policy keeps dispatching on the old layout until the new one is built, then both
        switch at once (:meth:`_switch`): a model loaded or unloaded does not stop the others for
        the build. Else the switch is immediate and nothing is dispatched until the build is done."""
        if self.policy is not policy:
            policy.carry_over(self.policy)  # what the old one measured of this host and GPU
        try:
            layout = policy.setup(ctx)
        except Exception as e:  # noqa: BLE001 - no plan for the new model set: the current one goes on
            # (a model loaded with rate_hint .inf crashed the loop here, and every model with it)
            log.error("no layout for %s: %s: %s; the current one goes on", sorted(ctx.models), type(e).__name__, e)
            self._report_layout(policy, None, e)
            return
        if not (self.backend.builds_while_serving and self._parts and not self._preparing and not self._broken):
            self._switch(policy, ctx, None, 0, first=layout)
            return
        token, building = self._build_in_background(layout, functools.partial(self._switch, policy, ctx))
        if building:
            self._switch_pending = True
            return
        self._switch(policy, ctx, layout, token)

    def _switch(self, policy: Policy, ctx: PolicyContext, layout: Layout | None, token: int,
                first: Layout | None = None) -> None:
        """Make ``policy`` and ``ctx`` current; then set up ``layout`` (already built under ``token``),
        or, when None, the policy's first layout (``first`` where the caller has it already)."""
        ready_ms = None
        if layout is not None:
            if token != self._layout_token:
                return  # a newer reconfigure or layout was asked for while this one was being built
            self._switch_pending = False
            held, self._held_layout = self._held_layout, None
            try:
                ready_ms = self.backend.configure(layout)
            except Exception as e:  # noqa: BLE001 - the old policy and layout go on serving
                log.error("layout %s could not be set up: %s; the current one goes on", layout, e)
                self._woke = True
                if self.policy.defers_layout_change and self._proposed is not None:
                    # the old policy re-planned before or during this build (whose token made that
                    # build's answer stale): build its layout now, serving on the current one
                    self._preparing = False
                    self._prepare_replan(self._proposed)
                elif held is not None:  # the old policy re-planned meanwhile: give it its layout now
                    self._set_layout(held)
                else:
                    self._preparing = False
                self._report_layout(policy, layout, e)
                return
        for m in list(self.queues):
            if m not in ctx.models:
                q = self.queues.pop(m)
                for r in q:
                    self._pending.pop(r.id, None)
                    self._finish(Result(r, Status.DROPPED, self.loop.now, "model unloaded"))
        for m in ctx.models:
            self.queues.setdefault(m, deque())
        if policy.deadline_queues != self.policy.deadline_queues:  # the queues in the new policy's order
            for q in self.queues.values():
                _reorder(q, policy.deadline_queues)
        self.policy, self.ctx = policy, ctx
        self._proposed = None  # a re-plan of the replaced policy
        self._parts, self._free = (), None  # the old layout's indices mean nothing to the new policy
        self._woke = True
        if layout is None:
            self._set_layout(first if first is not None else policy.setup(ctx))
        else:
            self._preparing = False
            self._adopt_layout(layout, ready_ms)

    _drain = True

    def _begin_close(self, drain: bool) -> None:
        self._closing = True
        self._drain = drain
        self._woke = True
        if not drain:
            for q in self.queues.values():
                for r in list(q):
                    self._pending.pop(r.id, None)
                    self._finish(Result(r, Status.DROPPED, self.loop.now, "shutdown"))
                q.clear()

    def _fail_pending(self, msg: str) -> None:
        for q in self.queues.values():
            for r in list(q):
                self._pending.pop(r.id, None)
                self._finish(Result(r, Status.FAILED, self.loop.now, msg))
            q.clear()

    # -- event handlers ---------------------------------------------------------------------
    def _on_arrival(self, requests: Sequence[Request], i: int) -> None:
        r = requests[i]
        if i + 1 < len(requests):
            self.loop.schedule(requests[i + 1].arrival_ms, ARRIVAL, self._on_arrival, requests, i + 1)
        admit = self.policy.admit_rps
        if admit and r.model in admit:  # refused at submission, as the service does (admission.py)
            bucket = self._buckets.get(r.model) or self._buckets.setdefault(r.model, TokenBucket())
            if not bucket.take(admit[r.model], 1, self.loop.now / 1000.0):
                self.policy.on_refused(r.model, 1, self.loop.now)
                self._finish(Result(r, Status.DROPPED, self.loop.now, "shed"))
                return
        q = self.queues[r.model]
        limit = self._queue_limit
        if limit is not None and len(q) + self._running(r.model) >= limit:  # refused at submission
            self._finish(Result(r, Status.DROPPED, self.loop.now, OVERLOADED))
            return
        self._note_arrival()
        _enqueue(q, r, self.policy.deadline_queues)
        self._pending[r.id] = r
        if self._trace_on:
            self._log("arrive", r.model, r.id)
        self.policy.on_arrival(r, self.loop.now)

    def _running(self, model: str) -> int:
        """``model``'s requests in batches still running (the current layout's and earlier ones')."""
        n = 0
        for lane in self._inflight.values():
            for d, reqs, _ in lane:
                if d.model == model:
                    n += len(reqs)
        for reqs, _ in self._orphan_reqs.values():
            if reqs and reqs[0].model == model:
                n += len(reqs)
        return n

    def _on_completion(self, c: Completion) -> None:
        d = c.decision
        lane = self._inflight.get(d.partition)
        k = self._lane_position(lane, d)
        if k < 0:  # a batch of a replaced layout
            self._orphans -= 1
            reqs, pol = self._orphan_reqs.pop(id(d))
        else:
            _, reqs, pol = lane.pop(k)
            if lane:  # the batch launched ahead runs now
                self._open_lane(d.partition, self.loop.now)
            else:
                del self._inflight[d.partition]
                self._open_at.pop(d.partition, None)
            self._free = None
        status = _FAILED if c.error else _SERVED
        end_ms, error, batch = c.end_ms, c.error, d.batch
        results = [Result(r, status, end_ms, error, batch) for r in reqs]
        if self._online and self._launch_first:
            self._answers_due.append(results)  # answered after the next decision (_after_event)
        else:
            self._finish_all(results)
        if self._trace_on:
            self._log("complete", d.model, d.partition, d.request_ids)
        if pol is self.policy:  # a replaced policy's batch means nothing to its successor
            if pol.wants_outcomes and not error:
                late = sum(r.deadline_ms < end_ms for r in reqs)
                pol.on_outcomes(d.model, len(reqs) - late, late, self.loop.now)
            pol.on_completion(c, self.loop.now)

    @staticmethod
    def _lane_position(lane: list | None, d: Decision) -> int:
        """Where batch ``d`` is in its partition's lane; -1 when it is not there (a batch of a
        replaced layout). Almost always the running batch, first: found without a search."""
        if not lane:
            return -1
        if lane[0][0] is d:
            return 0
        return next((i for i, e in enumerate(lane) if e[0] is d), -1)

    def _finish(self, result: Result) -> None:
        """Record a request's final fate (online: hand it and its output to the result callback)."""
        if self._online:
            answered = self._answer(result)
            try:
                self._on_result(*answered)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the loop
                log.exception("result callback failed for request %d", result.request.id)
        else:
            self._results[result.request.id] = result

    def _answer(self, result: Result) -> tuple[Result, Any]:
        """Online: ``result`` with its output from the backend (None unless SERVED)."""
        out = self.backend.take_output(result.request.id)  # also frees the request's input data
        return result, (out if result.status is _SERVED else None)

    def _finish_all(self, results: list[Result]) -> None:
        """:meth:`_finish` for requests answered together; online with ``on_results``, one call for all."""
        if not self._online:  # a run: only the books (one store per request, not one call)
            books = self._results
            for result in results:
                books[result.request.id] = result
            return
        t0 = time.perf_counter()
        answer_all = self._on_results
        if answer_all is None:
            for result in results:
                self._finish(result)
        else:
            answer = self._answer
            answers = [answer(result) for result in results]
            try:
                answer_all(answers)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the loop
                log.exception("result callback failed for requests %s", [r.request.id for r in results])
        self.answer_ms += (time.perf_counter() - t0) * 1000.0
        self.answered += len(results)

    def _on_wakeup(self, t: float) -> None:
        self._woke = True
        if t == self._wake_ms:
            self._wake_ms = float("inf")

    # -- deciding ---------------------------------------------------------------------------
    def _decide(self) -> None:
        now = self.loop.now
        free = self._free_partitions(now) if self._pending else None
        if free:
            taken: set[int] = set()
            dropped = 0
            for action in self.policy.decide(now, self.queues, free):
                if type(action) is Decision:
                    self._dispatch(action, free, taken)
                elif isinstance(action, Drop):
                    self._drop(action)
                    dropped += len(action.request_ids)
                else:
                    raise PolicyError(f"{self.policy.name}: decide returned {action!r}; expected Decision or Drop")
            if dropped:  # after the decision's launches, as launch-first answers them
                self._note_drops(dropped)
        elif not self._woke:
            return  # nothing the policy could act on, and no timer of its own fired
        self._woke = False
        # layout_change before next_wakeup: it may move the policy's own timers (dstack's next
        # re-plan check), and a wake-up asked for with the old ones was lost -- a request stayed
        # queued with nothing left to wake the loop (the service's expiry answered it 5 s late)
        layout = self.policy.layout_change()
        wake = self.policy.next_wakeup(now)
        if wake is not None and now < wake < self._wake_ms:
            self._wake_ms = wake
            self.loop.schedule(wake, WAKEUP, self._on_wakeup, wake)
        if layout is not None:
            defers = self.policy.defers_layout_change
            if defers:
                self._proposed = layout
            if self._switch_pending:
                # the old policy, about to be replaced, re-planned. Unless it defers its layout
                # changes, its decisions now name partitions of a layout not set up, so it stops
                # dispatching until the switch (or, should the switch fail, until its own layout is
                # built); one that defers goes on deciding for the current layout
                self._held_layout = layout
                if not defers:
                    self._preparing = True
                    self._free = None
            elif defers and self.backend.builds_while_serving and self._parts and not self._preparing and not self._broken:
                self._prepare_replan(layout)
            else:
                self._set_layout(layout)

    def _free_partitions(self, now: float) -> list[Partition]:
        if now < self._ready_ms or self._orphans or self._preparing or self._broken:
            return []
        if self._free is None:
            busy, open_at = self._inflight, self._open_at
            if open_at:  # launch-ahead: a partition running one batch may take the next already
                self._free = [p for p in self._parts
                              if p.index not in busy or (len(busy[p.index]) == 1 and open_at.get(p.index, _INF) <= now)]
            else:
                self._free = [p for p in self._parts if p.index not in busy]
        return self._free

    def _dispatch(self, d: Decision, free: list[Partition], taken: set[int]) -> None:
        if d.partition in taken or not _has_index(free, d.partition):
            raise PolicyError(f"{self.policy.name}: decision on partition {d.partition}, which is not free: {d}")
        if not d.request_ids or d.batch < len(d.request_ids):
            raise PolicyError(f"{self.policy.name}: a decision needs 1..batch requests, got {d}")
        reqs = self._take(d.model, d.request_ids)
        taken.add(d.partition)
        lane = self._inflight.setdefault(d.partition, [])
        lane.append((d, reqs, self.policy))
        if self.lookahead_ms > 0:
            self._open_lane(d.partition, self.loop.now)
        self._free = None
        self._dispatches += 1
        if self._trace_on:
            self._log("dispatch", d.model, d.partition, d.request_ids)
        self.backend.submit(d, reqs)

    def _open_lane(self, index: int, start_ms: float) -> None:
        """Launch-ahead: a partition running one batch takes the next ``lookahead_ms`` before that
        batch is predicted to end (its profiled latency from ``start_ms``).

        The next batch then waits on the device, not on the host: the completion's way back through
        the watcher and the loop, and the next launch, overlap the running batch. A policy's batch
        starts at most ``lookahead_ms`` (plus the profile's error) later than it assumed. Only
        exclusive partitions, whose latency the profile predicts; shared lanes' batches slow each
        other down by amounts no profile knows.
        """
        lane = self._inflight[index]
        part = self._parts[index] if index < len(self._parts) else None
        info = self.ctx.models.get(lane[0][0].model)
        if len(lane) != 1 or self.lookahead_ms <= 0 or part is None or part.shared or info is None:
            self._open_at.pop(index, None)  # no launch-ahead (and no stale time of an earlier batch)
            return
        d = lane[0][0]
        t = max(self.loop.now, start_ms + info.profile.latency(d.batch, part.sms) - self.lookahead_ms)
        self._open_at[index] = t
        self.loop.schedule(t, WAKEUP, self._on_lane_open, index, d)

    def _on_lane_open(self, index: int, d: Decision) -> None:
        lane = self._inflight.get(index)
        if lane is None or len(lane) != 1 or lane[0][0] is not d:
            return  # it finished, or another batch was launched ahead already
        self._free = None
        if lane[0][2] is self.policy:
            self.policy.on_free(index, self.loop.now)

    def _drop(self, drop: Drop) -> None:
        now, reason = self.loop.now, drop.reason
        results = [Result(r, _DROPPED, now, reason) for r in self._take(drop.model, drop.request_ids)]
        if self._online and self._launch_first:
            # answered after this decision's batches are launched (_after_event): a policy that drops
            # late requests before it dispatches (nexus drops dozens per batch at overload) assumed
            # its batch starts now; answering them first launched it 0.6 ms (p50) to 3 ms (p99) later
            # on the CPU (scripts/diag_overload_fake.py)
            self._answers_due.append(results)
        else:
            self._finish_all(results)
        if reason == "deadline" and self.policy.wants_outcomes:
            self.policy.on_outcomes(drop.model, 0, len(drop.request_ids), now)
        if self._trace_on:
            self._log("drop", drop.model, drop.request_ids, drop.reason)

    def _take(self, model: str, ids: tuple[int, ...]) -> list[Request]:
        """Remove ``ids`` from ``model``'s queue (fast when they are its head, as they usually are)."""
        q = self.queues.get(model)
        if q is None:
            raise PolicyError(f"{self.policy.name}: unknown model {model!r}; models: {list(self.queues)}")
        out = []
        for rid in ids:
            r = self._pending.pop(rid, None)
            if r is None or r.model != model:
                raise PolicyError(f"{self.policy.name}: request {rid} is not queued for {model!r}")
            out.append(r)
        if q[0] is out[0]:
            j = 0
        else:  # a block further down the queue (a policy passed over the oldest requests)
            j = q.index(out[0])
            q.rotate(-j)
        for r in out:
            if q and q[0] is r:
                q.popleft()
            else:
                q.remove(r)
        if j:
            q.rotate(j)
        return out

    # -- layouts ----------------------------------------------------------------------------
    def _build_in_background(self, layout: Layout, then: Callable[[Layout, int], None]) -> tuple[int, bool]:
        """Ask the backend to build ``layout`` in the background (:meth:`Backend.prepare`); ``then(layout,
        token)`` is posted to the loop once it is built. Returns the layout's token, and whether a build
        started (False: nothing to build, the caller sets ``layout`` up now)."""
        self._layout_token += 1
        token = self._layout_token
        loop = self.loop
        if not self.backend.prepare(layout, lambda: loop.post(WAKEUP, then, layout, token)):
            return token, False
        if isinstance(loop, RealtimeLoop):
            loop.expect()
        return token, True

    def _set_layout(self, layout: Layout) -> None:
        """Switch to ``layout``: at once, or -- when the backend builds it in the background
        (:meth:`Backend.prepare`) -- once it is built. Nothing is dispatched meanwhile: the policy's
        partition indices already name the new layout's partitions (a policy that defers its layout
        changes names the old ones until ``adopt_layout``, and dispatches nothing either)."""
        token, building = self._build_in_background(layout, self._swap_layout)
        if building:
            self._preparing = True
            self._free = None
            return
        self._swap_layout(layout, token)

    def _prepare_replan(self, layout: Layout) -> None:
        """A re-plan's ``layout`` is built in the background while the policy (which defers its
        layout changes) goes on dispatching on the current one; swapped in once built
        (:meth:`_replan_ready`). On the H200 a first build of mix6's graphs took about 30 s, every
        model paused for it before (``docs/reports/runtime.md``, fourth and twelfth sessions)."""
        if self._online:
            log.info("re-plan: building %s while the current layout serves", _describe(layout))
        token, building = self._build_in_background(layout, self._replan_ready)
        if not building:
            self._replan_ready(layout, token)  # nothing to build: set it up now, with a re-plan's fallback

    def _replan_ready(self, layout: Layout, token: int) -> None:
        """The re-plan's layout is built: swap it in; if it cannot be set up, the current one goes on."""
        self._woke = True
        if token != self._layout_token:
            return  # a newer layout or reconfigure was asked for while this one was being built
        try:
            ready_ms = self.backend.configure(layout)
        except Exception as e:  # noqa: BLE001 - the current layout and the policy's plan for it go on
            log.error("re-planned layout %s could not be set up: %s; the current one goes on", layout, e)
            if self._proposed is layout:
                self._proposed = None
                self.policy.layout_failed(layout)
            self._report_layout(self.policy, layout, e)
            return
        self._adopt_layout(layout, ready_ms)

    def _swap_layout(self, layout: Layout, token: int) -> None:
        self._woke = True
        if token != self._layout_token:
            return  # a newer layout was asked for while this one was being built
        self._preparing = False
        try:
            ready_ms = self.backend.configure(layout)
        except Exception as e:
            if not self._online:
                raise
            log.error("layout %s could not be set up: %s", layout, e)
            self._broken = f"layout could not be set up: {type(e).__name__}: {e}"
            self._fail_pending(self._broken)
            self._report_layout(self.policy, layout, e)
            return
        self._adopt_layout(layout, ready_ms)

    def _report_layout(self, policy: Policy, layout: Layout | None, error: BaseException | None) -> None:
        self.layout_policy = policy
        if self._on_layout is not None:
            self._on_layout(layout, error)

    def _adopt_layout(self, layout: Layout, ready_ms: float) -> None:
        """``layout`` is configured (from ``ready_ms``): serve on it from now on."""
        self._broken = ""
        for lane in self._inflight.values():
            for d, reqs, pol in lane:
                self._orphan_reqs[id(d)] = (reqs, pol)
                self._orphans += 1
        self._inflight = {}
        self._open_at = {}
        self._free = None
        self._ready_ms = ready_ms
        self._parts = tuple(self.backend.partitions())
        self._layouts.append((self.loop.now, layout))
        if self._online:  # an operator's record of what serves on which SMs, and when it changed
            log.info("serving on layout %d: %s", len(self._layouts), _describe(layout))
        if self._trace_on:
            self._log("layout", tuple((p.sm_offset, p.sms, p.shared, p.owner) for p in layout.partitions))
        if self._ready_ms > self.loop.now:
            self.loop.schedule(self._ready_ms, WAKEUP, self._on_wakeup, self._ready_ms)
        if layout is self._proposed:  # the policy decides for it from now on
            self._proposed = None
            self.policy.adopt_layout(layout, self.loop.now)
        self._report_layout(self.policy, layout, None)

    # -- books ------------------------------------------------------------------------------
    def _check_requests(self, requests: Sequence[Request], until_ms: float) -> None:
        last = float("-inf")
        for r in requests:
            if r.model not in self.queues:
                raise ValueError(f"request {r.id} asks for {r.model!r}; the run serves {list(self.queues)}")
            if r.arrival_ms < last:
                raise ValueError(f"requests must be sorted by arrival_ms; request {r.id} arrives at {r.arrival_ms}")
            last = r.arrival_ms
        if requests and last > until_ms:
            raise ValueError(f"request arrives at {last} ms, after the run's end {until_ms} ms")
        if len({r.id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique")

    def _record(self, requests: Sequence[Request], until_ms: float) -> RunRecord:
        results = [self._results.get(r.id) or Result(r, _QUEUED) for r in requests]
        n_queued = sum(1 for r in results if r.status == _QUEUED)
        assert n_queued == len(self._pending) + sum(len(e[1]) for lane in self._inflight.values() for e in lane), "lost requests"
        assert len(results) == len(self._results) + n_queued, "a request was recorded twice or lost"
        return RunRecord(
            policy=self.policy.name,
            results=results,
            until_ms=until_ms,
            end_ms=self.loop.now,
            gpu_sms=self.backend.gpu_sms,
            busy_sm_ms=self.backend.busy_sm_ms(),
            layouts=self._layouts,
            dispatches=self._dispatches,
            trace=self.trace,
        )

    def _log(self, kind: str, *detail) -> None:
        self.trace.append(TraceEntry(self.loop.now, kind, detail))


def _enqueue(q: "deque[Request]", r: Request, by_deadline: bool) -> None:
    """Put ``r`` into its model's queue: at its end, or with ``by_deadline`` (the policy's
    ``deadline_queues``) where its deadline puts it, earliest first, ties in arrival order. Requests
    with the model's SLO arrive in deadline order, so that too is an append; one with a deadline of
    its own (a client's timeout) may go ahead of others."""
    if not by_deadline or not q or q[-1].deadline_ms <= r.deadline_ms:
        q.append(r)
        return
    i = bisect.bisect_right(q, r.deadline_ms, key=_deadline)
    q.insert(i, r)


def _reorder(q: "deque[Request]", by_deadline: bool) -> None:
    """Sort ``q`` in place by deadline (stable: ties keep their order) or back in arrival order, for a
    policy that keeps the other order than the one it replaces."""
    items = sorted(q, key=_deadline if by_deadline else _arrival)
    q.clear()
    q.extend(items)


def _arrival(r: Request) -> tuple[float, int]:
    return r.arrival_ms, r.id


def _deadline(r: Request) -> float:
    return r.deadline_ms
