"""The execution backend: runs a policy's decisions for real, on a :class:`DeviceLayer`.

Implements :class:`~gpuloom.runtime.backend.Backend` over the wall clock
(:class:`~gpuloom.runtime.events.RealtimeLoop`), so every policy runs unchanged on the GPU, on the
CPU, or on a fake device in tests. Threads:

* the **runtime's thread** calls :meth:`ExecBackend.submit`: it takes the requests' input rows,
  ``device.launch`` stages and enqueues the batch (asynchronous on CUDA) and hands the ticket to the
  partition's watcher;
* one **watcher thread per lane** blocks in ``device.finish`` (CUDA: a blocking-sync event; it sleeps,
  it does not spin), gives each request its own output rows, and posts the
  :class:`~gpuloom.policy.types.Completion` to the loop;
* a **builder thread** makes a new layout's lanes (partitions + captured graphs) when the runtime
  asks (:meth:`ExecBackend.prepare`); the runtime swaps the build in atomically once it is ready. It
  starts capturing only when no batch is in flight (the runtime dispatches nothing while a layout is
  being prepared): a CUDA graph capture must not race other threads' CUDA calls.

A model whose batch fails (at launch or while running) fails only that batch's requests, with the
error; everything else continues.

Measured (:meth:`ExecBackend.stats`): per partition device-busy time and batches; SM-ms of useful
work (``min(partition SMs, knee) x device ms``); host time spent dispatching (the dispatch overhead,
against device time); per request, the dispatch and finish times (in :class:`ExecOutput`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..policy.types import Completion, Decision, Layout, Partition, Request, Result, Status
from .backend import Backend
from .device import DeviceLayer, Lanes
from .events import COMPLETION, RealtimeLoop
from .loghist import LogHistogram

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecOutput:
    """What one served request gets back."""

    outputs: list[Any]  # numpy arrays, one per model output, this request's row (no batch dim)
    start_ms: float  # when its batch was dispatched (loop clock, ms)
    end_ms: float  # when its batch's outputs were on the host
    device_ms: float  # device time of its batch (CUDA events; wall time on CPU)
    batch: int  # rows in its batch


@dataclass
class PartitionStats:
    """Per lane of the current layout, since it was set up."""

    index: int
    label: str
    sms: int
    shared: bool
    batches: int = 0
    failures: int = 0
    device_ms: float = 0.0  # summed device time of its batches
    busy_ms: float = 0.0  # summed wall time from dispatch to outputs on the host
    # batches launched while the lane's previous one still ran (launch-ahead): on a GPU the next
    # batch is queued on the stream, so the lane does not idle between them, and busy - device is
    # only the completion's way back; for the others busy - device is the lane's idle turnaround
    ahead: int = 0
    ahead_busy_ms: float = 0.0
    ahead_device_ms: float = 0.0
    # each batch's busy - device ms (its hold beyond device time), for the tail the sums hide
    hold: LogHistogram = field(default_factory=LogHistogram)
    # the other half of a lane's idle time under load, which ``hold`` does not see: for each batch
    # whose oldest request already waited when the lane's previous batch reached the host, the ms
    # from then to this batch's submit (the loop's turnaround: its pollers, the completion's
    # callback, the decision; what launch-before-answering shortens; and a policy's own wait for a
    # fuller batch, where it has one)
    turnaround: LogHistogram = field(default_factory=LogHistogram)
    # each batch's ms from the loop's clock at its decision to its submit: the decision's own work
    # before the launch (requests a policy dropped, where answered first; the batches it decided
    # before this one), which a policy that plans from "now" (nexus's early drop) does not see
    submit_lag: LogHistogram = field(default_factory=LogHistogram)


class _Watcher:
    """One lane's completion thread: blocks on the device, never spins."""

    def __init__(self, backend: "ExecBackend", lanes: Lanes, index: int) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.last_end = 0.0  # when the lane's previous batch was done (a batch launched ahead starts then)
        self.last_submit: float | None = None  # when the runtime last submitted a batch to the lane
        self.thread = threading.Thread(target=self._run, args=(backend,), daemon=True,
                                       name=f"gpuloom-watch-{lanes.layout.partitions[index].label or index}")
        self.thread.start()

    def _run(self, backend: "ExecBackend") -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            work, args = item  # backend._complete (a launched batch) or backend._launch_on_lane
            work(self, *args)


