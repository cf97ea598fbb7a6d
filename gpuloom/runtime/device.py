"""Device layers: what the execution backend (:mod:`gpuloom.runtime.exec_backend`) runs batches on.

A :class:`DeviceLayer` turns a policy's :class:`~gpuloom.policy.types.Layout` into *lanes* (one per
layout partition) and runs one batch at a time per lane in two halves:

* :meth:`DeviceLayer.launch` -- on the runtime's thread, must return quickly: stage the batch's rows
  and enqueue the work (on CUDA: rows into pinned host buffers, async H2D copy, graph replay, async
  D2H copy, an event; nothing waits);
* :meth:`DeviceLayer.finish` -- on the lane's watcher thread: block until the batch is done (CUDA:
  ``event.synchronize()`` on a blocking-sync event, no busy spin) and return its outputs as numpy
  arrays plus the device time in ms.

This module holds the contract (:class:`DeviceLayer`, :class:`Lanes`, the build thread, the errors)
and :func:`make_device_layer`; the layers live beside it:

* :class:`~gpuloom.runtime.cuda_device.CudaDeviceLayer` (``cuda_device.py``) -- exclusive partitions
  are disjoint green contexts (:class:`gpuloom.gpu.Partitioner`), shared lanes are plain streams (over
  the SMs the exclusive partitions leave, themselves a green context, or the whole GPU when there are
  none). Graphs are captured per (model, lane) on that lane's streams, so they stay confined; graph
  memory is accounted and bounded (:class:`GraphMemoryError`, LRU eviction of cached layouts). Its
  page-locked output buffers are lent from :mod:`gpuloom.runtime.pinned`.
* :class:`~gpuloom.runtime.host_device.CpuDeviceLayer` (``host_device.py``) -- runs ``CompiledModel``
  (its CPU path) in the watcher threads.
* :class:`~gpuloom.runtime.host_device.FakeDeviceLayer` (``host_device.py``) -- numpy functions with a
  configurable latency and injected failures, for the runtime's tests.

None of these modules imports torch or numpy at import time; the CPU and CUDA layers import torch when
constructed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..policy.types import Layout, Partition

log = logging.getLogger(__name__)

Rows = Sequence[Sequence[Any]]  # per request: one numpy array per model input (one sample, no batch dim)


class GraphMemoryError(MemoryError):
    """The captured graphs of a layout do not fit the device layer's graph-memory budget."""


class DeviceFault(RuntimeError):
    """A failure injected with :meth:`DeviceLayer.inject_fault` (tests, the GPU check)."""


class ShortCarving(RuntimeError):
    """The driver gave partitions of a carving fewer SMs than the layout asked for: ``short`` lists
    (asked, given) per such partition, ``ratio`` is the worst asked / given (how much slower the
    partition would run than planned, at best)."""

    def __init__(self, short: list[tuple[int, int]], carving: str) -> None:
        self.short = [list(x) for x in short]
        self.ratio = round(max(a / max(g, 1) for a, g in short), 3)
        shown = ", ".join(f"{g} SMs for {a}" for a, g in short)
        super().__init__(f"the driver gave {shown} (carved {carving})")


@dataclass
class Lanes:
    """One layout made real: its lanes, the graphs captured on them, their memory (bytes)."""

    layout: Layout
    key: tuple  # what makes two builds interchangeable: the layout and the model set
    memory_bytes: int = 0  # graph memory held by this build (pools + static buffers)
    users: int = 0  # the backend's references (current layout, draining batches)
    state: Any = None  # the layer's own data (streams, partitioner, graphs)
    models: tuple[str, ...] = ()

    def __repr__(self) -> str:
        parts = ", ".join(p.label or repr(p) for p in self.layout.partitions)
        return f"Lanes([{parts}], models={list(self.models)}, memory={self.memory_bytes / 2**20:.1f} MiB)"


