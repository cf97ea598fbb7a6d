"""Model -> operator DAG.

A model is captured as an FX graph, preferably with ``torch.export`` (an ATen-level graph,
functionalized so that no operator mutates another's input, with a dynamic batch dimension), falling
back to ``torch.fx.symbolic_trace`` (a module-level graph) where export fails. If neither can capture
it, :class:`CaptureError` says which operation stopped each of them.

The DAG's nodes are the graph nodes that do device work ("ops"). Everything else is *free*: views and
other metadata-only operators, ``getitem`` on multi-output ops, symbolic-size arithmetic, parameter
reads. Free nodes are folded into their producers: a DAG edge ``a -> b`` exists when ``b`` reads,
through any chain of free nodes, a value produced by op ``a``.
"""

from __future__ import annotations

import copy
import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from . import fold, graph_cache


class CaptureError(RuntimeError):
    """The model could not be turned into an operator graph."""


# ATen ops that only change metadata (no kernel). Anything not listed is treated as device work,
# which is always safe (it only costs a possible extra synchronization).
_VIEW_OPS = {
    "view", "_unsafe_view", "t", "permute", "transpose", "expand", "squeeze", "unsqueeze", "slice",
    "select", "alias", "detach", "as_strided", "unflatten", "split", "split_with_sizes", "chunk",
    "unbind", "narrow", "view_as", "expand_as", "diagonal", "movedim", "numpy_T", "lift_fresh",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "sym_constrain_range_for_size", "sym_constrain_range",
}
# Tensor methods / functions of a symbolically traced (fx) graph that only change metadata.
_FX_VIEW_NAMES = {
    "view", "reshape_as_view", "t", "permute", "transpose", "expand", "squeeze", "unsqueeze", "size",
    "dim", "chunk", "split", "unbind", "narrow", "view_as", "expand_as", "flatten_view", "detach",
    "getattr", "getitem", "shape",
}


@dataclass
class OpGraph:
    """An FX graph module plus the operator DAG over its device ops.

    ``ops[i]`` is the FX node of DAG node ``i``; ``edges`` are (producer, consumer) pairs of op indices.
    """

    module: fx.GraphModule
    method: str  # "export" or "fx"
    ops: list[fx.Node]
    edges: list[tuple[int, int]]
    op_index: dict[fx.Node, int] = field(default_factory=dict)
    folded_batchnorms: int = 0  # BatchNorms folded into convolutions
    channels_last_weights: int = 0  # convolution weights stored NHWC (fold.channels_last)
    fused_convolutions: int = 0  # convolutions fused with their bias and ReLU (fold.fuse_convolutions)
    split_linears: int = 0  # float32 linear layers whose GEMM may split K (fold.split_linears, gemm)
    fused_epilogues: int = 0  # convolutions whose bias (+ add) + activation run in one kernel (epilogue)
    fused_gates: int = 0  # squeeze-excitation gates run as two kernels each (fold.fuse_gates, excitation)
    graph_from_cache: bool = False  # export's functional graph came from graph_cache (half the export skipped)
    fx_because: str = ""  # method "fx": what stopped the export path (export itself, or which rewrite pass)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.ops)

    def __repr__(self) -> str:
        return f"OpGraph(method={self.method!r}, ops={len(self.ops)}, edges={len(self.edges)})"


