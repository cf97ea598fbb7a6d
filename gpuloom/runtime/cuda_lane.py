"""What the CUDA device layer keeps per lane and per batch: a lane's streams, page-locked buffers,
events and prepared launches (:class:`CudaLane`), a launched batch's ticket (:class:`CudaTicket`), and
the checks of the layer's string options. Split out of ``cuda_device.py`` (forty-seventh session) so
the layer's module holds its behaviour and this one its state.

torch is imported only where a buffer is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..policy.types import Partition


class StreamList:
    """The streams of one lane: ``factory()`` hands them out from the first, creating more on demand
    (so every model captured on the lane shares its few streams; one batch runs at a time)."""

    def __init__(self, maker: Callable[[], Any]) -> None:
        self.maker = maker
        self.streams: list[Any] = []

    def synchronize(self) -> None:
        """Wait until every stream of the lane is idle."""
        for s in self.streams:
            s.synchronize()

    def factory(self) -> Callable[[], Any]:
        k = [0]

        def next_stream() -> Any:
            while len(self.streams) <= k[0]:
                self.streams.append(self.maker())
            s = self.streams[k[0]]
            k[0] += 1
            return s

        return next_stream


#: batches a lane may hold at once: the running one and one launched ahead
LANE_SLOTS = 2
#: a lane's GPU clock is tied to the host's again after this long (cuEventElapsedTime is a float32 of
#: ms: over minutes its resolution falls to tens of us)
ANCHOR_S = 60.0
#: CudaDeviceLayer(lane_streams=...): each bucket's compile-time stream choice, or one stream everywhere
LANE_STREAMS = ("compiled", "single")


#: CudaDeviceLayer(outputs=...): how a finished batch's rows reach its requests
OUTPUTS = ("copies", "views")


class OutBuffer:
    """A page-locked output buffer shaped as ``like`` (a torch tensor), with what a launch needs of it
    made once: its bytes (numpy arrays are made over them per batch) and its address."""

    __slots__ = ("tensor", "memory", "ptr")

    def __init__(self, like: Any) -> None:
        import torch

        self.tensor = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        self.memory = memoryview(self.tensor.numpy()).cast("B")  # keeps the tensor's memory alive
        self.ptr = self.tensor.data_ptr()


def check_outputs(outputs: str, raw_launch: bool = True) -> str:
    """``outputs`` unchanged, or ValueError unless it is one of :data:`OUTPUTS` (and "views" comes with
    raw launches: see :class:`~gpuloom.runtime.cuda_device.CudaDeviceLayer`)."""
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs: expected one of {OUTPUTS}, got {outputs!r}")
    if outputs == "views" and not raw_launch:
        raise ValueError("outputs='views' needs raw_launch=True: torch's copy ties a view's page-locked "
                         "buffer to the lane's stream, and freeing it after the layout closed aborts the "
                         "process; use outputs='copies' with torch launches")
    return outputs


def check_lane_streams(lane_streams: str) -> str:
    """``lane_streams`` unchanged, or ValueError unless it is one of :data:`LANE_STREAMS`."""
    if lane_streams not in LANE_STREAMS:
        raise ValueError(f"lane_streams: expected one of {LANE_STREAMS}, got {lane_streams!r}")
    return lane_streams


@dataclass
class CudaLane:
    """One lane of a layout (a partition's green context or the shared streams): its captured graphs
    and, per model, the buffers, events and prepared launches its batches use in turn."""

    part: Partition
    streams: StreamList
    confined: bool  # kernels captured here run on this lane's SMs only
    graphs: dict[str, dict[int, Any]] = field(default_factory=dict)  # model -> bucket -> GraphSet
    # Host buffers and events come in LANE_SLOTS sets, used in turn: a lane holds its running batch and
    # at most one launched ahead (Runtime.lookahead_ms), and batch k reuses the set of batch
    # k - LANE_SLOTS, whose outputs its watcher copied out before the runtime could launch batch k.
    pinned_in: dict[tuple[str, int], list[Any]] = field(default_factory=dict)  # (model, slot) -> pinned (max_batch, ...)
    pinned_out: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    np_in: dict[tuple[str, int], list[Any]] = field(default_factory=dict)  # numpy views of pinned_in
    np_out: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    static_out: dict[tuple[str, int], list[Any]] = field(default_factory=dict)  # (model, bucket) -> flat outputs
    ptr_in: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (model, slot) -> pinned_in addresses
    ptr_out: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (model, slot) -> pinned_out addresses
    plans: dict[tuple[str, int], Any] = field(default_factory=dict)  # (model, bucket) -> LaunchPlan, or None: torch path
    events: list[tuple] = field(default_factory=list)  # per slot: (t_in, t0, t1, done)
    in_shapes: dict[str, list[tuple]] = field(default_factory=dict)  # model -> (shape, dtype) per input, max_batch rows
    launches: int = 0  # batches launched on the lane (slot = launches % LANE_SLOTS)
    # (model, batch size, slot) -> Prepared: what a raw launch of it looks up, made by its first launch
    prepared: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    # (model, bucket, slot) -> (graph, exec) of the bucket's launch graph with the slot's events and
    # output buffers (CudaDeviceLayer(launch_graphs=True)), or None where it could not be made
    launch_graphs: dict[tuple[str, int, int], tuple[int, int] | None] = field(default_factory=dict)
    # (event, perf_counter) recorded together on the idle stream: any later event of the lane is at
    # perf_counter time anchor[1] + elapsed(anchor[0], event) (CudaDeviceLayer._anchor)
    anchor: tuple | None = None

    def graph_sets(self) -> list[Any]:
        """Each GraphSet once (a model's buckets share one per single/multi-stream group)."""
        return list({id(gs): gs for sets in self.graphs.values() for gs in sets.values()}.values())


def book_copies(sums: dict[str, float], h2d: float, d2h: float, host_out: float, wake: float,
                h2d_untimed: bool = False) -> None:
    """Add one batch's copy and wake-up ms to ``sums`` (``CudaDeviceLayer.copy_ms`` and its per-model
    twin): device ms copying inputs in and outputs out, host ms copying outputs off the pinned
    buffers, host ms from launch to the watcher awake beyond the device's work. ``h2d_untimed``: a
    launch-graph batch, whose input copies were not timed (h2d 0): their device time is in its wake
    (and in ``wake_split``'s start); ``h2d_untimed`` counts such batches."""
    for key, ms in (("h2d", h2d), ("d2h", d2h), ("host_out", host_out), ("wake", wake)):
        sums[key] = sums.get(key, 0.0) + ms
    sums["batches"] = sums.get("batches", 0) + 1
    if h2d_untimed:
        sums["h2d_untimed"] = sums.get("h2d_untimed", 0) + 1


@dataclass
class EagerTicket:
    """A model without a graph on this lane: run it eagerly on the lane's stream in the watcher."""

    lane: CudaLane
    model: str
    rows: Any


@dataclass(frozen=True, slots=True)
class Prepared:
    """One (model, batch size, slot) of a lane, ready for a raw launch: the bucket's
    :class:`~gpuloom.gpu.launch.LaunchPlan`, the slot's events and pinned outputs. Why: looking these
    up per batch (bucket, graph set, plan, slot buffers, events) cost the runtime's thread more host
    time than the launch's own driver calls on the H200 (run 89: 84 us a launch against 25); launching
    from this took 5-16 us of host time per batch off the runtime's thread on mix6 at batch 1 (runs 92-93)."""

    plan: Any  # LaunchPlan
    stream: Any  # the lane's torch stream the plan launches on (clock anchor; a failed launch waits on it)
    events: tuple  # (t_in, t0, t1, done) torch events of the slot
    raw: tuple  # their driver handles
    out_np: list  # numpy views of the slot's pinned output buffers
    out_ptr: list  # their addresses
    launch_graph: int = 0  # the bucket's launch graph for this slot (exec handle), 0 where there is none


@dataclass(slots=True)
class CudaTicket:
    n: int
    done: Any  # torch.cuda.Event(blocking=True), after the outputs' copy
    t0: Any  # timing events around the replay
    t1: Any
    t_in: Any  # before the inputs' copy
    out: list[Any]  # numpy views of the pinned output buffers
    rows: Any = None  # the batch's staged rows, alive until finish()
    launched: float = 0.0  # perf_counter when the launch returned (the wake-up's reference)
    stream: int = 0  # the lane stream's driver handle, where launched by raw driver calls (else 0)
    began: float = 0.0  # perf_counter when the launch's first call was made
    anchor: tuple | None = None  # the lane's clock anchor at launch (CudaLane.anchor)
    model: str = ""  # whose batch: the copies and the wake-up are booked per model too
    views: bool = False  # ``out`` are this batch's own buffers (outputs="views"): handed out, not copied
