"""A batch's launch in raw CUDA driver calls: the runtime's hot path without torch's per-call cost.

Why: on the H200 a launch through torch (row copies, ``graph.replay()``, output copy, events) cost the
runtime's thread 0.25-0.4 ms of host time per batch, measured by phase (inputs 0.16-0.39 ms, replay
0.06-0.1, outputs 0.07-0.24; ``docs/reports/runtime.md``). That is 10-50% of a small batch's device
time, paid on the one thread that launches every batch, and each torch call releases the GIL, which
invites the convoy measured there (a busy thread can hold the GIL for the switch interval). Here
each step is one ``ctypes`` call into ``libcuda`` (about 1 us) that keeps the GIL: an async copy,
a graph launch or an event record does not wait, so releasing the GIL around it buys nothing.

:class:`Driver` wraps the few entry points; :class:`LaunchPlan` holds, per (lane, model, bucket),
the handles and byte sizes a launch needs, all read once when the plan is made. Nothing here
imports torch: the device layer passes plain integers (pointers, handles). Any failing call raises
:class:`~gpuloom.gpu.errors.DriverError` naming the call.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import DriverError

_VP, _U64, _SIZE, _INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
_NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery's "not yet"
_HOST, _DEVICE = 1, 2  # CUmemorytype


class _Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D`` (cuda.h): a memcpy node's parameters; a 1-D copy uses the widths only."""

    _fields_ = [
        ("srcXInBytes", _SIZE), ("srcY", _SIZE), ("srcZ", _SIZE), ("srcLOD", _SIZE),
        ("srcMemoryType", _INT), ("srcHost", _VP), ("srcDevice", _U64), ("srcArray", _VP), ("reserved0", _VP),
        ("srcPitch", _SIZE), ("srcHeight", _SIZE),
        ("dstXInBytes", _SIZE), ("dstY", _SIZE), ("dstZ", _SIZE), ("dstLOD", _SIZE),
        ("dstMemoryType", _INT), ("dstHost", _VP), ("dstDevice", _U64), ("dstArray", _VP), ("reserved1", _VP),
        ("dstPitch", _SIZE), ("dstHeight", _SIZE),
        ("WidthInBytes", _SIZE), ("Height", _SIZE), ("Depth", _SIZE),
    ]