def check_launch_on(launch_on: str) -> str:
    """``launch_on`` unchanged, or ValueError unless it is one of :attr:`ExecBackend.LAUNCH_ON`."""
    if launch_on not in ExecBackend.LAUNCH_ON:
        raise ValueError(f"launch_on must be one of {ExecBackend.LAUNCH_ON}, got {launch_on!r}")
    return launch_on


def check_complete_on(complete_on: str) -> str:
    """``complete_on`` unchanged, or ValueError unless it is one of :attr:`ExecBackend.COMPLETE_ON`."""
    if complete_on not in ExecBackend.COMPLETE_ON:
        raise ValueError(f"complete_on must be one of {', '.join(ExecBackend.COMPLETE_ON)}, got {complete_on!r}")
    return complete_on


def check_lookahead(lookahead_ms: float) -> float:
    """``lookahead_ms`` as a float, or ValueError unless it is >= 0."""
    if not lookahead_ms >= 0:
        raise ValueError(f"lookahead_ms must be >= 0 (0 turns launch-ahead off), got {lookahead_ms!r}")
    return float(lookahead_ms)


class ExecBackend(Backend):
    """A :class:`Backend` that executes batches on ``device`` (a :class:`DeviceLayer`).

    ``knee(model, batch)`` (SMs a batch can use) feeds the utilization figure; without it a batch is
    counted as using its whole partition. ``lookahead_ms``: the runtime's launch-ahead on exclusive
    partitions (:attr:`Backend.lookahead_ms`; 0 turns it off).

    ``launch_on``: which thread stages and launches a batch. ``"loop"`` (default): the runtime's own
    thread, in :meth:`submit`. ``"lane"``: the partition's watcher thread, which is idle then because
    without launch-ahead a partition holds one batch at a time. The runtime's thread only hands the
    decision over, so the launch's host time (0.25-0.4 ms on the H200) no longer queues behind
    every other partition's. With launch-ahead on, launches stay on the loop (a watcher is busy
    waiting for its running batch). ``"inline"``: the runtime's thread launches the batch *and waits
    for it* (``device.finish``), then books the completion as the watcher would; no thread hand-off
    per batch. Meant for the CPU path, where "waiting" is running the model, one batch at a time
    anyway on a small host: at a low rate each hand-off is a thread wake-up on the request's path
    (docs/reports/serving.md). The loop takes no arrival while a batch runs, so it suits a device
    whose batches are short; on CUDA it would block the loop on the GPU.
    """

    LAUNCH_ON = ("loop", "lane", "inline")
    #: ``complete_on``: who learns that a batch launched on the runtime's thread is done.
    #: ``"watcher"``: the lane's watcher thread sleeps on the batch's event, books it and posts the
    #: completion to the loop (two thread wake-ups per batch, each waiting for the GIL). ``"loop"``:
    #: the device posts the loop's waker itself when the batch is done (CUDA: a host function behind
    #: the batch, :meth:`DeviceLayer.notify`), and the runtime's thread books it; the watcher stays
    #: for devices and batches that cannot notify (eager batches, torch launches).
    COMPLETE_ON = ("watcher", "loop")
    #: with ``complete_on="loop"``, how often the loop looks at batches in flight even without a
    #: post (a safety net: a device's post is not expected to go missing)
    POLL_SAFETY_MS = 2.0

    #: default launch-ahead: off. A batch launched ahead is composed earlier, from fewer queued
    #: requests, so there are more, smaller batches, and each costs the runtime's thread its launch.
    #: - H200, in-process bench, same run (run 9): 1 ms halved dstack's idle time per batch and lowered
    #:   its p99 at every point; attainment +0.016 at x0.75, -0.006 at x0.5, even at x0.625.
    #: - CPU testbed charging each launch host time on the runtime's thread (scripts/diag_dstack_realtime.py
    #:   --host-ms 0.3, about 0.64 ms on the build VM: harsher than the H200's 0.25-0.4), two
    #:   repetitions: 1 ms cut x1 from 0.958-0.973 to 0.861-0.905 and x0.75 from 0.988-0.991 to
    #:   0.962-0.981, with 20-30% more batches. Without the host time: 0.996 vs 0.995.
    #: - H200 over HTTP behind 4 workers, whose bridge threads contend for the runtime's GIL: 0.51 of
    #:   in-process goodput at x0.25 with 1 ms, against 0.80 a session earlier without it (not a
    #:   same-run A/B).
    #: So it helps while the runtime's thread has time to spare and hurts when that thread is the
    #: bottleneck, as it is when serving over HTTP (docs/reports/runtime.md).
    DEFAULT_LOOKAHEAD_MS = 0.0

    def __init__(self, device: DeviceLayer, *, knee: Callable[[str, int], int] | None = None,
                 quiet_timeout_s: float = 60.0, lookahead_ms: float = DEFAULT_LOOKAHEAD_MS,
                 launch_on: str = "loop", complete_on: str = "watcher", waker: Any = None) -> None:
        """``waker``: what the loop sleeps on (``RealtimeLoop``'s; a service's own, shared with the HTTP
        workers, stays the same across the backends it makes)."""
        self.lookahead_ms = check_lookahead(lookahead_ms)
        self.launch_on = check_launch_on(launch_on)
        self.complete_on = check_complete_on(complete_on)
        # answer early: called on the watcher thread with each served request's Result and output as
        # soon as its batch is done, before the runtime's thread books the completion (it later calls
        # its result callback for the same request too; the receiver answers once)
        self.on_served: Callable[[Result, "ExecOutput"], None] | None = None
        self.device = device
        self.loop = RealtimeLoop(waker=waker)
        self.gpu_sms = device.gpu_sms
        self.granularity = device.granularity
        self.knee = knee
        self.quiet_timeout_s = quiet_timeout_s
        self._on_completion: Callable[[Completion], None] | None = None
        self._payloads: dict[int, Any] = {}  # request id -> its input rows (set by submitting threads)
        self._outputs: dict[int, ExecOutput] = {}  # request id -> its output (set by watchers)
        self._lock = threading.Condition()
        self._lanes: Lanes | None = None  # the current build
        self._watchers: dict[int, list[_Watcher]] = {}  # id(lanes) -> one per lane
        self._running: dict[int, int] = {}  # id(lanes) -> batches in flight on it
        self._retired: dict[int, Lanes] = {}  # id(lanes) -> builds replaced but still draining
        self._inflight = 0
        self._built: dict[int, tuple[Lanes | None, BaseException | None]] = {}  # id(layout) -> build
        self._wanted: Layout | None = None
        self._build_lock = threading.Lock()
        # measurements
        self.parts: list[PartitionStats] = []
        self._layout_t0 = 0.0
        self._layout_serial = 0  # layouts set up so far (PartitionStats count from the latest)
        self._busy_sm_ms = 0.0
        self.host_ms = 0.0  # time the runtime's thread spent in submit (dispatch overhead)
        self.device_ms = 0.0  # summed device time of every batch
        self.batches = 0
        self.model_batches: Counter = Counter()  # model -> batches executed (Triton's exec_count)
        # (model, SMs of the lane, batch rows) -> [device ms summed, batches, hold ms summed, device ms
        # per batch as a LogHistogram]: measured L(b, s), to hold against the profile the plan was made
        # with, and how long such batches held their lane beyond it (the launch, the way back, the booking)
        self.exec_ms: dict[tuple[str, int, int], list] = {}
        self.failures = 0
        self.layouts_built = 0
        # complete_on="loop": batches the device will post the loop for, in launch order
        self._pending: list[tuple[_Watcher, Lanes, Decision, list[Request], Any, float]] = []
        self.loop_completions = 0  # batches booked by the loop's thread (the rest: by watchers or inline)
        #: id(ticket) -> ticket of every batch launched on the runtime's thread and not yet booked
        #: (completion_due looks at them; the watcher or the loop removes one as it books it)
        self._unbooked: dict[int, Any] = {}
        if self.complete_on == "loop":
            self.loop.add_poller(self._poll_pending)

    # -- Backend --------------------------------------------------------------------------------
    def start(self, on_completion: Callable[[Completion], None]) -> None:
        self._on_completion = on_completion

    @property
    def builds_while_serving(self) -> bool:  # type: ignore[override]
        return self.device.builds_while_serving

    def prepare(self, layout: Layout, ready: Callable[[], None]) -> bool:
        with self._lock:
            self._wanted = layout
            self._drop_built()  # the runtime sets up only the layout it asked for last
        quiet_first = not self.builds_while_serving

        def build() -> None:
            with self._build_lock:
                lanes, err = None, None
                if self._wanted is layout:  # else superseded before we started: nothing to build
                    if quiet_first:
                        self._wait_quiet()
                    try:
                        lanes = self.device.build(layout)
                        self.layouts_built += 1
                    except BaseException as e:  # noqa: BLE001 - reported by configure()
                        log.error("building %s failed: %s", layout, e)
                        err = e
                with self._lock:
                    if lanes is not None and self._wanted is not layout:
                        self.device.release(lanes)  # superseded while building
                        lanes = None
                    self._built[id(layout)] = (lanes, err)
            ready()

        self.device.builder.submit(build)  # one thread for every build: cuDNN's timings stay (device.Builder)
        return True

    def _drop_built(self) -> None:
        """Release the builds finished for layouts the runtime will not set up (called with the lock
        held): a re-plan's build overtaken by a newer one kept its graphs, and their memory, pinned
        in the device's cache (``docs/reports/runtime.md``, twelfth session's review)."""
        for lanes, _ in self._built.values():
            if lanes is not None:
                self.device.release(lanes)
        self._built.clear()

    def configure(self, layout: Layout) -> float:
        with self._lock:
            entry = self._built.pop(id(layout), None)
            self._drop_built()
        if entry is None:  # not prepared (or superseded): build now, on this thread
            self._wait_quiet()
            lanes, err = self.device.build(layout), None
        else:
            lanes, err = entry
        if err is not None:
            raise err
        if lanes is None:
            raise RuntimeError(f"layout {layout} was superseded before it was built")
        with self._lock:
            old = self._lanes
            self._lanes = lanes
            if id(lanes) not in self._watchers:
                self._watchers[id(lanes)] = [_Watcher(self, lanes, i) for i in range(len(layout.partitions))]
                self._running.setdefault(id(lanes), 0)
            self._retired.pop(id(lanes), None)
            if old is not None:
                if old is lanes:
                    self.device.release(old)  # build() handed out one more reference
                else:
                    self._retired[id(old)] = old
                    self._maybe_retire(old)
            self.parts = [PartitionStats(p.index, p.label or repr(p), p.sms, p.shared) for p in layout.partitions]
            self._layout_t0 = self.loop.wall_ms()
            self._layout_serial += 1  # the partitions' counts start again: reports must not diff across
        return self.loop.now

    def partitions(self) -> Sequence[Partition]:
        return self._lanes.layout.partitions if self._lanes is not None else ()

    def attach(self, request_id: int, payload: Any) -> None:
        """Submitting thread: keep the request's row (staged already by the caller, e.g. the service,
        with ``device.stage``, or plain numpy arrays)."""
        self._payloads[request_id] = payload

    def take_output(self, request_id: int) -> ExecOutput | None:
        self._payloads.pop(request_id, None)
        return self._outputs.pop(request_id, None)

    @property
    def submit_blocks(self) -> bool:  # (Backend.submit_blocks)
        return self.launch_on == "inline"

    def submit(self, decision: Decision, requests: Sequence[Request]) -> None:
        t0 = time.perf_counter()
        lanes = self._lanes
        assert lanes is not None, "submit before configure"
        self.loop.expect()
        start = self.loop.wall_ms()
        try:
            rows = [self._payloads.pop(r.id) for r in requests]
        except KeyError as e:
            self._fail_now(decision, start, f"request {e.args[0]} has no input data (Backend.attach was not called)")
            return
        if self.launch_on == "lane" and self.lookahead_ms == 0:  # the lane's watcher launches it
            watcher = self._booked(lanes, decision, requests, start)
            watcher.q.put((self._launch_on_lane, (lanes, decision, list(requests), rows, start)))
            return
        try:
            ticket = self.device.launch(lanes, decision.partition, decision.model, rows)
        except Exception as e:  # noqa: BLE001 - fails this batch only
            self._fail_now(decision, start, f"{type(e).__name__}: {e}")
            return
        finally:
            self.host_ms += (time.perf_counter() - t0) * 1000.0
        watcher = self._booked(lanes, decision, requests, start)
        if self.launch_on == "inline":  # run it here; the completion is posted to this same loop
            self._complete(watcher, lanes, decision, list(requests), ticket, start)
            return
        self._unbooked[id(ticket)] = ticket
        if self.complete_on == "loop":
            try:
                notified = self.device.notify(ticket, self.loop.waker)
            except Exception:  # noqa: BLE001 - the watcher books it instead
                log.exception("device.notify failed; the lane's watcher books this batch")
                notified = False
            if notified:
                self._pending.append((watcher, lanes, decision, list(requests), ticket, start))
                return
        watcher.q.put((self._complete, (lanes, decision, list(requests), ticket, start)))

    @staticmethod
    def _turnaround(watcher: _Watcher, requests: Sequence[Request], start: float) -> float | None:
        """Runtime's thread, at a submit: ms the lane sat free with this batch's oldest request
        waiting, from its previous batch's completion reaching the host to now; None where the lane
        was not free (a batch launched ahead, or its previous launch failed) or nothing waited then."""
        prev, watcher.last_submit = watcher.last_submit, start
        freed = watcher.last_end  # (set by the completion before any later read of it here)
        if prev is None or not prev <= freed <= start or not requests:  # (freed after start: it ended during
            return None  # this submit, so this batch was launched ahead of it)
        oldest = min(r.arrival_ms for r in requests)
        return start - freed if oldest < freed else None

    def _booked(self, lanes: Lanes, d: Decision, requests: Sequence[Request], start: float) -> _Watcher:
        """Runtime's thread, a batch handed to its lane (launched, or queued for the lane's watcher to
        launch): count it in flight, the lane's turnaround and its submit lag; returns the lane's watcher."""
        watcher = self._watchers[id(lanes)][d.partition]
        turnaround = self._turnaround(watcher, requests, start)  # (the lane's previous batch's end: not this one's)
        lag = start - self.loop.now  # (the decision's clock: the loop's, still, on the thread that submits)
        with self._lock:
            self._inflight += 1
            self._running[id(lanes)] += 1
            if lanes is self._lanes and d.partition < len(self.parts):
                ps = self.parts[d.partition]
                ps.submit_lag.add(max(0.0, lag))
                if turnaround is not None:
                    ps.turnaround.add(turnaround)
        return watcher

    def _launch_on_lane(self, watcher: _Watcher, lanes: Lanes, d: Decision, requests: list[Request], rows: list,
                        start: float) -> None:
        """Watcher thread (``launch_on="lane"``): launch the batch, then wait for it as usual."""
        t0 = time.perf_counter()
        try:
            ticket = self.device.launch(lanes, d.partition, d.model, rows)
        except Exception as e:  # noqa: BLE001 - fails this batch only
            ticket, error = None, f"{type(e).__name__}: {e}"
        with self._lock:
            self.host_ms += (time.perf_counter() - t0) * 1000.0
        if ticket is None:
            self._batch_gone(lanes)
            self._fail_now(d, start, error)
            return
        self._complete(watcher, lanes, d, requests, ticket, start)

    def _poll_pending(self) -> float:
        """Runtime's thread, each time its loop wakes (``complete_on="loop"``): book every batch in
        flight that is done, in launch order. Returns how soon (ms) to look again without a post."""
        if not self._pending:
            return float("inf")
        waiting = []
        for item in self._pending:
            try:
                done = self.device.is_done(item[4])
            except Exception:  # noqa: BLE001 - finish() raises it again and fails the batch
                done = True
            if done:
                self.loop_completions += 1
                self._complete(*item)
            else:
                waiting.append(item)
        self._pending = waiting
        return self.POLL_SAFETY_MS if waiting else float("inf")

    def completion_due(self) -> bool:
        """Runtime's thread, between chunks of answers (:meth:`Backend.completion_due`): a completion
        posted and not run yet, or a batch launched here whose device work is done and that no thread
        has booked yet (a watcher is about to, or the loop's next poll will). One event query per
        batch in flight. (Batches a lane's watcher launched, ``launch_on="lane"``, count once posted.)"""
        if self.loop.completion_waiting():
            return True
        done_yet = self.device.done_yet
        for ticket in tuple(self._unbooked.values()):  # (a snapshot: watchers remove theirs meanwhile)
            try:
                if done_yet(ticket):
                    return True
            except Exception:  # noqa: BLE001 - its booking raises it again and fails the batch
                return True
        return False

    def _finish_pending(self) -> None:
        """Runtime's thread, about to wait for quiet: book the batches only it would book (blocking)."""
        pending, self._pending = self._pending, []
        for item in pending:
            self.loop_completions += 1
            self._complete(*item)

    def busy_sm_ms(self) -> float:
        return self._busy_sm_ms

    def close(self, *, keep_device: bool = False) -> None:
        """Wait for batches in flight (up to ``quiet_timeout_s``), stop the watchers, release the
        builds and close the device layer (``keep_device=True``: leave it open for another backend)."""
        self._wait_quiet()
        with self._lock:
            self._wanted = None  # a build still running releases its own when done (no longer wanted)
        # a build still capturing: let it end before the layer goes to another service (or closes)
        if self._build_lock.acquire(timeout=self.quiet_timeout_s):
            self._build_lock.release()
        with self._lock:
            # the re-plan builds ready but never swapped in: on a layer that stays open for another
            # service, builds left in use could never be evicted
            self._drop_built()
            for ws in self._watchers.values():
                for w in ws:
                    w.q.put(None)
            self._watchers.clear()
            lanes, self._lanes = self._lanes, None
            if lanes is not None:
                self.device.release(lanes)
            for old in self._retired.values():
                self.device.release(old)
            self._retired.clear()
        if not keep_device:
            self.device.close()

    # -- measurements ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Plain-data counters: per partition busy ratio and SMs, dispatch overhead, memory."""
        with self._lock:
            elapsed = max(1e-9, self.loop.wall_ms() - self._layout_t0)
            parts = [
                {"index": p.index, "label": p.label, "sms": p.sms, "shared": p.shared, "batches": p.batches,
                 "failures": p.failures, "device_ms": p.device_ms, "busy_ms": p.busy_ms, "ahead": p.ahead,
                 "ahead_busy_ms": p.ahead_busy_ms, "ahead_device_ms": p.ahead_device_ms,
                 "hold_hist": p.hold.to_json(), "turnaround_hist": p.turnaround.to_json(),
                 "submit_lag_hist": p.submit_lag.to_json(),
                 "layout_serial": self._layout_serial,
                 "busy_ratio": min(1.0, p.busy_ms / elapsed), "device_busy_ratio": min(1.0, p.device_ms / elapsed)}
                for p in self.parts
            ]
            return {
                "device": self.device.kind,
                "partitions": parts,
                "batches": self.batches,
                "model_batches": dict(self.model_batches),
                "exec_ms": [{"model": m, "sms": sms, "batch": b, "batches": int(n), "device_ms_sum": t,
                             "hold_ms_sum": hold, "device_ms_hist": hist.to_json()}
                            for (m, sms, b), (t, n, hold, hist) in sorted(self.exec_ms.items())],
                "failures": self.failures,
                "busy_sm_ms": self._busy_sm_ms,
                "device_ms": self.device_ms,
                "host_dispatch_ms": self.host_ms,
                "dispatch_overhead": self.host_ms / self.device_ms if self.device_ms > 0 else 0.0,
                "graph_memory_bytes": self.device.memory_bytes(),
                "layouts_built": self.layouts_built,
                "evictions": self.device.evictions,
                "oom_reclaims": self.device.oom_reclaims,  # full collections because memory ran out
                "eager_batches": getattr(self.device, "eager_batches", 0),  # CUDA: batches run without a graph
                "heuristic_captures": getattr(self.device, "heuristic_captures", 0),  # CUDA: cuDNN autotune failed
                "skipped_captures": getattr(self.device, "skipped_captures", 0),  # CUDA: filler left uncaptured
                "recarved_layouts": getattr(self.device, "recarved_layouts", 0),  # CUDA: another carving used
                "slow_carvings": getattr(self.device, "slow_carvings", 0),  # CUDA: carvings left as slow
                "short_carvings": getattr(self.device, "short_carvings", 0),  # CUDA: carvings the driver gave short
                # CUDA: the latest carvings timed alone against the profiles (CudaDeviceLayer._carving_check)
                "carving_checks": list(getattr(self.device, "carving_checks", ())),
                "launch_ms": dict(getattr(self.device, "launch_ms", {})),  # CUDA: host ms per launch phase
                "copy_ms": dict(getattr(self.device, "copy_ms", {})),  # CUDA: device copy ms, watcher host ms
                # CUDA: the same per model
                "copy_ms_by_model": {m: dict(v) for m, v in getattr(self.device, "copy_ms_by_model", {}).items()},
                # CUDA: the wake-up split into the GPU's start latency and the way back to the host
                "wake_split": dict(getattr(self.device, "wake_split", {})),
                "raw_launch": bool(getattr(self.device, "raw_launch", False)),  # CUDA: driver calls, not torch
                # CUDA: hardware workqueues the partitions got (shared with each other, or balanced)
                "workqueues": getattr(self.device, "workqueues_used", ""),
                "lane_streams": getattr(self.device, "lane_streams", ""),  # CUDA: graphs' streams on the lanes
                "outputs": getattr(self.device, "outputs", ""),  # CUDA: outputs copied off, or views handed out
                "views_refused": getattr(self.device, "views_refused", 0),  # CUDA: views wanted, copied (no memory)
                "views_torch_copies": getattr(self.device, "views_torch_copies", 0),  # views wanted, torch launch: copied
                "views_buffers": dict(getattr(self.device, "views_buffers", {})),  # CUDA: views' buffers made, reused
                "complete_on": self.complete_on,
                "loop_completions": self.loop_completions,  # batches the device posted the loop for
                "torch_launch_plans": getattr(self.device, "torch_launch_plans", 0),  # CUDA: buckets torch launched
                "inplace_batches": getattr(self.device, "inplace_batches", 0),  # CUDA: launched from pinned inputs
                # CUDA: batches launched as their input copies and one launch graph (their copies in are
                # not timed: copy_ms' h2d_untimed)
                "launch_graph_batches": getattr(self.device, "launch_graph_batches", 0),
                "launch_graph_failures": getattr(self.device, "launch_graph_failures", 0),
            }

    # -- internals ------------------------------------------------------------------------------
    def _fail_now(self, d: Decision, start: float, error: str) -> None:
        with self._lock:
            self.failures += 1
            if d.partition < len(self.parts):
                self.parts[d.partition].failures += 1
        log.warning("batch of %s on partition %d failed: %s", d.model, d.partition, error)
        self.loop.post(COMPLETION, self._on_completion, Completion(d, start, self.loop.wall_ms(), error))

    def _complete(self, watcher: _Watcher, lanes: Lanes, d: Decision, requests: list[Request], ticket: Any,
                  start: float) -> None:
        """Watcher thread (the runtime's with ``launch_on="inline"`` or ``complete_on="loop"``): wait
        for the batch, hand out outputs, post the completion."""
        # a batch launched ahead (runtime.lookahead_ms) starts when the lane's previous one is done
        ahead = start < watcher.last_end
        start = max(start, watcher.last_end)
        err, dev_ms = "", 0.0
        try:
            outs, dev_ms = self.device.finish(ticket)
            n = len(requests)
            for o in outs:
                if len(o) != n:
                    raise RuntimeError(f"model {d.model!r} returned {len(o)} rows for a batch of {n}")
        except Exception as e:  # noqa: BLE001 - fails this batch only
            err = f"{type(e).__name__}: {e}"
            log.warning("batch of %s on partition %d failed: %s", d.model, d.partition, err)
            outs = []
        end = watcher.last_end = self.loop.wall_ms()
        self._unbooked.pop(id(ticket), None)
        early = self.on_served
        served: list[tuple[Request, ExecOutput]] = []  # (what early answers, after the completion's post)
        if not err:
            for i, r in enumerate(requests):
                out = self._outputs[r.id] = ExecOutput([o[i] for o in outs], start, end, dev_ms, len(requests))
                if early is not None:
                    served.append((r, out))
        with self._lock:
            part = lanes.layout.partitions[d.partition]
            if lanes is self._lanes:
                ps = self.parts[d.partition]
                ps.batches += 1
                ps.failures += bool(err)
                ps.device_ms += dev_ms
                ps.busy_ms += end - start
                ps.hold.add(end - start - dev_ms)  # every batch, failed ones too, as busy_ms and gap_ms
                if ahead:
                    ps.ahead += 1
                    ps.ahead_busy_ms += end - start
                    ps.ahead_device_ms += dev_ms
            self.batches += 1
            self.model_batches[d.model] += 1
            self.failures += bool(err)
            self.device_ms += dev_ms
            sms = lanes.layout.shared_sms if part.shared else part.sms
            if not err:
                key = (d.model, sms, len(requests))
                acc = self.exec_ms.get(key)
                if acc is None:
                    acc = self.exec_ms[key] = [0.0, 0, 0.0, LogHistogram()]
                acc[0] += dev_ms
                acc[1] += 1
                acc[2] += end - start - dev_ms
                acc[3].add(dev_ms)
            use = min(sms, self.knee(d.model, d.batch)) if self.knee else sms
            self._busy_sm_ms += use * dev_ms
        self.loop.post(COMPLETION, self._on_completion, Completion(d, start, end, err, math.nan if err else dev_ms))
        if served:  # after the post: the lane's next launch does not wait for these answers
            self._answer_early(early, d, served, end)
        self._batch_gone(lanes)

    @staticmethod
    def _answer_early(early: Callable[[Result, "ExecOutput"], None], d: Decision,
                      served: list[tuple[Request, "ExecOutput"]], end: float) -> None:
        """Watcher thread (``on_served``): answer a finished batch's requests here, after its completion
        is posted. Before, the answers (an HTTP reply each behind the workers) came first and the loop
        heard of the free lane only after them."""
        for r, out in served:
            try:
                early(Result(r, Status.SERVED, end, "", d.batch), out)
            except Exception:  # noqa: BLE001 - the runtime still books and answers it
                log.exception("early answer of request %d failed", r.id)

    def _batch_gone(self, lanes: Lanes) -> None:
        """A batch counted in flight on ``lanes`` is over (done or failed): uncount it, free a replaced
        build it was the last to hold, and wake whoever waits for quiet."""
        with self._lock:
            self._inflight -= 1
            self._running[id(lanes)] -= 1
            if id(lanes) in self._retired:
                self._maybe_retire(lanes)
            self._lock.notify_all()

    def _maybe_retire(self, lanes: Lanes) -> None:
        """Under the lock: free a replaced build once nothing runs on it."""
        if self._running.get(id(lanes), 0) == 0 and lanes is not self._lanes:
            self._retired.pop(id(lanes), None)
            self._running.pop(id(lanes), None)
            for w in self._watchers.pop(id(lanes), []):
                w.q.put(None)
            self.device.release(lanes)

    def _wait_quiet(self) -> None:
        if self._pending and self.loop.on_loop_thread():
            self._finish_pending()  # no one else books these: waiting for them here would never end
        with self._lock:
            if not self._lock.wait_for(lambda: self._inflight == 0, timeout=self.quiet_timeout_s):
                log.warning("%d batches still in flight after %.0f s; going on", self._inflight, self.quiet_timeout_s)

    def __repr__(self) -> str:
        return f"ExecBackend(device={self.device.kind}, lanes={self._lanes!r}, inflight={self._inflight})"


__all__ = ["ExecBackend", "ExecOutput", "PartitionStats"]