def capture_graph(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    max_batch: int,
    fold_batchnorm: bool = True,
    reinplace: bool = False,
    channels_last: bool = False,
    fuse_convolutions: bool = False,
    split_gemms: bool = False,
    fuse_epilogues: bool = False,
    fuse_gates: bool = False,
) -> OpGraph:
    """Capture ``model`` as an FX graph and build its operator DAG (see the module docstring).

    ``fold_batchnorm`` folds inference BatchNorms into the convolutions they follow; ``reinplace``
    runs single-reader elementwise ops in place; ``channels_last`` stores convolution weights NHWC;
    ``fuse_convolutions`` uses cuDNN's fused convolution + bias (+ add) + ReLU, for CUDA only (all
    four export path only; see ``fold``); ``split_gemms`` runs float32 linear layers through
    :func:`gemm.linear` (K split where timed faster; CUDA only, export path only); ``fuse_epilogues``
    runs a convolution's bias, residual add and SiLU / sigmoid / ReLU6 as one :func:`epilogue.bias_act`
    (export path only; after ``fuse_convolutions``, which takes the ReLUs); ``fuse_gates`` runs each
    squeeze-excitation gate as :func:`excitation.hidden` and :func:`excitation.excite` (export path
    only; before the convolution passes, which would take its convolutions).
    """
    export_error: BaseException | None = None
    fx_because = ""
    stage = "torch.export"
    try:
        gm = _export(model, example_inputs, max_batch)
        method = "export"
        stage = "fold_batchnorm"
        folded = fold.fold_batchnorm(gm) if fold_batchnorm else 0
        fold.restore_batchnorm(gm)
        stage = "fuse_gates"
        gates = fold.fuse_gates(gm) if fuse_gates else 0
        # before reinplace, whose in-place ReLUs and adds it would no longer recognise
        stage = "fuse_convolutions"
        fused = fold.fuse_convolutions(gm) if fuse_convolutions else 0
        stage = "fuse_epilogues"
        epilogues = fold.fuse_epilogues(gm) if fuse_epilogues else 0
        stage = "split_gemms"
        split = fold.split_linears(gm) if split_gemms else 0
        stage = "reinplace"
        if reinplace:
            fold.reinplace_elementwise(gm)
    except Exception as e:  # export fails in many ways; we report it below if fx fails too
        export_error = e
        try:
            gm = fx.symbolic_trace(model)
            method = "fx"
            folded = fused = split = epilogues = gates = 0
            fx_because = f"{stage}: {_first_line(e)}"
            # say so: every rewrite asked for is off now, and the model runs slower for it
            asked = [n for n, on in (("fold_batchnorm", fold_batchnorm), ("fuse_gates", fuse_gates),
                                     ("fuse_convolutions", fuse_convolutions), ("fuse_epilogues", fuse_epilogues),
                                     ("split_gemms", split_gemms), ("channels_last", channels_last)) if on]
            if stage == "torch.export":
                because = f"torch.export stopped at: {_first_line(e)}"
            else:  # gpuloom's own pass: a bug to report, not the model's
                because = f"gpuloom's {stage} pass failed on the exported graph ({_first_line(e)}; please report it)"
            warnings.warn(f"{type(model).__name__}: {because}; captured with torch.fx instead, where none of "
                          f"gpuloom's graph rewrites apply" + (f" (asked for: {', '.join(asked)})" if asked else ""),
                          stacklevel=3)
        except Exception as fx_error:
            raise CaptureError(
                f"gpuloom could not capture {type(model).__name__} as an operator graph.\n"
                f"  torch.export stopped at: {_first_line(export_error)}\n"
                f"  torch.fx stopped at: {_first_line(fx_error)}\n"
                + _advice(export_error)
            ) from fx_error
    # asked for: a failure here is the caller's error, not a fallback to fx
    nhwc = fold.channels_last(gm) if channels_last and method == "export" else 0
    graph = _build_dag(gm, method)
    graph.folded_batchnorms = folded
    graph.fused_convolutions = fused
    graph.split_linears = split
    graph.fused_epilogues = epilogues
    graph.fused_gates = gates
    graph.channels_last_weights = nhwc  # 0 where the fx fallback took the model (no pass applies)
    graph.graph_from_cache = gm.meta.get(_FROM_CACHE, False)
    graph.fx_because = fx_because
    return graph


def channels_last_variant(graph: OpGraph, *, fuse_convolutions: bool = False) -> OpGraph | None:
    """A second DAG of ``graph``'s model with its convolution weights channels-last (``fold``), for
    ``compile(channels_last="auto")`` to time beside the first: a copy of the graph on a module of its
    own that shares every tensor except the convolution weights it stores NHWC, so the first graph is
    unchanged and only those weights take memory twice. ``fuse_convolutions``: fuse the copy's
    convolutions (``fold.fuse_convolutions``; CUDA only) where ``graph``'s are not. None where no pass
    applies (an fx-captured model, or one without 4-D convolution weights)."""
    if graph.method != "export":
        return None
    gm = fx.GraphModule(graph.module, copy.deepcopy(graph.module.graph))  # shares the tensors it reads
    fused = fold.fuse_convolutions(gm) if fuse_convolutions and not graph.fused_convolutions else 0
    converted = fold.channels_last(gm)
    if not converted:
        return None
    variant = _build_dag(gm, "export")
    variant.folded_batchnorms = graph.folded_batchnorms
    variant.fused_convolutions = graph.fused_convolutions or fused
    variant.split_linears = graph.split_linears  # (the copy keeps the graph's targets)
    variant.fused_epilogues = graph.fused_epilogues
    variant.fused_gates = graph.fused_gates
    variant.channels_last_weights = converted
    return variant


_FROM_CACHE = "gpuloom_graph_from_cache"  # GraphModule.meta key: _export took its graph from graph_cache