def layout_key(layout: Layout) -> tuple:
    """Two layouts with the same key can share a build."""
    return (layout.gpu_sms, tuple((p.sm_offset, p.sms, p.shared, p.owner) for p in layout.partitions))


def allowed(p: Partition, model: str) -> bool:
    """Is ``model`` expected on partition ``p``? An owner is only a hint (dstack lets a model run on
    another model's partition when its own are busy): layers capture graphs where it is expected and
    must still run a model elsewhere (the CUDA layer then runs it eagerly on the lane's stream)."""
    return p.owner is None or p.owner == model


class Builder:
    """One long-lived thread that runs a device layer's builds, and the compiles and profiling of the
    models it serves, in order.

    Why one thread: PyTorch keeps cuDNN's autotuning results per thread (the benchmark cache of its
    cuDNN v8 API is ``thread_local``). Each build used to run on a thread of its own and timed every
    convolution of every model at every batch size again: on the H200 a layout of the example
    repository's three small models took 5.4 s to build that way, and 0.36 s on a thread that had
    built it before (runs 115-116, ``scripts/diag_build_profile.py``); during a re-plan those timings
    ran beside the models being served. Compiling on this thread too leaves its timings in the cache
    the captures read."""

    def __init__(self, name: str = "gpuloom-build") -> None:
        self.name = name
        self._q: "queue.SimpleQueue[tuple[Callable[[], Any] | None, concurrent.futures.Future | None]]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the thread after what was submitted before; its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()
            self._q.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the thread, waiting for it (inline when called from the thread itself)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def stop(self) -> None:
        """End the thread once what was submitted has run."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._q.put((None, None))
            self._thread = None

    def _run(self) -> None:
        while True:
            fn, fut = self._q.get()
            if fn is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller's to see
                fut.set_exception(e)
            del fn, fut  # nothing of a finished job stays alive on this thread (a model's graphs, weights)


class DeviceLayer(ABC):
    """Where batches run. Who calls what:

    * the service: :meth:`add_model` / :meth:`remove_model` (any thread, not while a build runs);
    * the backend's builder thread: :meth:`build` (slow: captures), then the runtime's thread uses the
      result; :meth:`release` when no batch runs on a build any more;
    * the runtime's thread: :meth:`launch` (asynchronous); the lane's watcher thread: :meth:`finish`.

    Subclasses implement :meth:`_build`, :meth:`_launch`, :meth:`finish` and may override
    :meth:`_estimate` (bytes a build will need) and :meth:`_free` (release a build).
    """

    kind: str = ""
    gpu_sms: int = 132
    granularity: int = 8
    #: True when :meth:`stage` copies a row (callers need not copy their arrays first)
    stages: bool = False

    #: ``(model, batch, sms) -> ms`` a batch should take alone on a partition of ``sms`` SMs (its
    #: profile), or None where unknown. Set by the service; the CUDA layer checks a carving against it.
    expected_ms: Callable[[str, int, int], float | None] | None = None

    #: whether a layout can be built while another one runs batches (ExecBackend.builds_while_serving).
    #: CUDA sets it once its GPU test showed graph capture beside other streams' replays is safe.
    builds_while_serving = False

    def stage(self, row: Sequence[Any]) -> Sequence[Any]:
        """Called on the *submitting* thread with one row (one array per input): make it ready to
        launch (CUDA: copy it into pinned host memory, so the runtime's thread only issues async
        copies). Default: the row as is."""
        return row

    def __init__(self, *, memory_limit_bytes: float = float("inf"), cache_layouts: int = 4) -> None:
        # host memory the device copies from directly (start, end), sorted: rows that lie in it are
        # launched from where they are, without stage()'s copy (see is_pinned)
        self._pinned: list[tuple[int, int]] = []
        self._pinned_lock = threading.Lock()
        self.models: dict[str, Any] = {}
        #: where the last build's time went, seconds by phase (CUDA: carving, captures, uploads, ...)
        self.build_phases: dict[str, float] = {}
        self._gen: dict[str, int] = {}  # model -> version, so a reloaded model is never served stale graphs
        self.memory_limit_bytes = memory_limit_bytes
        self.cache_layouts = cache_layouts
        self._cache: OrderedDict[tuple, Lanes] = OrderedDict()  # LRU of builds, oldest first
        self._lock = threading.RLock()
        self._faults: dict[str, str] = {}
        self.evictions = 0
        self.oom_reclaims = 0  # full collections run because a build or a load ran out of memory (reclaim)
        # Held while graphs are captured or freed. A CUDA graph capture fails if another thread
        # allocates or frees device memory meanwhile: callers doing such work off the hot path
        # (compiling, eager reference runs) hold it too (``with layer.exclusive(): ...``).
        self._device_lock = threading.RLock()

    @property
    def builder(self) -> Builder:
        """The thread this layer's builds run on (:class:`Builder`; made on first use)."""
        return self.__dict__.setdefault("_builder", Builder())  # (tests make layers without __init__)

    def exclusive(self) -> "threading.RLock":
        """A context manager: no capture or build runs while it is held."""
        return self._device_lock

    # -- host memory the device reads in place ----------------------------------------------------
    def pinned_empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A numpy array in host memory this device copies from directly (CUDA: page-locked).
        A request whose inputs lie in such memory is not copied at submit (:meth:`is_pinned`): its
        caller must leave the arrays alone until the request is answered. Plain memory here."""
        import numpy as np

        return np.empty(tuple(shape), dtype=dtype)

    def register_host(self, address: int, nbytes: int) -> bool:
        """Make ``nbytes`` of host memory at ``address`` readable in place (CUDA: page-lock it), e.g.
        a front-end worker's shared arena. False where this device does not. Undo with
        :meth:`unregister_host` before the memory goes away."""
        return False

    def unregister_host(self, address: int) -> None:
        """Undo :meth:`register_host`."""

    def is_pinned(self, arrays: Sequence[Any]) -> bool:
        """Whether every numpy array of ``arrays`` lies in memory from :meth:`pinned_empty` or
        :meth:`register_host`."""
        import bisect

        spans = self._pinned
        if not spans:
            return False
        for a in arrays:
            start = a.__array_interface__["data"][0]
            i = bisect.bisect_right(spans, (start, float("inf"))) - 1
            if i < 0 or start + a.nbytes > spans[i][1]:
                return False
        return True

    def _add_pinned(self, address: int, nbytes: int) -> None:
        import bisect

        with self._pinned_lock:
            spans = list(self._pinned)
            bisect.insort(spans, (address, address + nbytes))
            self._pinned = spans  # readers see the old or the new list, never a half-made one

    def _track_pinned(self, tensor: Any) -> Any:
        """A numpy view of ``tensor`` (host memory the device reads in place) whose span is known to
        :meth:`is_pinned` for as long as any array onto that memory lives. The span's lifetime is
        tied to the array's ``base``, not to ``tensor``: torch hands numpy its own alias of the
        tensor, so ``tensor``'s Python object can die (and a finalizer on it fire) while the array
        still reads the memory; the base lives exactly as long as the array and its views."""
        import weakref

        a = tensor.numpy()
        if a.nbytes:
            addr = a.__array_interface__["data"][0]
            self._add_pinned(addr, a.nbytes)
            weakref.finalize(a.base if a.base is not None else a, self._drop_pinned, addr)
        return a

    def _drop_pinned(self, address: int) -> None:
        with self._pinned_lock:
            self._pinned = [sp for sp in self._pinned if sp[0] != address]

    # -- models ---------------------------------------------------------------------------------
    def add_model(self, name: str, model: Any) -> None:
        """``model`` under ``name``; builds with an earlier model of that name are no longer served.
        The very model already there (another service on a shared layer loading the same compiled
        model) changes nothing: the builds that hold its graphs stay cached."""
        with self._lock:
            if self.models.get(name) is model:
                return
            self.models[name] = model
            self._gen[name] = self._gen.get(name, 0) + 1
            self._evict_unused(lambda ln: name in ln.models)

    def remove_model(self, name: str) -> None:
        with self._lock:
            self.models.pop(name, None)
            self._evict_unused(lambda ln: name in ln.models)

    def inject_fault(self, model: str, message: str | None) -> None:
        """Make every batch of ``model`` fail with ``message`` (``None`` heals it)."""
        with self._lock:
            if message is None:
                self._faults.pop(model, None)
            else:
                self._faults[model] = message

    # -- builds ---------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Graph memory held by every cached build, bytes."""
        with self._lock:
            return sum(ln.memory_bytes for ln in self._cache.values())

    def build(self, layout: Layout) -> Lanes:
        """Lanes for ``layout`` with every loaded model captured where it may run (cached, LRU).

        Raises :class:`GraphMemoryError` when the build cannot fit the graph-memory budget even after
        evicting every unused cached build.
        """
        if layout.gpu_sms != self.gpu_sms:
            raise ValueError(f"layout made for {layout.gpu_sms} SMs; this {self.kind} device has {self.gpu_sms}")
        with self._lock:
            models = tuple(sorted(self.models))
            key = (layout_key(layout), tuple((m, self._gen[m]) for m in models))
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                hit.users += 1
                return hit
            need = self._estimate(layout, models)
            self._make_room(need, f"layout {layout_key(layout)[1]} with models {list(models)}")
        lanes = Lanes(layout, key, models=models)
        t0 = time.perf_counter()
        self.build_phases = {}
        try:
            with self._device_lock:
                self._build(lanes)
        except MemoryError as first:  # GraphMemoryError, or e.g. torch.OutOfMemoryError in a capture
            # What only this can free first: cached builds no backend uses, and an unloaded model's
            # graphs and weights, which wait for the next full collection (gcpause.thaw: its cycles
            # are not freed by reference counts), made rare by RareFullCollections; on the H200 an
            # unloaded 21 MiB model held its 21 MiB until then (docs/reports/runtime.md). Then once more.
            # (No lock held here: trim takes _lock before _device_lock, as release does.)
            self._free(lanes)
            trimmed = self.trim()
            freed = self.reclaim()
            log.info("out of memory building %r (%s); freed %d unused cached builds, collected garbage (%s); "
                     "retrying once", lanes, first, trimmed, freed)
            lanes = Lanes(layout, key, models=models)
            try:
                with self._device_lock:
                    self._build(lanes)
            except MemoryError as e:
                self._free(lanes)
                if isinstance(e, GraphMemoryError):
                    raise
                raise GraphMemoryError(f"out of device memory while capturing {lanes!r}: {e} (also after freeing "
                                       f"unused cached builds and a full garbage collection); budget "
                                       f"{self.memory_limit_bytes / 2**20:.0f} MiB") from e
        with self._lock:
            lanes.users += 1
            self._cache[key] = lanes
            while len(self._cache) > self.cache_layouts and self._evict_one(keep=key):
                pass
            while self.memory_bytes() > self.memory_limit_bytes and self._evict_one(keep=key):
                pass  # the estimate was low: make room after the fact (what is in use stays)
        # on the CPU the "partitions" are the planner's bookkeeping, not SMs: not news to a server's operator
        phases = "".join(f", {k} {v:.1f} s" for k, v in self.build_phases.items())
        log.log(logging.DEBUG if self.kind == "cpu" else logging.INFO, "built %r in %.1f s%s", lanes,
                time.perf_counter() - t0, phases)
        return lanes

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Add the time of the block to this build's ``build_phases[name]`` (the "built" log line)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            phases = self.__dict__.setdefault("build_phases", {})  # (tests make layers without __init__)
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    def release(self, lanes: Lanes) -> None:
        """The backend stopped using ``lanes`` (it stays cached until evicted)."""
        with self._lock:
            lanes.users -= 1
            assert lanes.users >= 0, f"{lanes!r} released more often than built"
            if lanes.key not in self._cache and lanes.users == 0:
                self._free(lanes)
            elif any(m not in self.models or self._gen.get(m) != g for m, g in lanes.key[1]) and lanes.users == 0:
                self._cache.pop(lanes.key, None)
                self._free(lanes)

    def _make_room(self, need: float, what: str) -> None:
        while self.memory_bytes() + need > self.memory_limit_bytes:
            if not self._evict_one():
                used = self.memory_bytes()
                raise GraphMemoryError(
                    f"{what} needs about {need / 2**20:.0f} MiB of graph memory; {used / 2**20:.0f} MiB are held by "
                    f"layouts in use and the budget is {self.memory_limit_bytes / 2**20:.0f} MiB. Lower max_batch, "
                    f"serve fewer models, or raise memory_limit_bytes."
                )

    def _evict_one(self, keep: tuple | None = None) -> bool:
        for key, ln in self._cache.items():  # oldest first
            if ln.users == 0 and key != keep:
                del self._cache[key]
                self._free(ln)
                self.evictions += 1
                log.info("evicted %r", ln)
                return True
        return False

    def trim(self) -> int:
        """Free every cached build no backend uses (its graph memory, its green contexts); how many.
        For a layer kept open between services while another layer serves meanwhile."""
        with self._lock, self._device_lock:
            before = len(self._cache)
            self._evict_unused(lambda ln: True)
            return before - len(self._cache)

    def _evict_unused(self, pred: Callable[[Lanes], bool]) -> None:
        for key, ln in list(self._cache.items()):
            if pred(ln) and ln.users == 0:
                del self._cache[key]
                self._free(ln)

    # -- running --------------------------------------------------------------------------------
    def launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any:
        """Stage ``rows`` and start them as one batch of ``model`` on lane ``index``. Asynchronous;
        returns a ticket for :meth:`finish`. Raises for a failing model (its batch fails)."""
        fault = self._faults.get(model)
        if fault is not None:
            raise DeviceFault(fault)
        if model not in lanes.models:
            raise RuntimeError(f"model {model!r} has no graphs in {lanes!r} (it was loaded after this layout)")
        return self._launch(lanes, index, model, rows)

    @abstractmethod
    def finish(self, ticket: Any) -> tuple[list[Any], float]:
        """Block until the batch of ``ticket`` is done; its outputs (numpy, ``n`` rows each, in the
        model's flattened output order) and the device time in ms. Raises if the batch failed."""

    def notify(self, ticket: Any, waker: Any) -> bool:
        """Runtime's thread, right after :meth:`launch`: arrange for ``waker.post()`` once the batch
        of ``ticket`` is done, so the runtime's loop books it itself (no watcher thread wakes up).
        False where this device cannot (the batch then goes to its lane's watcher)."""
        return False

    def is_done(self, ticket: Any) -> bool:
        """Runtime's thread: whether :meth:`finish` would return at once. Never blocks."""
        return True

    def done_yet(self, ticket: Any) -> bool:
        """Whether the batch of ``ticket`` has finished on the device; False where the layer cannot
        tell (unlike :meth:`is_done`, which says True there: finish then blocks). Never blocks; any
        thread (the runtime's asks between answers, ``ExecBackend.completion_due``)."""
        return False

    def close(self) -> None:
        """Free every build (call after all batches finished)."""
        with self._lock:
            for ln in list(self._cache.values()):
                self._free(ln)
            self._cache.clear()
        builder = self.__dict__.get("_builder")
        if builder is not None:
            builder.stop()

    # -- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _build(self, lanes: Lanes) -> None:
        """Fill ``lanes.state`` and ``lanes.memory_bytes`` for ``lanes.layout`` and ``lanes.models``."""

    @abstractmethod
    def _launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any: ...

    def _estimate(self, layout: Layout, models: Sequence[str]) -> float:
        return 0.0

    def _free(self, lanes: Lanes) -> None:
        lanes.state = None

    def reclaim(self) -> str:
        """After a build or a load ran out of memory: free what only a full collection frees (an
        unloaded model's cycles, and the weights and graphs they hold). Returns what it did, for
        the log. The pause is one full collection, paid only by a load that would otherwise fail."""
        t0 = time.perf_counter()
        n = gc.collect()
        self.oom_reclaims += 1
        return f"{n} objects in {(time.perf_counter() - t0) * 1000:.0f} ms"


