"""Capture a stream-planned run into CUDA graphs, one per batch bucket.

A :class:`GraphSet` holds, per bucket, a graph plus its static input and output buffers. Kernels of
a graph run on the SMs of the context whose streams it was captured on, wherever it is replayed:
give :func:`capture_graphs` a ``stream_factory`` from an SM partition to confine the graphs to it.

What must stay alive: the graphs reference the model's parameters, the static buffers and the
graph memory pool; the GraphSet keeps all of them (and the streams) referenced. Nothing else: the
cuBLAS workspaces a graph's matmuls use are allocated inside its pool (:func:`cublas_workspaces_in_pool`).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .dag import CaptureError, with_batch
from .executor import ForwardExecutor, StreamExecutor

StreamFactory = Callable[[], torch.cuda.Stream]
#: candidates of "auto" that may fail to capture without failing the compile (the DAG's own must not)
OPTIONAL_KINDS = ("forward", "single_cl", "multi_cl")

# cuDNN's autotuner runs during each capture's warm-up. On a small SM partition (a green context of
# 8-16 SMs) some of the algorithms it tries fail to launch (CUDNN_STATUS_EXECUTION_FAILED, seen on
# the H200): a caller can then retry with its heuristics only (``with cudnn_heuristics(): ...``).
_CUDNN_AUTOTUNE = [True]


class cudnn_heuristics:
    """Context manager: captures inside it pick cuDNN algorithms by heuristics, without autotuning."""

    def __enter__(self) -> "cudnn_heuristics":
        self._saved = _CUDNN_AUTOTUNE[0]
        _CUDNN_AUTOTUNE[0] = False
        return self

    def __exit__(self, *exc: Any) -> None:
        _CUDNN_AUTOTUNE[0] = self._saved


@dataclass(frozen=True)
class InputSpec:
    """One model input, without its batch dimension."""

    name: str
    shape: tuple[int, ...]  # per-sample shape
    dtype: torch.dtype
    device: torch.device

    def describe(self, batch: str = "B") -> str:
        dims = ", ".join([batch, *map(str, self.shape)])
        return f"{self.name}: {str(self.dtype).removeprefix('torch.')}[{dims}] on {self.device}"


@dataclass
class CapturedBucket:
    """One bucket's graph and its static buffers (zero-copy views are into these)."""

    batch: int
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Any
    kind: str  # "single", "multi" (the DAG on one stream or on its plan's), "forward" (the model's own),
    # "single_cl" / "multi_cl" (the channels-last DAG, compile(channels_last="auto"))
    num_streams: int
    latency_ms: float | None = None  # measured at compile time when streams="auto"


