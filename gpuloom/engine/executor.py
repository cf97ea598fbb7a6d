"""Run an operator graph with every op on the stream its :class:`StreamPlan` gives it.

One pass over the FX graph in its (topological) order. On the GPU each op is issued on its stream;
before it, its stream waits on the events of the plan's cross-stream parents (the only
synchronizations); the run forks from and joins back to ``streams[0]``, the caller's current
stream, which is what lets the whole run be captured into one CUDA graph. On the CPU the same pass
runs the ops in order, no streams.

Memory across streams: a tensor read on a stream other than the one that allocated it is
``record_stream``-ed on the reader's stream, so the caching allocator (and the graph-capture
allocator) never hands its memory to another op while the reader may still run. Each value is
released as soon as its last reader has been issued.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .dag import OpGraph, flat_tensors, is_device_op
from .streams import StreamPlan

_PLACEHOLDER, _ATTR, _OP, _FREE, _SKIP, _OUTPUT = range(6)


@dataclass
class _Step:
    node: fx.Node
    kind: int
    op: int = -1  # DAG index for _OP
    stream: int = 0  # planned stream for _OP
    waits: tuple[int, ...] = ()  # DAG indices whose events this op's stream waits on
    signals: bool = False  # records an event that another stream waits on
    release: tuple[fx.Node, ...] = ()  # values whose last reader is this node


class StreamExecutor:
    """Executes ``graph`` following ``plan``. Build once, call many times (eagerly or under capture)."""

    def __init__(self, graph: OpGraph, plan: StreamPlan) -> None:
        if plan.num_nodes != len(graph.ops):
            raise ValueError(f"plan has {plan.num_nodes} nodes but the graph has {len(graph.ops)} ops")
        self.graph = graph
        self.plan = plan
        gm = graph.module
        waits_into: dict[int, list[int]] = {}
        for p, c in plan.waits:
            waits_into.setdefault(c, []).append(p)
        signalling = {p for p, _ in plan.waits}
        last_use: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            for a in node.all_input_nodes:
                last_use[a] = node
        releases: dict[fx.Node, list[fx.Node]] = {}
        for value, user in last_use.items():
            if value.op not in ("placeholder", "get_attr"):
                releases.setdefault(user, []).append(value)
        self._attrs: dict[fx.Node, Any] = {}
        self._steps: list[_Step] = []
        placeholders = 0
        for node in gm.graph.nodes:
            rel = tuple(releases.get(node, ()))
            if node.op == "placeholder":
                self._steps.append(_Step(node, _PLACEHOLDER, op=placeholders))
                placeholders += 1
            elif node.op == "get_attr":
                self._attrs[node] = operator.attrgetter(node.target)(gm)
                self._steps.append(_Step(node, _ATTR))
            elif node.op == "output":
                self._steps.append(_Step(node, _OUTPUT))
            elif node.op == "call_module" and node.target == "_guards_fn":
                self._steps.append(_Step(node, _SKIP))
            elif is_device_op(node, gm):
                i = graph.op_index[node]
                self._steps.append(
                    _Step(node, _OP, op=i, stream=plan.stream_of[i], waits=tuple(waits_into.get(i, ())),
                          signals=i in signalling, release=rel)
                )
            else:
                self._steps.append(_Step(node, _FREE, release=rel))
        self.num_inputs = placeholders
        self.last_node: fx.Node | None = None
        # export's graphs return a flat tuple that their forward() unflattens with a pytree spec
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self._out_spec = info.out_spec if info is not None and info.out_spec is not None else None

    def _result(self, flat: Any) -> Any:
        if self._out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self._out_spec)

    def refresh_attrs(self) -> None:
        """Re-read parameters after the module moved (``module.to(device)`` replaces tensors)."""
        gm = self.graph.module
        for node in list(self._attrs):
            self._attrs[node] = operator.attrgetter(node.target)(gm)

    # ------------------------------------------------------------------------------------------
    def run(
        self, inputs: Sequence[torch.Tensor], streams: Sequence[torch.cuda.Stream] | None = None, *, annotate: bool = False
    ) -> Any:
        """Run once. ``streams`` (GPU): ``plan.num_streams`` streams, ``streams[0]`` the current one.

        Asynchronous on the GPU: returns when every op has been issued; the result is ready on
        ``streams[0]``. Inputs and outputs must stay alive until then (they do under capture).
        ``annotate`` wraps op ``i`` in a profiler range ``gpuloom_op_<i>`` (for per-op kernel times).
        """
        if streams is None:
            return self._run_in_order(inputs)
        if len(streams) < self.plan.num_streams:
            raise ValueError(f"plan needs {self.plan.num_streams} streams, got {len(streams)}")
        return self._run_on_streams(inputs, streams, annotate)

    def _call(self, node: fx.Node, env: dict) -> Any:
        self.last_node = node  # for error messages (e.g. an op that cannot be captured)
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_module":
            return self.graph.module.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        raise AssertionError(f"unexpected node {node.op} {node.target}")

    def _run_in_order(self, inputs: Sequence[torch.Tensor]) -> Any:
        env: dict[fx.Node, Any] = {}
        for step in self._steps:
            node = step.node
            if step.kind == _PLACEHOLDER:
                env[node] = inputs[step.op]
            elif step.kind == _ATTR:
                env[node] = self._attrs[node]
            elif step.kind in (_OP, _FREE):
                env[node] = self._call(node, env)
                for v in step.release:
                    env.pop(v, None)
            elif step.kind == _OUTPUT:
                return self._result(fx.node.map_arg(node.args[0], env.__getitem__))
        raise AssertionError("graph has no output node")

    def _run_on_streams(
        self, inputs: Sequence[torch.Tensor], streams: Sequence[torch.cuda.Stream], annotate: bool = False
    ) -> Any:
        main = streams[0]
        used = streams[: self.plan.num_streams]
        if len(used) > 1:
            fork = torch.cuda.Event()
            fork.record(main)
            for s in used[1:]:
                s.wait_event(fork)
        env: dict[fx.Node, Any] = {}
        alloc: dict[fx.Node, int] = {}  # value -> stream that allocated its storage (-1: caller-owned)
        events: dict[int, torch.cuda.Event] = {}
        for step in self._steps:
            node = step.node
            kind = step.kind
            if kind == _PLACEHOLDER:
                env[node] = inputs[step.op]
                alloc[node] = -1
            elif kind == _ATTR:
                env[node] = self._attrs[node]
                alloc[node] = -1
            elif kind == _OP:
                s = used[step.stream]
                for p in step.waits:
                    s.wait_event(events[p])
                with torch.cuda.stream(s):
                    if annotate:
                        with torch.profiler.record_function(f"gpuloom_op_{step.op}"):
                            env[node] = self._call(node, env)
                    else:
                        env[node] = self._call(node, env)
                for a in node.all_input_nodes:
                    owner = alloc.get(a, -1)
                    if owner >= 0 and owner != step.stream:
                        for t in flat_tensors(env[a]):
                            if t.is_cuda:
                                t.record_stream(s)
                alloc[node] = step.stream
                if step.signals:
                    ev = torch.cuda.Event()
                    ev.record(s)
                    events[step.op] = ev
                for v in step.release:
                    env.pop(v, None)
            elif kind == _FREE:
                env[node] = self._call(node, env)
                alloc[node] = next((alloc.get(a, -1) for a in node.all_input_nodes if alloc.get(a, -1) >= 0), -1)
                for v in step.release:
                    env.pop(v, None)
            elif kind == _OUTPUT:
                out = fx.node.map_arg(node.args[0], env.__getitem__)
                for a in node.all_input_nodes:
                    if alloc.get(a, -1) > 0:  # allocated on a side stream, handed to the caller on main
                        for t in flat_tensors(env[a]):
                            if t.is_cuda:
                                t.record_stream(main)
                for s in used[1:]:
                    join = torch.cuda.Event()
                    join.record(s)
                    main.wait_event(join)
                return self._result(out)
        raise AssertionError("graph has no output node")


class ForwardExecutor:
    """Runs the user's own ``forward`` (not the DAG) on the current stream: the third candidate that
    ``streams="auto"`` times per bucket, a plain CUDA graph of the eager forward.

    Why: a few models' eager kernels beat their ATen-level decomposition. On the H200 the CUDA graph
    of bert_base's eager forward (``nn.TransformerEncoder``'s fused fast path) ran 2.8% faster than
    gpuloom's single-stream graph of its DAG (``docs/reports/engine.md``, tenth session), so "auto"
    lost to a plain ``torch.cuda.graph`` there. Timing the forward too makes "auto" at least as fast
    as both. Same interface as :class:`StreamExecutor` for capture: ``plan`` (one stream) and
    ``run(inputs, streams)``.
    """

    def __init__(self, module: torch.nn.Module, plan: StreamPlan) -> None:
        if plan.num_streams != 1:
            raise ValueError(f"the forward runs on one stream; got a plan with {plan.num_streams}")
        self.module = module
        self.plan = plan
        self.last_node = None  # capture errors name no DAG node: the forward is one opaque call

    def run(self, inputs: Sequence[torch.Tensor], streams: Sequence[torch.cuda.Stream] | None = None,
            **_: Any) -> Any:
        """Call the module on ``inputs`` on the current stream (``streams[0]`` under capture)."""
        return self.module(*inputs)

    def refresh_attrs(self) -> None:
        """Nothing to re-read: the module holds its own parameters."""