def _export(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], max_batch: int) -> fx.GraphModule:
    # Export at batch 2 with a dynamic batch dimension: at batch 1 export specializes the size.
    inputs = tuple(with_batch(x, 2) for x in example_inputs)
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    dynamic = tuple({0: batch} for _ in inputs)
    with torch.no_grad():
        ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
        ep, from_cache = graph_cache.decompose(ep)  # functionalize (no op mutates its inputs), cached by graph
    gm = ep.module()
    gm.meta[_FROM_CACHE] = from_cache
    return gm


def with_batch(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows made by repeating ``x``'s rows (valid token ids stay valid), contiguous."""
    reps = (n + x.shape[0] - 1) // x.shape[0]
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:n].contiguous()


_UNKNOWN_TYPE = re.compile(r"Found <class '([^']+)'> in (output|input)")


def _advice(export_error: BaseException | None) -> str:
    """What to change, for the capture error: specific where export named a type it cannot carry in
    the model's inputs or outputs (a Hugging Face model's key/value cache, seen with GPT-2), else the
    usual causes."""
    found = _UNKNOWN_TYPE.search(str(export_error)) if export_error is not None else None
    if found is None:
        return ("Models with data-dependent control flow or host synchronizations (.item(), .tolist(), "
                "Python branches on tensor values) cannot be compiled ahead of time; move that logic "
                "out of forward() or make it static.")
    qualname, where = found.groups()
    name = qualname.rsplit(".", 1)[-1]
    text = (f"The model's {where} holds a {name} ({qualname}), which is neither a tensor nor a container "
            f"torch.export knows (tuples, lists, dicts, registered dataclasses): "
            + ("return only tensors from forward()" if where == "output" else "pass only tensors")
            + ", or register the type with torch.utils._pytree.register_pytree_node.")
    if "cache" in name.lower():
        text += (" A Hugging Face model returns its key/value cache unless told not to: set "
                 "model.config.use_cache = False before compiling.")
    return text


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def is_device_op(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Does this node launch device work (and so become a DAG node)?"""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        if node.target == "_guards_fn":  # export's input guards: host-side checks only
            return False
        return True
    if node.op == "call_method":
        return node.target not in _FX_VIEW_NAMES
    target = node.target
    if target is operator.getitem or getattr(target, "__module__", None) in ("_operator", "operator"):
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target._opname not in _VIEW_OPS
    if target is getattr:
        return False
    name = getattr(target, "__name__", "")
    if name in _FX_VIEW_NAMES or name in ("size", "sym_size"):
        return False
    return True


def _mutates_input(node: fx.Node, gm: fx.GraphModule) -> bool:
    """In-place ops of an fx (non-functionalized) graph: ``relu(inplace=True)``, ``x.add_(y)``..."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        return bool(node.kwargs.get("inplace", False)) or getattr(node.target, "__name__", "").endswith("_")
    return False


def _build_dag(gm: fx.GraphModule, method: str) -> OpGraph:
    ops: list[fx.Node] = []
    op_index: dict[fx.Node, int] = {}
    producers: dict[fx.Node, frozenset[int]] = {}  # node -> ops whose output it carries (through free nodes)
    edges: set[tuple[int, int]] = set()
    last_writer: dict[fx.Node, int] = {}  # fx fallback: in-place writes to a value, by its root node
    readers: dict[fx.Node, list[int]] = {}

    for node in gm.graph.nodes:
        deps: set[int] = set()
        for arg in node.all_input_nodes:
            deps |= producers.get(arg, frozenset())
        if is_device_op(node, gm):
            i = len(ops)
            ops.append(node)
            op_index[node] = i
            edges.update((d, i) for d in deps)
            if method == "fx":
                _order_inplace(node, gm, i, edges, last_writer, readers)
            producers[node] = frozenset({i})
        else:
            producers[node] = frozenset(deps)
    return OpGraph(module=gm, method=method, ops=ops, edges=sorted(edges), op_index=op_index)


def _order_inplace(node, gm, i, edges, last_writer, readers) -> None:
    """Keep fx graph order around in-place ops: a write follows every earlier read and write of the
    value it mutates, and every later read follows the write."""
    roots = [a for a in node.all_input_nodes]
    for r in roots:
        if r in last_writer and last_writer[r] != i:
            edges.add((last_writer[r], i))
        readers.setdefault(r, []).append(i)
    if _mutates_input(node, gm) and roots:
        target = roots[0]
        edges.update((j, i) for j in readers.get(target, []) if j != i)
        last_writer[target] = i
        # the output of an in-place op aliases its input: later readers of either see the write
        last_writer[node] = i


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in flat_tensors(v)]
    return []