@dataclass
class GraphSet:
    """CUDA graphs of one model, one per bucket, captured on ``streams`` (``streams[0]`` is main)."""

    buckets: dict[int, CapturedBucket]
    streams: list[torch.cuda.Stream]
    pool: Any
    memory_bytes: int  # graph pool + static buffers, bytes
    skipped: dict[int, str] = field(default_factory=dict)  # bucket -> which optional candidates "auto" left out, why

    @property
    def stream(self) -> torch.cuda.Stream:
        """The main capture stream: replays default to it."""
        return self.streams[0]

    def inputs(self, bucket: int) -> list[torch.Tensor]:
        return self.buckets[bucket].inputs

    def outputs(self, bucket: int) -> Any:
        return self.buckets[bucket].outputs

    def release(self) -> None:
        """Destroy every graph now (``CUDAGraph.reset``) and drop the buffers.

        Call it, after the streams are idle, before the streams' green context is destroyed: a
        graph whose context is gone must not be destroyed later by the garbage collector (the
        driver aborts the process)."""
        for entry in self.buckets.values():
            entry.graph.reset()
        self.buckets.clear()
        self.pool = None

    def replay(self, bucket: int, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue one replay on ``stream`` (default: the capture stream). Asynchronous.

        Replays of one GraphSet share a memory pool: issue them on one stream (or serialize them).
        """
        entry = self.buckets[bucket]
        with torch.cuda.stream(stream if stream is not None else self.stream):
            entry.graph.replay()

    def __repr__(self) -> str:
        kinds = {b: f"{e.kind}/{e.num_streams}" for b, e in sorted(self.buckets.items())}
        return f"GraphSet(buckets={kinds}, memory={self.memory_bytes / 2**20:.1f} MiB, stream={self.stream})"


def example_batch(examples: Sequence[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """Inputs of ``batch`` rows made by repeating the user's example rows (valid token ids stay valid)."""
    return [with_batch(x, batch).clone() for x in examples]


class _HostSyncError(RuntimeError):
    """Raised by :class:`_NoHostSync` (kept apart from other errors of the same run, e.g. out of memory)."""


class _NoHostSync(TorchDispatchMode):
    """Raises at an op that reads a device value on the host (``.item()``, ``nonzero``, a copy to the
    CPU): under capture it would invalidate the graph. A dispatch mode is per thread, so models being
    served by other threads meanwhile are not affected (torch's sync debug mode is process-wide)."""

    _READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.ops.aten._to_copy.default and str(kwargs.get("device", "")).startswith("cpu")
        if func in self._READS or to_host or "unique" in func.name():  # aten::_unique2, unique_dim, ...: sized on the host
            raise _HostSyncError(f"host synchronization in the forward: {func.name()} reads a device value on the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cublas_workspaces_in_pool() -> Iterator[None]:
    """Wrap a capture so that its matmuls' cuBLAS workspaces come from the graph's own pool.

    torch keeps one cuBLAS workspace per (handle, stream), made at the stream's first matmul and kept
    in a process-wide map. The warm-up runs before a capture, on the capture's own streams, make them
    in the ordinary pool, and the graph bakes in their addresses. Whoever clears that map frees them
    while the graph still writes to them: ``torch.compile(mode="reduce-overhead")`` does, at every
    capture of its own (engine runs 26-28: an illegal memory access at the next replay of nasnetalarge
    float16; elsewhere, memory silently shared with whatever reuses it). So clear the map before the
    capture (the graph's matmuls make theirs inside its pool, where they stay reserved for it; later
    captures into the same pool may reuse them, as they reuse its intermediates, which is safe because
    a GraphSet's replays take turns) and after it (later eager matmuls on these streams do not borrow
    the graph's memory), as torch's cudagraph trees do. One gpuloom capture at a time in the process
    (engine, ``Partition.capture_graph``, the profiler): another's clear would free this capture's
    workspaces in the middle of it. Other code that clears the map (torch.compile) is not held off."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    with _CUBLAS_CAPTURE:
        if clear is None:  # a torch without the map: nothing to clear
            yield
            return
        clear()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # (a sticky CUDA error): the capture's own error is the one to see
                clear()
            raise
        clear()


_CUBLAS_CAPTURE = threading.Lock()


def _capture_one(
    executor: StreamExecutor, streams: list[torch.cuda.Stream], static_in: list[torch.Tensor], pool: Any, warmup: int,
    *, strict_sync: bool = False, keep_graph: bool = False,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm up, then capture one run of ``executor``. ``strict_sync``: one more warm-up run, under
    :class:`_NoHostSync`, so that a host synchronization in the code (``.item()``, ``nonzero``) raises
    there, eagerly, instead of invalidating the capture (the user's own forward: the DAG has none,
    export would have refused them). ``keep_graph``: keep the captured ``cudaGraph_t`` beside its
    instantiation (``graph.raw_cuda_graph()``), where this torch can, for a graph that embeds it."""
    main, caller = streams[0], torch.cuda.current_stream()
    main.wait_stream(caller)
    with torch.cuda.stream(main):
        for _ in range(warmup):  # cuDNN benchmark and lazy inits happen here, not under capture
            executor.run(static_in, streams)
        if strict_sync:
            try:
                with _NoHostSync():
                    executor.run(static_in, streams)
            except _HostSyncError as e:
                raise _capture_error(executor, e) from e
    torch.cuda.synchronize()
    graph = _new_graph(keep_graph)
    try:
        with rng_restored_if_capture_fails(main.device), cublas_workspaces_in_pool(), \
                torch.cuda.graph(graph, pool=pool, stream=main, capture_error_mode="thread_local"):
            out = executor.run(static_in, streams)
    except Exception as e:
        torch.cuda.set_stream(caller)  # torch.cuda.graph's exit raised before it gave the stream back
        raise _capture_error(executor, e) from e
    if keep_graph and hasattr(graph, "instantiate"):  # kept graphs are instantiated on request
        graph.instantiate()
    return graph, out


def _new_graph(keep_graph: bool) -> torch.cuda.CUDAGraph:
    if keep_graph:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # a torch before keep_graph: the graph is not kept
            pass
    return torch.cuda.CUDAGraph()


@contextlib.contextmanager
def rng_restored_if_capture_fails(device: torch.device | int | None = None) -> Iterator[None]:
    """Wrap a CUDA graph capture on ``device`` (default: the current one). A failed capture never
    reaches the RNG's capture epilogue: the device's default generator stays "capturing", and every
    later ``torch.randn`` on that device raises ("Offset increment outside graph capture encountered
    unexpectedly"), in every model of the process. On failure, give the generator a copy of its
    state from before the capture. Graphs captured earlier keep the old state object: fine for
    inference graphs (no random ops, so no offsets to share), but random ops in those graphs and
    later eager ones would no longer draw from one sequence."""
    index = device.index if isinstance(device, torch.device) else device
    rng = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    before = rng.clone_state()
    try:
        yield
    except BaseException:
        rng.graphsafe_set_state(before)
        raise


def _capture_error(executor: StreamExecutor, e: BaseException) -> CaptureError:
    """The error a user sees: where the capture failed and what to change."""
    node = executor.last_node
    where = (f"op {node.target} (graph node {node.name!r})" if node is not None
             else "the model's forward" if isinstance(executor, ForwardExecutor) else "the first op")
    return CaptureError(
        f"CUDA graph capture failed at {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
        "Ops that synchronize with the host (.item(), nonzero, data-dependent shapes) cannot be captured; "
        "move them out of forward()."
    )


def time_replays(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, *, warmup: int = 5, iters: int = 20) -> float:
    """Median ms of single replays on ``stream``, timed with CUDA events."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            graph.replay()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture_graphs(
    executors: dict[str, StreamExecutor],
    examples: Sequence[torch.Tensor],
    buckets: Sequence[int],
    *,
    choice: str,
    stream_factory: StreamFactory | None = None,
    warmup: int = 3,
    keep_graph: bool = False,
) -> GraphSet:
    """Capture one graph per bucket (``keep_graph``: see :func:`_capture_one`).

    ``executors`` maps "single" / "multi" (and optionally "forward", "single_cl" / "multi_cl") to
    executors; ``choice`` is one of those or "auto": capture each candidate, time it, keep the fastest
    per bucket. In "auto" the DAG's candidates must capture; the forward and the channels-last DAG
    (:data:`OPTIONAL_KINDS`) are skipped, with the reason in ``skipped``, where they cannot (a host
    sync in the user's code that the DAG does not have; a convolution that fails channels-last).
    Streams come from
    ``stream_factory`` (default: new torch streams on the current device), the first one being the
    capture stream. Buckets are captured largest first so smaller ones reuse the shared pool's memory.
    """
    factory = stream_factory or (lambda: torch.cuda.Stream())
    need = max(e.plan.num_streams for e in executors.values())
    streams = [factory() for _ in range(need)]
    pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    kinds = [choice]
    if choice == "auto":
        kinds = ["single"] + (["multi"] if executors["multi"].plan.num_streams > 1 else [])
        kinds += ["forward"] if "forward" in executors else []
        if "single_cl" in executors:  # compile(channels_last="auto"): the NHWC DAG competes too
            kinds += ["single_cl"] + (["multi_cl"] if executors["multi_cl"].plan.num_streams > 1 else [])
    skipped: dict[int, str] = {}
    skipped_kinds: dict[str, str] = {}  # an optional candidate that failed once, and why

    def skip(bucket: int, why: str) -> None:  # a bucket may leave out several optional candidates
        skipped[bucket] = "; ".join(filter(None, (skipped.get(bucket), why)))

    cudnn_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = _CUDNN_AUTOTUNE[0]
    captured: dict[int, CapturedBucket] = {}
    static_bytes = 0
    try:
        with torch.no_grad():
            for b in sorted(buckets, reverse=True):
                static_in = example_batch(examples, b)
                static_bytes += sum(t.numel() * t.element_size() for t in static_in)
                best: CapturedBucket | None = None
                for kind in kinds:
                    if kind in skipped_kinds:
                        skip(b, skipped_kinds[kind])
                        continue
                    ex = executors[kind]
                    optional = kind in OPTIONAL_KINDS and len(kinds) > 1
                    try:
                        graph, out = _capture_one(ex, streams, static_in, pool, warmup,
                                                  strict_sync=kind == "forward", keep_graph=keep_graph)
                    except Exception as e:  # noqa: BLE001 - only the optional candidate may fail
                        if not optional:
                            raise
                        # try this candidate in no other bucket (what failed here fails there)
                        torch.cuda.synchronize()
                        why = f"{kind}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        skip(b, why)
                        if not isinstance(e, torch.cuda.OutOfMemoryError):  # a smaller bucket may fit
                            skipped_kinds[kind] = why
                        continue
                    entry = CapturedBucket(b, graph, static_in, out, kind, ex.plan.num_streams)
                    if len(kinds) > 1:
                        entry.latency_ms = time_replays(graph, streams[0])
                    if best is None or entry.latency_ms < best.latency_ms:
                        best = entry
                captured[b] = best
    finally:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.cuda.synchronize()
    memory = torch.cuda.memory_reserved() - before
    return GraphSet(buckets=captured, streams=streams, pool=pool, memory_bytes=max(memory, static_bytes),
                    skipped=skipped)
