"""The CUDA device layer: lanes on SM partitions of one GPU, captured graphs replayed with raw launches.

Exclusive partitions of a layout are disjoint green contexts (:class:`gpuloom.gpu.Partitioner`);
shared lanes are plain streams (over the SMs the exclusive partitions leave, themselves a green
context, or the whole GPU when there are none). Graphs are captured per (model, lane) on that lane's
streams, so they stay confined; graph memory is accounted and bounded (:class:`GraphMemoryError`, LRU
eviction of cached layouts). A batch is launched on the runtime's thread (its rows' async copies in,
the graph, the copies out, an event: nothing waits) and finished on the lane's watcher thread, which
sleeps on the batch's blocking-sync event. The contract is :class:`~gpuloom.runtime.device.DeviceLayer`;
what the layer keeps per lane and per batch is in :mod:`~gpuloom.runtime.cuda_lane`.

torch is imported when the layer is constructed, not at import time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Sequence

from ..policy.types import Layout, Partition
from .cuda_lane import (ANCHOR_S, LANE_SLOTS, LANE_STREAMS, OUTPUTS, CudaLane, CudaTicket, EagerTicket, OutBuffer,
                        Prepared, StreamList, book_copies, check_lane_streams, check_outputs)
from .device import DeviceLayer, GraphMemoryError, Lanes, PinnedRow, Rows, ShortCarving, allowed, numpy_outputs
from .pinned import BufferPool, LiveBytes, lease_views

log = logging.getLogger(__name__)


class CudaDeviceLayer(DeviceLayer):
    """Lanes on one CUDA device; see the module docstring.

    Exclusive partitions of a layout become disjoint green contexts carved by one
    :class:`~gpuloom.gpu.Partitioner` (sizes in partition order; when shared lanes exist too, the SMs
    left over become one more green context whose streams the shared lanes get). Without exclusive
    partitions, shared lanes are plain torch streams over the whole GPU (what Triton does).

    Per (model, lane) a :class:`~gpuloom.engine.capture.GraphSet` is captured with the lane's stream
    factory (confined to the lane's SMs), plus pinned host buffers for inputs and outputs of
    ``max_batch`` rows. Everything a graph references (weights, static buffers, pool, streams) stays
    alive as long as its :class:`Lanes` build is cached or in use.

    Memory: ``memory_limit_bytes`` (default: ``memory_fraction`` of the device memory free when the
    layer is made) bounds graph memory; a build's need is estimated from each model's compile-time
    graph memory (``CompiledModel.memory_bytes``) per lane, unused cached builds are evicted oldest
    first, and a build that still does not fit raises :class:`GraphMemoryError` (never an OOM crash:
    an OOM during capture is turned into the same error).

    ``blocking_sync=True`` makes the watcher sleep in ``event.synchronize()`` (cudaEventBlockingSync)
    instead of spinning a core.

    ``lane_streams="single"`` captures every model with one stream on every lane, where by default
    (``"compiled"``) each bucket keeps the choice ``gpuloom.compile`` timed on the whole GPU (up to six
    streams for inception_v3). An experiment: on the H200 inception_v3's six-stream batch-1 graph ran
    2-6x its profile beside busy partitions with the driver's 8 hardware queues, and at its profile
    with the 32 gpuloom now asks for (docs/reports/runtime.md, eleventh session).

    ``workqueues="balanced"`` creates each exclusive partition with hardware workqueues of its own
    where the driver can (:class:`~gpuloom.gpu.Partitioner`); :attr:`workqueues_used` says what the
    last carving got (``"shared"`` where the driver refused, :attr:`workqueue_error` why).

    ``raw_launch=True`` (default) issues a launch's copies, graph launch and event records as raw
    driver calls (:mod:`gpuloom.gpu.launch`) instead of torch calls; it falls back to torch when the
    driver library does not load, or per bucket where a buffer is not contiguous.

    ``launch_graphs=True`` (default, with raw launches) makes, right after a model's capture on a
    lane, per (bucket, slot) a launch graph: a clone of the captured graph that also records the
    slot's timing and done events and copies the bucket's rows into the slot's pinned outputs
    (``Driver.wrap_graph``). A batch that fills its bucket is then its input copies and one
    ``cuGraphLaunch`` instead of those plus four event records and the output copies (its input
    copies are then not timed: ``copy_ms["h2d_untimed"]``). Lanes keep their captured
    ``cudaGraph_t`` for it. Batches short of their bucket, a bucket whose launch graph cannot be made
    (a torch without ``keep_graph``, a driver refusing a node: :attr:`launch_graph_failures`) and
    ``outputs="views"`` (each batch has output buffers of its own) launch with separate calls.

    ``outputs="copies"`` (default) copies a finished batch's rows off the slot's pinned buffers, which
    the slot's next batch reuses. ``outputs="views"`` gives each batch page-locked output buffers of
    its own at launch, from the layer's :class:`BufferPool` (reused: microseconds on the launching
    thread; a miss allocates page-locked memory, milliseconds), and hands its requests views of them:
    no copy on the way back, and a buffer returns to the pool only once its ticket and every view of
    it are gone, at the price of page-locked memory held as long as a caller keeps an output. Where
    that memory runs out, or the views still held reach ``views_max_bytes`` (default 4 GiB;
    :class:`LiveBytes`), the batch copies out of the slot's buffers instead (:attr:`views_refused`).
    On the H200 the copy was 3.1-4.7 ms of bert_base's 5-7 ms hold per batch (up to 16 rows, 6 MB;
    run 61); with views, 0.1 ms (run 62). Views need raw launches: torch's asynchronous copy into a buffer of its caching
    host allocator ties the buffer to the lane's stream, and freeing it after that stream's green
    context is gone (a caller still holding an output when the layout closes) aborted the process
    (run 62). So ``outputs="views"`` with ``raw_launch=False`` is refused, and a batch that launches
    through torch anyway (no driver library, or a bucket with a non-contiguous buffer) copies
    (:attr:`views_torch_copies`).
    """

    kind = "cuda"
    stages = True
    # graph capture (thread-local mode) beside other lanes' replays: decided by the GPU test
    # test_a_model_loads_while_another_is_served_on_the_gpu_when_builds_may_run_beside_replays (H200, run 20)
    builds_while_serving = True

    def __init__(self, device: int = 0, *, memory_limit_bytes: float | None = None, memory_fraction: float = 0.6,
                 warmup: int = 1, blocking_sync: bool = True, cache_layouts: int = 4, capture: str = "all",
                 raw_launch: bool = True, workqueues: str = "shared", lane_streams: str = "compiled",
                 outputs: str = "copies", views_max_bytes: float = 4 * 2**30, launch_graphs: bool = True) -> None:
        from ..gpu.partition import check_workqueues

        self.lane_streams = check_lane_streams(lane_streams)
        self.outputs = check_outputs(outputs, raw_launch)
        self.workqueues = check_workqueues(workqueues)
        self.workqueues_used = ""  # what the last carving got ("" before any)
        self.workqueue_error = ""
        if capture not in ("owner", "all"):
            raise ValueError(f"capture must be 'owner' (graphs where a partition's owner hint expects a model) or "
                             f"'all' (every model on every lane), got {capture!r}")
        self.capture_mode = capture
        self.eager_batches = 0  # batches run without a graph (a model on a lane it was not captured on)
        self.heuristic_captures = 0  # (model, lane) captures retried without cuDNN autotuning
        self.skipped_captures = 0  # filler models left uncaptured on another model's lane (capture failed)
        self.recarved_layouts = 0  # layouts that ran only carved another way than as given (see _build)
        self.slow_carvings = 0  # carvings left because a partition ran slow alone (see _carving_check)
        self.short_carvings = 0  # carvings left because the driver gave a partition fewer SMs than asked
        self.carving_checks: deque[dict] = deque(maxlen=16)  # the latest checks, for reports
        slow = os.environ.get("GPULOOM_RECARVE_SLOW", "").strip()
        if slow:
            try:
                self.carving_slow = float(slow)
            except ValueError:
                raise ValueError(f"GPULOOM_RECARVE_SLOW must be a ratio such as {self.SUGGESTED_CARVING_SLOW} "
                                 f"(carve a layout another way when a partition runs that much slower than its "
                                 f"profile alone), got {slow!r}") from None
            if not self.carving_slow > 1.0:
                raise ValueError(f"GPULOOM_RECARVE_SLOW must be above 1, got {slow!r}")
        self._carving_of: dict[tuple, int] = {}  # layout sizes -> the carving (index) a build settled on
        self.launch_ms = {"inputs": 0.0, "replay": 0.0, "outputs": 0.0, "launches": 0}  # host ms per phase
        # where a batch's time outside its graph goes: device ms copying inputs in and outputs out, host
        # ms copying outputs off the pinned buffers (watcher), host ms from launch to the watcher
        # awake beyond the device's copies and graph (wake), summed over batches (issue 5: the gap)
        self.copy_ms = {"h2d": 0.0, "d2h": 0.0, "host_out": 0.0, "wake": 0.0, "batches": 0, "h2d_untimed": 0}
        # the same per model: a model's hold beyond its device time (bert_base's 3 ms on the H200, its
        # batches returning 3-6 MB) splits into these parts (book_copies)
        self.copy_ms_by_model: dict[str, dict[str, float]] = {}
        # the wake-up split in two, for batches whose lane has a clock anchor: "start" from the launch's
        # first call to the GPU starting the batch (a queue on the GPU side: the lane's stream, or a
        # hardware workqueue shared with other partitions), "back" from the GPU finishing it to the
        # watcher (or the loop) running (the GIL), in ms summed over "batches"
        self.wake_split = {"start": 0.0, "back": 0.0, "batches": 0}
        self.inplace_batches = 0  # batches launched from their requests' own page-locked memory (PinnedRow)
        self.views_refused = 0  # outputs="views": batches copied out because page-locked memory ran out
        # or because the views still held reached views_max_bytes
        self.views_bytes = LiveBytes(views_max_bytes)
        # outputs="views": page-locked output buffers, reused once freed; free ones up to the views' bound
        self._out_pool = BufferPool(max_free_bytes=views_max_bytes)
        self.views_torch_copies = 0  # outputs="views": batches copied out because they launched through torch
        self._copy_lock = threading.Lock()
        self.torch_launch_plans = 0  # (lane, model, bucket)s launched through torch although raw_launch is on
        self.launch_graph_batches = 0  # batches launched through their bucket's launch graph (launch_graphs)
        self.launch_graph_failures = 0  # (lane, model, bucket, slot)s whose launch graph could not be made
        from ..gpu.connections import prefer_all_connections

        # before torch starts CUDA here (if nothing has yet): partitions must not share 8 hardware queues
        self.connections = prefer_all_connections()
        if self.connections.warning:
            log.warning("%s", self.connections.warning)
        import torch

        from ..gpu import device_facts

        if not torch.cuda.is_available():
            from ..gpu.errors import NoGpuError

            raise NoGpuError("CudaDeviceLayer needs a CUDA GPU; torch.cuda.is_available() is False "
                             "(use CpuDeviceLayer, device='cpu')")
        facts = device_facts(device)
        self.device = device
        self.gpu_sms, self.granularity = facts.sm_count, facts.sm_granularity
        if memory_limit_bytes is None:
            free, _total = torch.cuda.mem_get_info(device)
            memory_limit_bytes = memory_fraction * free
        super().__init__(memory_limit_bytes=memory_limit_bytes, cache_layouts=cache_layouts)
        self._torch = torch
        _init_dtypes()
        self.warmup = warmup
        self.blocking_sync = blocking_sync
        torch.cuda.init()
        torch.cuda.current_stream(device)  # primary context (and torch's stream pool) first
        self._driver = None
        if raw_launch:
            from ..gpu.errors import DriverError
            from ..gpu.launch import Driver

            try:
                self._driver = Driver(device)
            except (OSError, AttributeError, DriverError) as e:
                log.warning("raw launches off, launching through torch: the CUDA driver library did not load (%s)", e)
        self.raw_launch = self._driver is not None
        self.launch_graphs = bool(launch_graphs and self._driver is not None and self._driver.can_wrap)
        if self.outputs == "views" and not self.raw_launch:
            log.warning("outputs=views: every batch copies its outputs out, as with outputs=copies (views need "
                        "raw launches, and the driver library did not load)")

    def _estimate(self, layout: Layout, models: Sequence[str]) -> float:
        per = {m: max(int(getattr(self.models[m], "memory_bytes", 0) or 0), 1 << 20) for m in models}
        return float(sum(per[m] for p in layout.partitions for m in models if self._wanted(p, m)))

    def _wanted(self, p: Partition, model: str) -> bool:
        return self.capture_mode == "all" or allowed(p, model)

    # how a layout's partitions are carved, tried in turn until every capture succeeds (see _build)
    CARVINGS = (("given", "cosched"), ("ascending", "cosched"), ("given", "independent"))

    #: a partition whose owner's graph runs this much slower alone than its profile says: its carving
    #: is tried another way (``_carving_check``). Off (timing only, for the reports) until the GPU
    #: shows it helps: ``GPULOOM_RECARVE_SLOW=1.25`` turns it on (a bench A/B: ``BENCH_ENVS``).
    carving_slow = float("inf")
    SUGGESTED_CARVING_SLOW = 1.25
    #: the batch the carving check times (the largest captured bucket up to it)
    CHECK_BATCH = 8

    def _build(self, lanes: Lanes) -> None:
        """Carve the layout and capture its graphs; if a capture fails, or a partition runs slow, carve
        it another way.

        On the H200 cuDNN failed on partitions split off a small remainder, and on a partition split
        ignoring co-scheduling, while other carvings of the same sizes ran (``gpu/partition.py``):
        each layout is tried as given, then smallest partitions first, then ignoring co-scheduling.
        Partitions of a carving that captured can still be slow: in (48, 16, 16, 16, 16, 20) carved as
        given, the four 16-SM partitions ran their models 1.6-1.75x slower than their profiles, where
        16-SM partitions of other layouts ran 1.04x (runs 37 and 39, docs/reports/runtime.md). So each
        carving that captures is timed (``_carving_check``); with ``carving_slow`` set, one with a
        partition slower than that x its profile is carved the next way, and the least slow is kept.
        """
        from ..gpu.errors import PartitionError

        torch = self._torch
        if not any(not p.shared for p in lanes.layout.partitions):
            return self._build_carved(lanes, *self.CARVINGS[0])
        sizes = tuple((p.sms, p.shared) for p in lanes.layout.partitions)
        known = self._carving_of.get(sizes)  # what an earlier build of these sizes settled on: no new search
        if known is not None:
            try:
                self._build_carved(lanes, *self.CARVINGS[known], exact=False)
                return self._keep(lanes, sizes, known, checked=False)
            except RuntimeError as e:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                log.warning("layout %r failed to capture carved %s/%s as before (%s); trying every carving",
                            lanes.layout, *self.CARVINGS[known], e)
        errors: list[BaseException] = []
        slow: list[tuple[float, int]] = []  # (worst ratio, carving) of carvings that captured but ran slow
        short: list[tuple[float, int]] = []  # (asked / given SMs, carving) of carvings the driver gave short
        tried: set[tuple] = set()  # carvings as the driver sees them: the same sizes split the same way
        for n, (order, split) in enumerate(self.CARVINGS):
            seen = self._carving_key(lanes, order, split)
            if seen in tried:
                continue  # e.g. "given" and "ascending" of a layout already in ascending order
            tried.add(seen)
            try:
                self._build_carved(lanes, order, split)
            except ShortCarving as e:  # nothing captured yet: cheap to try the next carving
                self.short_carvings += 1
                short.append((e.ratio, n))
                errors.append(e)
                self.carving_checks.append({"layout": self._check_key(lanes), "carving": f"{order}/{split}",
                                            "worst": e.ratio, "short": e.short})
                log.warning("layout %r carved %s/%s: %s%s", lanes.layout, order, split, e,
                            "; carving it another way" if n + 1 < len(self.CARVINGS) else "")
                continue
            except Exception as e:
                # only a capture error carves another way; anything else is the build's error, unless a
                # slow carving already captured (then it is the one to go back to), or a short carving
                # was found and this one could not be split (then the short one is)
                capture = isinstance(e, RuntimeError) and not isinstance(e, torch.cuda.OutOfMemoryError)
                if not slow and not capture and not (short and isinstance(e, PartitionError)):
                    raise
                errors.append(e)
                log.warning("layout %r failed to capture carved %s/%s (%s)%s", lanes.layout, order, split, e,
                            "; carving it another way" if n + 1 < len(self.CARVINGS) else "")
                continue
            worst = self._carving_check(lanes, f"{order}/{split}")
            if worst > self.carving_slow and n + 1 < len(self.CARVINGS):
                log.warning("layout %r carved %s/%s: a partition ran %.2fx its profile alone; carving it another way",
                            lanes.layout, order, split, worst)
                self.slow_carvings += 1
                slow.append((worst, n))
                self._free(lanes)
                continue
            if not slow or worst <= min(slow)[0]:
                return self._keep(lanes, sizes, n, checked=worst > 0)
            slow.append((worst, n))  # slower still than an earlier carving: back to that one
            self._free(lanes)
            break
        # the least slow carving that captured, else the least short one (as the driver gives it: a
        # measured slowdown and a ratio of SM counts do not compare), and failing that the next
        for _worst, n in sorted(slow) + sorted(short):
            try:
                self._build_carved(lanes, *self.CARVINGS[n], exact=False)
            except Exception as e:  # noqa: BLE001 - e.g. a flaky cuDNN launch: the next one
                errors.append(e)
                log.warning("layout %r failed to capture carved %s/%s again (%s)", lanes.layout, *self.CARVINGS[n], e)
                continue
            return self._keep(lanes, sizes, n, checked=True)
        raise errors[-1] from errors[0]

    def _carving_key(self, lanes: Lanes, order: str, split: str) -> tuple:
        """What the driver is asked for when ``lanes``' layout is carved ``order``/``split``: the sizes
        in the order they are split, and how remainders are split."""
        from ..gpu import carve_order

        sizes = self._carved_sizes(lanes.layout)
        return tuple(sizes[i] for i in carve_order(sizes, self.granularity, order)), split

    def _carved_sizes(self, layout: Layout) -> list[int]:
        """The sizes ``Partitioner`` is given for ``layout``: its exclusive partitions, and what they
        leave for the shared lanes, if any."""
        excl = [p.sms for p in layout.partitions if not p.shared]
        if excl and any(p.shared for p in layout.partitions):
            excl.append(self.gpu_sms - sum(excl))
        return excl

    @staticmethod
    def _check_key(lanes: Lanes) -> list[int]:
        """How ``carving_checks`` name a layout (and ``_keep`` finds its build's row): its sizes."""
        return [p.sms for p in lanes.layout.partitions]

    def _keep(self, lanes: Lanes, sizes: tuple, n: int, *, checked: bool) -> None:
        """``lanes`` stays carved the ``n``-th way; remembered for its sizes where that was decided
        by a capture failure or a check (an unchecked first carving is checked again next time)."""
        if n:
            self.recarved_layouts += 1
        if n or checked:
            self._carving_of[sizes] = n
        name, layout = "/".join(self.CARVINGS[n]), self._check_key(lanes)
        for c in reversed(self.carving_checks):  # this build's check of the carving kept
            if c["layout"] == layout and c["carving"] == name:
                c["kept"] = True
                break

    def _carving_check(self, lanes: Lanes, carving: str) -> float:
        """Time each exclusive partition's owner model alone on it (one captured bucket, median of
        CUDA-event-timed replays) against ``expected_ms`` (its profile); record the rows in
        ``carving_checks`` and return the worst ratio. 0 when nothing was checked: no profiles, or
        another build had work on the GPU before, during or after the timing (its batches would be
        timed too: the check is for a GPU at rest, as at start or between a bench's points), or the
        check itself failed (a check never fails a build)."""
        if self.expected_ms is None or not self._at_rest(lanes):
            return 0.0
        launched = self._launches()
        try:
            with self._phase("carving check"):
                rows = self._time_owners(lanes)
        except Exception as e:  # noqa: BLE001 - the build stands; only its check is lost
            log.warning("checking the carving of %r failed: %s", lanes.layout, e)
            return 0.0
        if self._launches() != launched or not self._at_rest(lanes):
            return 0.0
        worst = max((r["ratio"] for r in rows), default=0.0)
        self.carving_checks.append({"layout": self._check_key(lanes), "carving": carving, "worst": worst,
                                    "rows": rows})
        return worst

    def _time_owners(self, lanes: Lanes) -> list[dict]:
        from ..engine.capture import time_replays

        rows = []
        for lane in lanes.state["lanes"]:
            p, sets = lane.part, lane.graphs.get(lane.part.owner or "")
            if p.shared or not sets:
                continue
            b = max((b for b in sets if b <= self.CHECK_BATCH), default=min(sets))
            want = self.expected_ms(p.owner, b, p.sms)
            if not want:
                continue
            gs = sets[b]
            ms = time_replays(gs.buckets[b].graph, gs.stream, warmup=3, iters=10)
            rows.append({"partition": p.label or p.index, "sms": p.sms, "model": p.owner, "batch": b,
                         "ms": round(ms, 4), "profile_ms": round(want, 4), "ratio": round(ms / want, 3)})
        return rows

    def _launches(self) -> int:
        """Batches launched so far, either way (a graph's, counted in ``launch_ms``, or eager)."""
        return self.launch_ms["launches"] + self.eager_batches

    def _at_rest(self, lanes: Lanes) -> bool:
        """No stream of another build has work queued or running (``cudaStreamQuery``). Reads the
        cache without ``_lock``: the builder holds the device lock, which ``release`` takes under
        ``_lock``. Anything it cannot read (a build freed meanwhile) counts as not at rest."""
        try:
            states = [ln.state for ln in list(self._cache.values()) if ln is not lanes]
            return all(s.query() for st in states if st for lane in st["lanes"] for s in lane.streams.streams)
        except Exception:  # noqa: BLE001 - a build freed under us: do not time now
            return False

    def _build_carved(self, lanes: Lanes, order: str, remainder_split: str, *, exact: bool = True) -> None:
        """Carve ``lanes``' layout ``order``/``remainder_split`` and capture its graphs. ``exact``: a
        partition the driver gives fewer SMs than asked raises ``ShortCarving`` before anything is
        captured (on the H200 a split of 16-SM groups off a remainder gave 10 or 12 SMs each, which
        the layout still called 16: ``scripts/diag_carvings.py``, run 41)."""
        from ..gpu import Partitioner

        torch = self._torch
        layout = lanes.layout
        excl = [p for p in layout.partitions if not p.shared]
        sizes = self._carved_sizes(layout)
        with self._phase("carving"):
            partitioner = (Partitioner(sizes, mode="green", device=self.device, remainder_split=remainder_split,
                                       order=order, workqueues=self.workqueues) if excl else None)
        if partitioner is not None:
            gave = [(p.requested, p.sms) for p in partitioner if p.sms < p.requested]
            if exact and gave:
                try:
                    partitioner.close()
                except Exception as e:  # noqa: BLE001 - the short carving is the finding; nothing was captured
                    log.warning("closing a short carving failed: %s", e)
                raise ShortCarving(gave, f"{order}/{remainder_split}")
            self.workqueues_used, self.workqueue_error = partitioner.workqueues, partitioner.workqueue_error
            if partitioner.workqueue_error:
                log.warning("partitions share the device's workqueues: %s", partitioner.workqueue_error)
        state = {"partitioner": partitioner, "lanes": []}
        lanes.state = state
        dev = torch.device("cuda", self.device)
        k = 0
        for p in layout.partitions:
            if not p.shared:
                gp = partitioner[k]
                k += 1
                sl = StreamList(gp.new_stream)
                sl.streams.append(gp.stream)
                lane = CudaLane(p, sl, True)
            elif partitioner is not None:
                rest = partitioner[len(excl)]
                lane = CudaLane(p, StreamList(rest.new_stream), True)
            else:
                lane = CudaLane(p, StreamList(lambda: torch.cuda.Stream(dev)), False)
            state["lanes"].append(lane)
        before = torch.cuda.memory_reserved(self.device)
        try:
            for lane in state["lanes"]:
                for m in lanes.models:
                    if not self._wanted(lane.part, m):
                        continue
                    try:
                        self._capture(lane, m)
                    except RuntimeError as e:
                        if lane.part.owner in (None, m):
                            raise  # the lane exists for this model (or everyone shares it): the layout fails
                        # a filler that cannot run here: the owner still can; a batch of it sent here
                        # runs eagerly (and fails alone if it cannot launch either)
                        log.warning("not capturing %s on %r (it belongs to %s): %s", m, lane.part, lane.part.owner, e)
                        self.skipped_captures += 1
                        lane.streams.synchronize()
        except BaseException:
            self._free(lanes)
            raise
        torch.cuda.synchronize(self.device)
        lanes.memory_bytes = max(0, torch.cuda.memory_reserved(self.device) - before) or int(
            sum(gs.memory_bytes for ln in state["lanes"] for gs in ln.graph_sets()))

    def _stream_groups(self, cm: Any) -> dict[Any, list[int]]:
        """Buckets by the ``streams`` to capture them with (1, "max", "forward", or "single_cl" /
        "multi_cl" for a model compiled with ``channels_last="auto"``). compile() already
        chose per bucket (timed on the whole GPU); each group is captured with its choice, from a
        fresh factory of the lane's few streams. ``lane_streams="single"``: no multi-stream graph."""
        from ..engine.compiled import capture_groups

        return capture_groups(cm, single=self.lane_streams == "single")

    def _capture(self, lane: CudaLane, model: str) -> None:
        torch = self._torch
        cm = self.models[model]
        groups = self._stream_groups(cm)
        from ..engine import gemm
        from ..engine.capture import cudnn_heuristics

        def capture_all() -> dict[int, Any]:
            sets: dict[int, Any] = {}
            # split GEMMs (ModelConfig.split_gemms) choose again on a partition's SMs, timed on its streams
            with gemm.scope(lane.part.sms if lane.confined else None):
                for ch, bs in groups.items():
                    gs = cm.capture(stream_factory=lane.streams.factory(), buckets=bs, streams=ch, warmup=self.warmup,
                                    keep_graph=self.launch_graphs)
                    for b in bs:
                        sets[b] = gs
            return sets

        try:
            try:
                with self._phase("captures"):
                    sets = capture_all()
            except RuntimeError as e:
                if "CUDNN" not in str(e).upper() or isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                # an algorithm cuDNN's autotuner tried does not launch on this partition: heuristics only
                log.warning("capturing %s on %r: %s; retrying without cuDNN autotuning", model, lane.part, e)
                lane.streams.synchronize()
                with cudnn_heuristics():
                    sets = capture_all()
                self.heuristic_captures += 1
        except torch.cuda.OutOfMemoryError as e:
            raise GraphMemoryError(f"out of device memory capturing {model!r} on {lane.part!r}: {e}") from e
        # replay each graph once now: a graph's first launch uploads it to the device (milliseconds),
        # which would otherwise land on the first request of each bucket on each lane
        with self._phase("uploads"):
            for b, gs in sets.items():
                gs.replay(b)
            lane.streams.synchronize()
        lane.graphs[model] = sets
        top = max(sets)
        ins = sets[top].inputs(top)
        from ..engine.dag import flat_tensors

        outs = flat_tensors(sets[top].outputs(top))
        lane.in_shapes[model] = [(t.shape, t.dtype) for t in ins]  # pinned input buffers: on first use
        with self._phase("pinned outputs"):
            for slot in range(LANE_SLOTS):
                pin = lane.pinned_out[(model, slot)] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                                        for t in outs]
                lane.np_out[(model, slot)] = [t.numpy() for t in pin]
                lane.ptr_out[(model, slot)] = [t.data_ptr() for t in pin]
        with self._phase("launch graphs"):
            self._make_launch_graphs(lane, model)

    def _launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any:
        """Runtime thread. Rows -> pinned buffers (host), then on the lane's main stream: async H2D
        into the bucket's static inputs, replay, async D2H into pinned outputs, a blocking-sync
        event. Returns at once. A lane holds at most ``LANE_SLOTS`` batches (the runtime's launch-ahead),
        each with its own slot of pinned buffers and events, reused only after its :meth:`finish`.

        Rows already page-locked (stage()'s tensors, or PinnedRows) of a (model, batch size, slot)
        launched before go straight to :meth:`_launch_raw` with what that launch prepared."""
        lane: CudaLane = lanes.state["lanes"][index]
        prep = lane.prepared.get((model, len(rows), lane.launches % LANE_SLOTS))
        if prep is not None and self.outputs == "copies":
            spans = _pinned_spans(rows)
            if spans is not None:
                if type(rows[0]) is PinnedRow:
                    self.inplace_batches += 1
                return self._launch_raw(lane, prep, model, rows, rows_in=spans)
        return self._launch_general(lane, model, rows)

    def _launch_general(self, lane: CudaLane, model: str, rows: Rows) -> Any:
        """:meth:`_launch` for a batch without a prepared launch: looks everything up (and prepares
        the launch for next time where it is raw), stages rows that are not page-locked into the
        lane's own pinned buffers, and launches through torch where there is no raw plan."""
        import numpy as np

        torch = self._torch
        sets = lane.graphs.get(model)
        if sets is None:
            self.eager_batches += 1
            return EagerTicket(lane, model, rows)
        n = len(rows)
        b = self.models[model].bucket_for(n)
        gs = sets[b]
        st = gs.stream
        entry = gs.buckets[b]
        static_out = self._static_out(lane, model, b, entry)
        plan = self._raw_plan(lane, model, b, entry, static_out, st) if self._driver is not None else None
        # rows already in page-locked memory: pinned torch tensors from stage(), or PinnedRows (numpy
        # views of memory from pinned_empty/register_host) on the raw path. A torch copy out of the
        # caller's page-locked memory would tie it to the lane's stream, and freeing it after the
        # layout closed aborts the process (run 63): without a raw plan, PinnedRows go through the
        # lane's own buffers
        staged = all(not isinstance(r[0], np.ndarray) or (type(r) is PinnedRow and plan is not None)
                     for r in rows)
        if staged and type(rows[0]) is PinnedRow:
            self.inplace_batches += 1
        # the slot's count moves on only once the batch is queued (at the end): a launch that fails
        # leaves its slot to the next batch, never the running batch's slot to a third one
        slot = lane.launches % LANE_SLOTS
        key = (model, slot)
        if not staged:
            if key not in lane.np_in:  # callers that did not stage() their rows: once per (model, slot)
                pin = lane.pinned_in[key] = [torch.empty(sh, dtype=dt, pin_memory=True) for sh, dt in lane.in_shapes[model]]
                lane.np_in[key] = [t.numpy() for t in pin]
                lane.ptr_in[key] = [t.data_ptr() for t in pin]
            for j, buf in enumerate(lane.np_in[key]):
                np.stack([r[j] for r in rows], out=buf[:n])
        t_in, t0, t1, done = self._slot_events(lane, slot, st)
        if plan is not None:
            prep = lane.prepared.get((model, n, slot))
            if prep is None:  # what it holds stays as it is until the lane is freed
                # a launch graph copies its bucket's rows out: only for a batch that fills its bucket
                graph = lane.launch_graphs.get((model, b, slot)) if n == b else None
                prep = lane.prepared[(model, n, slot)] = Prepared(
                    plan, st, (t_in, t0, t1, done), tuple(e.cuda_event for e in (t_in, t0, t1, done)),
                    lane.np_out[key], lane.ptr_out[key], graph[1] if graph else 0)
            out = None
            if self.outputs == "views":
                clock = time.perf_counter
                ca = clock()
                views = self._fresh_outputs(lane, key)
                self.launch_ms["alloc"] = self.launch_ms.get("alloc", 0.0) + (clock() - ca) * 1e3  # a cache miss: ms
                if views:
                    out = views[1], views[2]
            if staged:
                return self._launch_raw(lane, prep, model, rows, rows_in=[[_host_span(t) for t in r] for r in rows],
                                        out=out)
            return self._launch_raw(lane, prep, model, rows, batch_in=lane.ptr_in[key], out=out)
        if self.outputs == "views":  # torch's copy would tie the buffer to the stream
            self.views_torch_copies += 1
        clock = time.perf_counter
        if lane.anchor is None or clock() - lane.anchor[1] > ANCHOR_S:
            self._anchor(lane, st)
        out_t, out_np = lane.pinned_out[key], lane.np_out[key]
        c0 = clock()
        try:
            with torch.cuda.stream(st):
                t_in.record(st)
                if staged:  # one async copy per row and input, straight from the request's pinned row
                    for i, r in enumerate(rows):
                        for dst, src in zip(entry.inputs, r):
                            dst[i].copy_(torch.from_numpy(src) if isinstance(src, np.ndarray) else src,
                                         non_blocking=True)
                else:
                    for dst, src in zip(entry.inputs, lane.pinned_in[key]):
                        dst[:n].copy_(src[:n], non_blocking=True)
                c1 = clock()
                t0.record(st)
                entry.graph.replay()
                t1.record(st)
                c2 = clock()
                for dst, src in zip(out_t, static_out):
                    dst[:n].copy_(src[:n], non_blocking=True)
                done.record(st)
        except BaseException:
            _settle(lane, st)
            raise
        lane.launches += 1
        c3 = clock()
        self._book_launch(c0, c1, c2, c3)
        return CudaTicket(n, done, t0, t1, t_in, out_np, rows, c3, 0, c0, lane.anchor, model, False)

    def _launch_raw(self, lane: CudaLane, prep: Prepared, model: str, rows: Rows, *,
                    rows_in: list | None = None, batch_in: list | None = None, out: tuple | None = None) -> Any:
        """The batch in raw driver calls (gpu/launch.py: why): its inputs from ``rows_in`` (per row,
        per input, a page-locked ``(address, bytes)``) or ``batch_in`` (per input, the lane's pinned
        buffer of the batch), into the slot's pinned outputs or ``out`` (numpy views, addresses:
        outputs="views")."""
        clock = time.perf_counter
        if lane.anchor is None or clock() - lane.anchor[1] > ANCHOR_S:
            self._anchor(lane, prep.stream)
        out_np, out_ptr = (prep.out_np, prep.out_ptr) if out is None else out
        n = len(rows)
        plan, drv = prep.plan, self._driver
        t_in, t0, t1, done = prep.raw
        # the launch graph records the events and copies into the slot's buffers: not for views
        wrapped = prep.launch_graph if out is None and self.launch_graphs else 0
        c0 = clock()
        try:
            drv.ensure_context()
            plan.copy_inputs(drv, n, None if wrapped else t_in, rows_in=rows_in, batch_in=batch_in)
            c1 = clock()
            if wrapped:
                drv.launch_graph(wrapped, plan.stream)
                c2 = clock()
            else:
                plan.replay(drv, t0, t1)
                c2 = clock()
                plan.copy_outputs(drv, n, out_ptr, done)
        except BaseException:
            _settle(lane, prep.stream)
            raise
        lane.launches += 1
        c3 = clock()
        self._book_launch(c0, c1, c2, c3)
        # the ticket holds the rows: raw copies read their pinned memory without torch knowing, so it
        # must not be freed (and reused) before the batch's event has fired
        ev = prep.events
        if wrapped:
            self.launch_graph_batches += 1
        # a launch graph records no event before the input copies: its batch's t_in is t0 (copy in 0)
        return CudaTicket(n, ev[3], ev[1], ev[2], ev[1] if wrapped else ev[0], out_np, rows, c3, plan.stream, c0,
                           lane.anchor, model, out is not None)

    def _static_out(self, lane: CudaLane, model: str, bucket: int, entry: Any) -> list[Any]:
        """The bucket's static outputs, flattened (made once per lane)."""
        static_out = lane.static_out.get((model, bucket))
        if static_out is None:
            from ..engine.dag import flat_tensors

            static_out = lane.static_out[(model, bucket)] = flat_tensors(entry.outputs)
        return static_out

    def _slot_events(self, lane: CudaLane, slot: int, stream: Any) -> tuple:
        """The slot's (t_in, t0, t1, done) events, made on first use (recorded once on ``stream``:
        marked recorded, for elapsed_time, before their raw handles are read)."""
        torch = self._torch
        while len(lane.events) <= slot:
            evs = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                   torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=self.blocking_sync))
            for e in evs:
                e.record(stream)
            lane.events.append(evs)
        return lane.events[slot]

    def _make_launch_graphs(self, lane: CudaLane, model: str) -> None:
        """Right after ``model``'s capture on ``lane`` (no batch pays for it): per bucket and slot, the
        bucket's launch graph (``Driver.wrap_graph``): its captured graph between the slot's events,
        then the copy of the bucket's rows into the slot's pinned outputs. Not with
        ``outputs="views"`` (each batch has output buffers of its own). Where one cannot be made,
        batches of it launch with separate calls, as before (:attr:`launch_graph_failures`)."""
        if not self.launch_graphs or self.outputs == "views":
            return
        for b, gs in sorted(lane.graphs[model].items()):
            entry = gs.buckets[b]
            plan = self._raw_plan(lane, model, b, entry, self._static_out(lane, model, b, entry), gs.stream)
            if plan is None:
                continue
            for slot in range(LANE_SLOTS):
                made = None
                try:
                    raw = [e.cuda_event for e in self._slot_events(lane, slot, gs.stream)]
                    child = int(entry.graph.raw_cuda_graph())
                    copies = [(dst, src, b * row) for (src, row), dst in zip(plan.outputs, lane.ptr_out[(model, slot)])]
                    # flat: into a clone of the captured graph; around it as a child node, its launch cost
                    # 3-15 us more host time on the H200 (run 96)
                    made = self._driver.wrap_graph(child, raw[1], raw[2], copies, raw[3], plan.stream, flat=True)
                except Exception as e:  # noqa: BLE001 - its batches launch without it
                    self.launch_graph_failures += 1
                    (log.warning if self.launch_graph_failures == 1 else log.debug)(
                        "no launch graph for %s bucket %d on lane %s (launching with separate calls): %s: %s",
                        model, b, lane.part, type(e).__name__, e)
                lane.launch_graphs[(model, b, slot)] = made

    def _book_launch(self, c0: float, c1: float, c2: float, c3: float) -> None:
        """Where a launch's host time goes (issue 5: dispatch overhead), from its four clock reads."""
        ph = self.launch_ms
        ph["inputs"] += (c1 - c0) * 1e3
        ph["replay"] += (c2 - c1) * 1e3
        ph["outputs"] += (c3 - c2) * 1e3
        ph["launches"] += 1

    def _anchor(self, lane: CudaLane, stream: Any) -> None:
        """Tie the lane's GPU clock to the host's: on an idle stream an event runs as soon as it is
        recorded, so its GPU time is the host time of the record (to the ~10 us a record takes to
        reach the GPU). A busy stream keeps the anchor it has (or none) until it is idle."""
        try:
            if not stream.query():
                return
            e = self._torch.cuda.Event(enable_timing=True)
            h = time.perf_counter()
            e.record(stream)
            lane.anchor = (e, h)
        except Exception:  # noqa: BLE001 - a diagnostic: never in the way of a launch
            log.debug("no clock anchor for lane %s", lane.part, exc_info=True)

    def _split_wake(self, t: CudaTicket, awake: float) -> None:
        """Book the batch's start latency (first launch call -> GPU starts it) and its way back (GPU
        done -> this thread ``awake``) against its lane's clock anchor (see :attr:`wake_split`)."""
        if t.anchor is None:
            return
        try:
            event, host = t.anchor
            drv = self._driver
            if drv is not None:
                a = event.cuda_event
                start = host + drv.elapsed_ms(a, t.t_in.cuda_event) / 1e3
                end = host + drv.elapsed_ms(a, t.done.cuda_event) / 1e3
            else:
                start = host + event.elapsed_time(t.t_in) / 1e3
                end = host + event.elapsed_time(t.done) / 1e3
        except Exception:  # noqa: BLE001 - a diagnostic: never fails the batch
            return
        with self._copy_lock:
            ws = self.wake_split
            ws["start"] += (start - t.began) * 1e3
            ws["back"] += (awake - end) * 1e3
            ws["batches"] += 1

    def close(self) -> None:
        super().close()
        self._out_pool.close()
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    def _raw_plan(self, lane: CudaLane, model: str, bucket: int, entry: Any, static_out: list[Any], stream: Any) -> Any:
        """The bucket's :class:`~gpuloom.gpu.launch.LaunchPlan` (made once), or None where a raw launch
        cannot do what the torch path does: a buffer that is not contiguous, or a torch without
        ``CUDAGraph.raw_cuda_graph_exec``."""
        key = (model, bucket)
        if key in lane.plans:
            return lane.plans[key]
        from ..gpu.launch import LaunchPlan, row_bytes

        plan = None
        exec_handle = getattr(entry.graph, "raw_cuda_graph_exec", None)
        bufs = list(entry.inputs) + list(static_out)
        if exec_handle is not None and all(t.is_contiguous() and t.dim() >= 1 for t in bufs):
            plan = LaunchPlan(
                stream=int(stream.cuda_stream),
                graph_exec=int(exec_handle()),
                inputs=tuple((t.data_ptr(), row_bytes(t.shape, t.element_size())) for t in entry.inputs),
                outputs=tuple((t.data_ptr(), row_bytes(t.shape, t.element_size())) for t in static_out),
            )
        else:
            self.torch_launch_plans += 1
        lane.plans[key] = plan
        return plan

    def notify(self, ticket: Any, waker: Any) -> bool:
        """After a raw launch: ``cuLaunchHostFunc(stream, sem_post, &loop semaphore)`` behind the
        batch's last copy, so the finished batch wakes the runtime's loop itself."""
        if self._driver is None or not isinstance(ticket, CudaTicket) or not ticket.stream or waker.c_post is None:
            return False
        fn, arg = waker.c_post
        self._driver.host_func(ticket.stream, fn, arg)  # same thread as the launch: its context is current
        return True

    def is_done(self, ticket: Any) -> bool:
        if self._driver is None or not isinstance(ticket, CudaTicket):
            return True  # finish() blocks as before
        return self.done_yet(ticket)

    def done_yet(self, ticket: Any) -> bool:
        if self._driver is None or not isinstance(ticket, CudaTicket):
            return False  # an eager batch runs in finish() itself
        self._driver.ensure_context()
        return self._driver.done(ticket.done.cuda_event)

    def finish(self, ticket: Any) -> tuple[list[Any], float]:
        """Watcher thread (or the runtime's, once :meth:`is_done`): sleep until the batch's event
        fires; copy its rows out of the pinned buffers."""
        if isinstance(ticket, EagerTicket):
            return self._run_eager(ticket)
        drv = self._driver
        if drv is not None:
            drv.ensure_context()
        if drv is None or not drv.done(ticket.done.cuda_event):
            ticket.done.synchronize()  # sleeps (blocking-sync event), GIL released
        c0 = time.perf_counter()
        if drv is not None:  # raw cuEventElapsedTime keeps the GIL; torch's releases it three times
            ms = drv.elapsed_ms(ticket.t0.cuda_event, ticket.t1.cuda_event)
            h2d = drv.elapsed_ms(ticket.t_in.cuda_event, ticket.t0.cuda_event)
            d2h = drv.elapsed_ms(ticket.t1.cuda_event, ticket.done.cuda_event)
        else:
            ms = ticket.t0.elapsed_time(ticket.t1)
            h2d, d2h = ticket.t_in.elapsed_time(ticket.t0), ticket.t1.elapsed_time(ticket.done)
        # host time from the launch's return to this thread running again, less the batch's device
        # time: the completion's wake-up (event fired -> watcher, or the loop, holds the GIL), plus
        # the device's start latency, and the wait for a batch launched ahead (lookahead) to get the
        # stream. Biased low by however much device work ran while the launch was still being
        # enqueued (with torch launches, 0.3 ms of enqueueing, a tiny model's batch can give a
        # negative figure)
        wake = (c0 - ticket.launched) * 1e3 - (h2d + ms + d2h)  # t_in -> done, in its three parts
        self._split_wake(ticket, c0)
        if ticket.views:  # the batch's own page-locked buffers: its requests get views of them
            outs = [o[: ticket.n] for o in ticket.out]
        else:  # the lane slot's buffers, which its next batch reuses
            outs = [o[: ticket.n].copy() for o in ticket.out]
        host = (time.perf_counter() - c0) * 1e3
        untimed = ticket.t_in is ticket.t0  # a launch graph's: no event before its input copies
        with self._copy_lock:  # watchers of several lanes
            book_copies(self.copy_ms, h2d, d2h, host, wake, untimed)
            book_copies(self.copy_ms_by_model.setdefault(ticket.model, {}), h2d, d2h, host, wake, untimed)
        return outs, float(ms)

    @property
    def views_buffers(self) -> dict[str, int]:
        """outputs="views": output buffers made (page-locked allocations) and reused from the pool."""
        pool = self._out_pool
        return {"made": pool.made, "reused": pool.reused, "dropped": pool.dropped}

    def _fresh_outputs(self, lane: CudaLane, key: tuple[str, int]) -> tuple | None:
        """outputs="views": page-locked output buffers for one batch alone (tensors, numpy views,
        addresses), shaped as the slot's, from the layer's :class:`BufferPool` (torch's caching host
        allocator on a miss), which takes a buffer back only once the batch's ticket and every view
        handed out of it are gone; so no later batch writes where a request's output lies. None (the
        batch copies out of the slot's buffers instead) when page-locked memory runs out, e.g. while
        callers hold many outputs."""
        like = lane.np_out[key]  # numpy views of the slot's buffers: shape, dtype, nbytes without torch calls
        leased = lease_views(self._out_pool, self.views_bytes, like, lambda i: OutBuffer(lane.pinned_out[key][i]))
        if isinstance(leased, str):
            self._refuse_views(leased)
            return None
        bufs, arrays = leased
        return [buf.tensor for buf in bufs], arrays, [buf.ptr for buf in bufs]

    def _refuse_views(self, why: str) -> None:
        self.views_refused += 1
        if self.views_refused == 1:
            log.warning("outputs=views: %s; copying outputs out instead while it lasts", why)

    def pinned_empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A numpy view of a page-locked torch tensor (alive as long as the view); its span is
        forgotten when the last array onto it is freed."""
        import numpy as np

        return self._track_pinned(
            self._torch.empty(tuple(shape), dtype=_TORCH_DTYPES[str(np.dtype(dtype))], pin_memory=True))

    def register_host(self, address: int, nbytes: int) -> bool:
        if self._driver is None or nbytes <= 0:
            return False
        with self.exclusive():  # page-locking while a graph is being captured would break the capture
            try:
                self._driver.host_register(address, nbytes)
            except Exception as e:  # noqa: BLE001 - the memory is then copied as before
                log.warning("could not page-lock %d MiB of host memory: %s", nbytes >> 20, e)
                return False
        self._add_pinned(address, nbytes)
        return True

    def unregister_host(self, address: int) -> None:
        self._drop_pinned(address)
        if self._driver is not None:
            with self.exclusive():
                try:
                    self._driver.host_unregister(address)
                except Exception as e:  # noqa: BLE001
                    log.warning("could not unregister host memory at %#x: %s", address, e)

    def stage(self, row: Sequence[Any]) -> Sequence[Any]:
        """Submitting thread: the row in pinned host memory (torch's caching host allocator reuses
        freed pinned blocks, and keeps a block until the async copies reading it are done)."""
        torch = self._torch
        out = []
        for a in row:
            t = torch.empty(a.shape, dtype=_TORCH_DTYPES[str(a.dtype)], pin_memory=True)
            t.numpy()[...] = a
            out.append(t)
        return out

    def _run_eager(self, t: EagerTicket) -> tuple[list[Any], float]:
        """Watcher thread: the model's single-stream DAG, eagerly, on the lane's main stream (kernels
        launched into a green context's stream run on its SMs, so this stays confined too)."""
        torch = self._torch
        cm = self.models[t.model]
        st = t.lane.streams.factory()()
        dev = torch.device("cuda", self.device)
        with torch.cuda.stream(st), torch.inference_mode():
            xs = [torch.stack([torch.as_tensor(r[j]) for r in t.rows]).to(dev, non_blocking=False)
                  for j in range(len(t.rows[0]))]
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record(st)
            out = cm._executors["single"].run(xs)
            t1.record(st)
            outs = numpy_outputs(out, len(t.rows))  # .cpu() synchronizes with the stream
        t1.synchronize()
        return outs, float(t0.elapsed_time(t1))

    def _free(self, lanes: Lanes) -> None:
        with self._device_lock:
            self._free_locked(lanes)

    def reclaim(self) -> str:
        done = super().reclaim()
        self._torch.cuda.empty_cache()  # what the collection freed goes back to the driver, for the retried capture
        return done

    def _free_locked(self, lanes: Lanes) -> None:
        """Tear a build down in the only safe order: streams idle, graphs destroyed explicitly,
        cached blocks freed, and only then the partitions' streams and green contexts (a graph or
        a cached block outliving its green context aborts the process when it is finally freed)."""
        import gc

        state = lanes.state
        lanes.state = None
        if not state:
            return
        torch = self._torch
        for lane in state["lanes"]:
            lane.streams.synchronize()
        torch.cuda.synchronize(self.device)
        for lane in state["lanes"]:
            for made in lane.launch_graphs.values():  # before the graphs whose memory they use
                if made:
                    self._driver.destroy_graph(*made)
            lane.launch_graphs.clear()
            for gs in lane.graph_sets():
                gs.release()
            lane.graphs.clear()
            for d in (lane.pinned_in, lane.pinned_out, lane.np_in, lane.np_out, lane.static_out, lane.in_shapes,
                      lane.ptr_in, lane.ptr_out, lane.plans, lane.prepared):
                d.clear()
            lane.events.clear()
        part = state.get("partitioner")
        state["lanes"].clear()
        del state
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        if part is not None:
            part.close()

    def partition_sms(self, lanes: Lanes) -> list[int]:
        """SMs the driver really gave each lane (green contexts); the layout's count for plain streams."""
        state = lanes.state
        out = []
        part = state["partitioner"]
        k = 0
        for lane in state["lanes"]:
            if not lane.part.shared:
                out.append(part[k].sms)
                k += 1
            else:
                out.append(lane.part.sms)
        return out


_TORCH_DTYPES: dict[str, Any] = {}


def _settle(lane: CudaLane, stream: Any) -> None:
    """After a launch failed part way: part of the batch may be queued (copies reading the request
    rows, which raw copies read without torch knowing, and writing the output buffers). Let it finish
    before either can be freed."""
    try:
        stream.synchronize()
    except Exception:  # noqa: BLE001 - a broken context runs nothing more either
        log.debug("synchronizing lane %s after a failed launch", lane.part, exc_info=True)


def _pinned_spans(rows: Rows) -> list | None:
    """Per row, per input, ``(address, bytes)`` where every row is page-locked already: stage()'s
    torch tensors or a :class:`PinnedRow`'s arrays. None where a row is plain numpy (not staged)."""
    spans = []
    for r in rows:
        if type(r) is PinnedRow:
            spans.append([(a.__array_interface__["data"][0], a.nbytes) for a in r])
            continue
        try:
            spans.append([(t.data_ptr(), t.nbytes) for t in r])
        except AttributeError:  # numpy arrays: the lane's own pinned buffers take them
            return None
    return spans


def _host_span(t: Any) -> tuple[int, int]:
    """(address, bytes) of a host row: a torch tensor or a numpy array."""
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        return ai["data"][0], t.nbytes
    return t.data_ptr(), t.nbytes


def _init_dtypes() -> None:
    import torch

    for name in ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"):
        _TORCH_DTYPES[name] = getattr(torch, name)


__all__ = ["CudaDeviceLayer", "LANE_SLOTS", "OUTPUTS", "LANE_STREAMS", "book_copies", "check_lane_streams", "check_outputs"]