class PinnedRow(list):
    """A request's row (one array per input) that lies in memory the device reads in place
    (:meth:`DeviceLayer.is_pinned`): launched from there, without a staging copy."""

    __slots__ = ()


def numpy_outputs(value: Any, n: int) -> list[Any]:
    """A model's output (a tensor or a nest of them) as one numpy array per output, its first ``n`` rows
    (a batch padded to its bucket gives back only its own); RuntimeError for an output with no batch
    dimension. Used by the CUDA layer's eager fallback (the CPU layer: :func:`cpu_numpy_outputs`)."""
    from ..engine.dag import flat_tensors

    outs = []
    for t in flat_tensors(value):
        if t.dim() == 0 or t.shape[0] < n:
            raise _not_batch_major(t.shape)
        outs.append(t[:n].detach().cpu().numpy())
    return outs


def _not_batch_major(shape: Any) -> RuntimeError:
    return RuntimeError(f"model output of shape {tuple(shape)} has no batch dimension; gpuloom serves "
                        f"batch-major outputs only")


def cpu_numpy_outputs(value: Any, n: int) -> list[Any]:
    """:func:`numpy_outputs` of a model run on the CPU under ``torch.inference_mode`` (nothing to detach
    or move): a batch of exactly ``n`` rows is converted with no slice. Fewer torch calls and attribute
    reads count on the CPU path at a low request rate, where each runs cold after an idle gap: 82
    against 115 us (median) per call after 10 ms idle on the build VM (``scripts/diag_cpu_batch_cold.py``)."""
    from ..engine.dag import flat_tensors

    outs = []
    for t in flat_tensors(value):
        shape = t.shape
        if not shape or shape[0] < n:
            raise _not_batch_major(shape)
        outs.append((t if shape[0] == n else t[:n]).numpy())
    return outs


def make_device_layer(device: str | None = None, *, raw_launch: bool = True, workqueues: str = "shared",
                      lane_streams: str = "compiled", outputs: str = "copies", **options: Any) -> DeviceLayer:
    """``"cuda"``/``"cuda:N"``, ``"cpu"`` or ``None`` (cuda when available, else cpu). ``raw_launch``,
    ``workqueues``, ``lane_streams`` and ``outputs`` apply to CUDA only
    (:class:`~gpuloom.runtime.cuda_device.CudaDeviceLayer`)."""
    if device is None:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    if device == "cpu":
        from .host_device import CpuDeviceLayer

        return CpuDeviceLayer(**options)
    if device.startswith("cuda"):
        from .cuda_device import CudaDeviceLayer

        idx = int(device.split(":", 1)[1]) if ":" in device else 0
        return CudaDeviceLayer(idx, raw_launch=raw_launch, workqueues=workqueues, lane_streams=lane_streams,
                               outputs=outputs, **options)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


__all__ = [
    "Builder", "DeviceFault", "DeviceLayer", "GraphMemoryError", "Lanes", "PinnedRow", "Rows", "ShortCarving", "allowed",
    "cpu_numpy_outputs", "layout_key", "make_device_layer", "numpy_outputs",
]