class Driver:
    """The driver calls of a launch, bound once from ``libcuda.so.1`` (``OSError`` if it is absent).

    Calls that only enqueue work hold the GIL (``ctypes.PyDLL``). Driver calls need a current
    context on the calling thread: :meth:`ensure_context` makes the device's primary context (the
    one torch uses) current on a thread that has none, once per thread.
    """

    def __init__(self, device: int = 0, library: str = "libcuda.so.1") -> None:
        lib = ctypes.PyDLL(library)
        slow = ctypes.CDLL(library)  # for calls that take a while (page-locking memory): the GIL is released

        def bind(name: str, *argtypes: Any, within: Any = lib) -> Any:
            f = getattr(within, name)
            f.argtypes, f.restype = list(argtypes), _INT
            return f

        self._htod = bind("cuMemcpyHtoDAsync_v2", _U64, _VP, _SIZE, _VP)
        self._dtoh = bind("cuMemcpyDtoHAsync_v2", _VP, _U64, _SIZE, _VP)
        self._graph_launch = bind("cuGraphLaunch", _VP, _VP)
        self._record = bind("cuEventRecord", _VP, _VP)
        self._query = bind("cuEventQuery", _VP)
        self._elapsed = bind("cuEventElapsedTime", ctypes.POINTER(ctypes.c_float), _VP, _VP)
        self._host_func = bind("cuLaunchHostFunc", _VP, _VP, _VP)
        self._host_register = bind("cuMemHostRegister_v2", _VP, _SIZE, ctypes.c_uint, within=slow)
        self._host_unregister = bind("cuMemHostUnregister", _VP, within=slow)
        self._ctx_get = bind("cuCtxGetCurrent", ctypes.POINTER(_VP))
        self._ctx_set = bind("cuCtxSetCurrent", _VP)
        self._device_get = bind("cuDeviceGet", ctypes.POINTER(_INT), _INT)
        self._retain = bind("cuDevicePrimaryCtxRetain", ctypes.POINTER(_VP), _INT)
        self._release = bind("cuDevicePrimaryCtxRelease_v2", _INT)
        self._error_name = bind("cuGetErrorName", _INT, ctypes.POINTER(ctypes.c_char_p))
        try:  # building a launch graph (wrap_graph): a driver from before CUDA 11.4 lacks some of these
            node_p = ctypes.POINTER(_VP)
            self._graph_create = bind("cuGraphCreate", node_p, ctypes.c_uint, within=slow)
            self._add_record = bind("cuGraphAddEventRecordNode", node_p, _VP, node_p, _SIZE, _VP, within=slow)
            self._add_child = bind("cuGraphAddChildGraphNode", node_p, _VP, node_p, _SIZE, _VP, within=slow)
            self._add_memcpy = bind("cuGraphAddMemcpyNode", node_p, _VP, node_p, _SIZE, ctypes.POINTER(_Memcpy3D),
                                    _VP, within=slow)
            self._instantiate = bind("cuGraphInstantiateWithFlags", node_p, _VP, ctypes.c_ulonglong, within=slow)
            self._upload = bind("cuGraphUpload", _VP, _VP, within=slow)
            self._exec_destroy = bind("cuGraphExecDestroy", _VP, within=slow)
            self._graph_destroy = bind("cuGraphDestroy", _VP, within=slow)
            size_p = ctypes.POINTER(_SIZE)
            self._clone = bind("cuGraphClone", node_p, _VP, within=slow)
            self._graph_nodes = bind("cuGraphGetNodes", _VP, node_p, size_p, within=slow)
            self._root_nodes = bind("cuGraphGetRootNodes", _VP, node_p, size_p, within=slow)
            self._dependents = bind("cuGraphNodeGetDependentNodes", _VP, node_p, size_p, within=slow)
            self._add_edges = bind("cuGraphAddDependencies", _VP, node_p, node_p, _SIZE, within=slow)
            self.can_wrap = True
        except AttributeError:
            self.can_wrap = False
        dev, ctx = _INT(), _VP()
        self.check(self._device_get(ctypes.byref(dev), int(device)), "cuDeviceGet", device)
        self.check(self._retain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain", device)
        self.device, self.context = dev.value, ctx.value
        self._local = threading.local()

    def check(self, err: int, call: str, *args: Any) -> None:
        if err:
            name = ctypes.c_char_p()
            self._error_name(err, ctypes.byref(name))
            shown = ", ".join(hex(a) if isinstance(a, int) and a > 4096 else repr(a) for a in args)
            raise DriverError(f"{call}({shown}) failed with {(name.value or b'error %d' % err).decode()}")

    def ensure_context(self) -> None:
        """Make the primary context current on this thread unless a context already is."""
        if getattr(self._local, "ready", False):
            return
        cur = _VP()
        self.check(self._ctx_get(ctypes.byref(cur)), "cuCtxGetCurrent")
        if not cur.value:
            self.check(self._ctx_set(self.context), "cuCtxSetCurrent", self.context)
        self._local.ready = True

    def copy_in(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._htod(dst, src, nbytes, stream)
        if err:
            self.check(err, "cuMemcpyHtoDAsync", dst, src, nbytes, stream)

    def copy_out(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._dtoh(dst, src, nbytes, stream)
        if err:
            self.check(err, "cuMemcpyDtoHAsync", dst, src, nbytes, stream)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        err = self._graph_launch(graph_exec, stream)
        if err:
            self.check(err, "cuGraphLaunch", graph_exec, stream)

    def record(self, event: int, stream: int) -> None:
        err = self._record(event, stream)
        if err:
            self.check(err, "cuEventRecord", event, stream)

    def done(self, event: int) -> bool:
        """Whether the work before ``event``'s record has finished (``cuEventQuery``; never blocks)."""
        err = self._query(event)
        if err == _NOT_READY:
            return False
        if err:
            self.check(err, "cuEventQuery", event)
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        """Device time between two finished events, ms (``cuEventElapsedTime``, keeps the GIL)."""
        ms = ctypes.c_float()
        err = self._elapsed(ctypes.byref(ms), start, end)
        if err:
            self.check(err, "cuEventElapsedTime", start, end)
        return float(ms.value)

    def host_func(self, stream: int, fn: int, data: int) -> None:
        """Enqueue the C function ``fn(data)`` on ``stream``: the driver calls it once the work
        enqueued before it is done. ``fn`` must not call CUDA and must return at once (it holds the
        stream): gpuloom passes ``sem_post`` on the runtime loop's semaphore (runtime/waker.py)."""
        err = self._host_func(stream, fn, data)
        if err:
            self.check(err, "cuLaunchHostFunc", stream, fn, data)

    def wrap_graph(self, child: int, t0: int | None, t1: int | None, copies_out: Sequence[tuple[int, int, int]],
                   done: int | None, stream: int, *, flat: bool = False) -> tuple[int, int]:
        """A launch graph around the captured graph ``child`` (a ``CUgraph``): record ``t0``, run
        ``child`` (cloned), record ``t1``, copy each ``(host dst, device src, bytes)`` out, record
        ``done`` (an event that is None: no node). ``flat``: the new nodes go into a clone of ``child``
        (``t0`` before its roots, the rest after its leaves) instead of around a child graph node.
        Instantiated and uploaded on ``stream``; returns ``(graph, graph exec)`` for
        :meth:`destroy_graph`. Why: a batch's launch is then its input copies and one
        ``cuGraphLaunch``, where it was those plus four event records and the output copies, each a
        driver call of 1.5-3 us that costs about twice that when the thread has just woken (issue 5,
        ``docs/reports/runtime.md``). The events and the output buffers are fixed per graph: one
        graph per (bucket, slot)."""
        self.ensure_context()
        graph, exe = _VP(), _VP()
        if flat:
            self.check(self._clone(ctypes.byref(graph), child), "cuGraphClone")
        else:
            self.check(self._graph_create(ctypes.byref(graph), 0), "cuGraphCreate")
        try:
            if flat:
                roots = self._node_list(self._root_nodes, graph, "cuGraphGetRootNodes")
                leaves = [n for n in self._node_list(self._graph_nodes, graph, "cuGraphGetNodes")
                          if not self._node_count(self._dependents, n, "cuGraphNodeGetDependentNodes")]
                last = leaves
                if t0 is not None:
                    first = self._add_node(self._add_record, graph, [], t0, call="cuGraphAddEventRecordNode")
                    if roots:
                        src, dst = (_VP * len(roots))(*[first] * len(roots)), (_VP * len(roots))(*roots)
                        self.check(self._add_edges(graph, src, dst, len(roots)), "cuGraphAddDependencies")
                    else:  # an empty captured graph: t1 and the rest still follow t0
                        last = [first]
            else:
                first = [] if t0 is None else [self._add_node(self._add_record, graph, [], t0,
                                                              call="cuGraphAddEventRecordNode")]
                last = [self._add_node(self._add_child, graph, first, child, call="cuGraphAddChildGraphNode")]
            if t1 is not None:
                last = [self._add_node(self._add_record, graph, last, t1, call="cuGraphAddEventRecordNode")]
            copies = []
            for dst, src, nbytes in copies_out:
                p = _Memcpy3D(srcMemoryType=_DEVICE, srcDevice=src, srcPitch=nbytes, srcHeight=1,
                              dstMemoryType=_HOST, dstHost=dst, dstPitch=nbytes, dstHeight=1,
                              WidthInBytes=nbytes, Height=1, Depth=1)
                copies.append(self._add_node(self._add_memcpy, graph, last, ctypes.byref(p), self.context,
                                             call="cuGraphAddMemcpyNode"))
            if done is not None:
                self._add_node(self._add_record, graph, copies or last, done, call="cuGraphAddEventRecordNode")
            self.check(self._instantiate(ctypes.byref(exe), graph, 0), "cuGraphInstantiateWithFlags")
            self.check(self._upload(exe, stream), "cuGraphUpload", stream)
        except BaseException:
            self.destroy_graph(graph.value, exe.value)
            raise
        return graph.value, exe.value

    def _add_node(self, add: Any, graph: _VP, deps: list[_VP], *args: Any, call: str) -> _VP:
        node = _VP()
        arr = (_VP * max(1, len(deps)))(*deps)
        self.check(add(ctypes.byref(node), graph, arr, len(deps), *args), call)
        return node

    def _node_count(self, get: Any, of: Any, call: str) -> int:
        """How many nodes a ``cuGraphGet*Nodes`` style call has for ``of`` (asking for the nodes
        themselves fails with CUDA_ERROR_LOSSY_QUERY where torch's captured edges carry data)."""
        n = _SIZE(0)
        self.check(get(of, None, ctypes.byref(n)), call)
        return n.value

    def _node_list(self, get: Any, of: Any, call: str) -> list[int]:
        """The nodes a ``cuGraphGet*Nodes`` style call gives for ``of``."""
        n = _SIZE(self._node_count(get, of, call))
        if not n.value:
            return []
        arr = (_VP * n.value)()
        self.check(get(of, arr, ctypes.byref(n)), call)
        return list(arr[: n.value])

    def destroy_graph(self, graph: int | None, graph_exec: int | None) -> None:
        """Destroy what :meth:`wrap_graph` made (its stream must be idle). Errors are ignored: this
        runs on teardown and on a failed build, where there is nothing better to do."""
        self.ensure_context()
        if graph_exec:
            self._exec_destroy(graph_exec)
        if graph:
            self._graph_destroy(graph)

    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of existing host memory at ``address`` (``cuMemHostRegister``), so async
        copies read it in place."""
        self.ensure_context()
        err = self._host_register(address, nbytes, 0)
        if err:
            self.check(err, "cuMemHostRegister", address, nbytes)

    def host_unregister(self, address: int) -> None:
        self.ensure_context()
        err = self._host_unregister(address)
        if err:
            self.check(err, "cuMemHostUnregister", address)

    def close(self) -> None:
        """Release the primary context this object retained (torch keeps its own reference)."""
        if self.context:
            self.context = None
            self._release(self.device)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one (lane, model, bucket) launch needs, as integers read once.

    ``inputs``: per model input, the static device buffer and the bytes of one row; ``outputs``: per
    output, the static device buffer and the bytes of one row; ``graph_exec`` and ``stream`` are the
    driver handles of the bucket's graph and of the lane stream it is launched on.
    """

    stream: int
    graph_exec: int
    inputs: tuple[tuple[int, int], ...]  # (device ptr, row bytes)
    outputs: tuple[tuple[int, int], ...]  # (device ptr, row bytes)

    def copy_inputs(self, drv: Driver, n: int, t_in: int | None,
                    rows_in: Sequence[Sequence[tuple[int, int]]] | None = None,
                    batch_in: Sequence[int] | None = None) -> None:
        """Enqueue the event ``t_in`` (None: none), then the batch's ``n`` rows into the static inputs: ``rows_in``
        gives per row, per input, a pinned host row as ``(address, bytes)`` (one copy each; a size
        that is not the input's row size raises ``ValueError`` before anything is enqueued);
        ``batch_in`` gives per input one pinned host address of ``n`` contiguous rows (one copy per
        input)."""
        st = self.stream
        rows_in = rows_in or ()
        if batch_in is None:
            for ptrs in rows_in:
                if len(ptrs) != len(self.inputs) or any(nb != row for (_, nb), (_, row) in zip(ptrs, self.inputs)):
                    raise ValueError(f"a row of {[nb for _, nb in ptrs]} bytes per input does not fit this graph's "
                                     f"inputs of {[row for _, row in self.inputs]} bytes per row")
        if t_in is not None:
            drv.record(t_in, st)
        if batch_in is not None:
            for (dst, row), src in zip(self.inputs, batch_in):
                drv.copy_in(dst, src, n * row, st)
            return
        for i, ptrs in enumerate(rows_in):
            for (dst, row), (src, _) in zip(self.inputs, ptrs):
                drv.copy_in(dst + i * row, src, row, st)

    def replay(self, drv: Driver, t0: int, t1: int) -> None:
        """Enqueue the graph between two timing events."""
        drv.record(t0, self.stream)
        drv.launch_graph(self.graph_exec, self.stream)
        drv.record(t1, self.stream)

    def copy_outputs(self, drv: Driver, n: int, out_hosts: Sequence[int], done: int) -> None:
        """Enqueue each output's first ``n`` rows into its pinned host buffer, then the ``done`` event."""
        for (src, row), dst in zip(self.outputs, out_hosts):
            drv.copy_out(dst, src, n * row, self.stream)
        drv.record(done, self.stream)


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row of a contiguous ``(batch, *row)`` buffer."""
    n = itemsize
    for d in shape[1:]:
        n *= int(d)
    return n


__all__ = ["Driver", "LaunchPlan", "row_bytes"]
