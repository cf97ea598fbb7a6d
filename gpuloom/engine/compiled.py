"""``gpuloom.compile``: a model made ahead of time into multi-stream CUDA graphs (after Nimble).

    cm = gpuloom.compile(model, example_inputs, max_batch=32, streams="auto")
    y = cm(x)          # pads x to its batch bucket, replays that bucket's graph, slices the result

On a machine without CUDA (or ``device="cpu"``) the same object runs the operator DAG in stream-plan
order on the CPU, without graphs.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import torch

from . import epilogue
from .capture import GraphSet, InputSpec, StreamFactory, capture_graphs
from .dag import CaptureError, OpGraph, capture_graph, channels_last_variant
from .executor import ForwardExecutor, StreamExecutor
from .options import is_channels_last, is_fuse_convolutions
from .streams import StreamPlan, assign_streams, single_stream_plan

__all__ = ["compile", "CompiledModel", "CaptureError", "capture_groups", "default_buckets"]

# the user's ``streams`` option -> which executor's graphs are captured ("auto": time the candidates, keep
# the fastest per bucket; "forward", for CompiledModel.capture only: the plain graph of the model's forward;
# "single_cl" / "multi_cl", likewise: the channels-last DAG of compile(channels_last="auto"))
_CAPTURE_KIND = {"auto": "auto", "max": "multi", 1: "single", "forward": "forward",
                 "single_cl": "single_cl", "multi_cl": "multi_cl"}
# CompiledModel.stream_choice's kinds -> the ``streams`` that captures that kind again
STREAMS_OF_KIND = {"single": 1, "multi": "max", "forward": "forward", "single_cl": "single_cl", "multi_cl": "multi_cl"}
# bound on CompiledModel._accepted (signatures are at most max_batch per input type; this is a guard)
_MAX_ACCEPTED = 4096


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ..., up to and including ``max_batch`` (which need not be a power of two)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


class CompiledModel:
    """A model compiled by :func:`compile`. Call it like the model; see the module docstring.

    Attributes: ``plan`` (the multi-stream :class:`StreamPlan`), ``buckets``, ``memory_bytes`` (graph
    memory), ``device``, ``stream_choice`` (bucket -> "single"/"multi"/"forward" actually kept: the DAG
    on one stream, on Nimble's streams, or the model's own forward; with ``channels_last="auto"`` also
    "single_cl"/"multi_cl", the channels-last DAG), ``graph`` (the operator DAG), ``graph_cl`` (the
    channels-last DAG, or None), ``compile_seconds``.
    """

    def __init__(
        self,
        graph: OpGraph,
        specs: list[InputSpec],
        examples: list[torch.Tensor],
        *,
        max_batch: int,
        buckets: tuple[int, ...],
        streams: str | int,
        device: torch.device,
        module: torch.nn.Module | None = None,
        graph_cl: OpGraph | None = None,
    ) -> None:
        self.graph = graph
        self.graph_cl = graph_cl
        self.specs = specs
        self.max_batch = max_batch
        self.buckets = buckets
        self.streams = streams
        self.device = device
        self._examples = examples
        names = graph.names
        n, edges = len(graph.ops), graph.edges
        self.plan: StreamPlan = assign_streams(n, edges, names=names)
        self.single_plan: StreamPlan = single_stream_plan(n, edges, names=names)
        self._executors = {
            "multi": StreamExecutor(graph, self.plan),
            "single": StreamExecutor(graph, self.single_plan),
        }
        if module is not None:  # the user's forward: a candidate of "auto" (see ForwardExecutor)
            self._executors["forward"] = ForwardExecutor(module, single_stream_plan(1, [], names=["forward"]))
        if graph_cl is not None:  # candidates of "auto" too: the same DAG with NHWC convolutions
            n_cl, edges_cl, names_cl = len(graph_cl.ops), graph_cl.edges, graph_cl.names
            self._executors["multi_cl"] = StreamExecutor(graph_cl, assign_streams(n_cl, edges_cl, names=names_cl))
            self._executors["single_cl"] = StreamExecutor(graph_cl, single_stream_plan(n_cl, edges_cl, names=names_cl))
        self._graphs: GraphSet | None = None
        self._cl_dropped = False  # compile timed the channels-last DAG, no bucket kept it, it was freed
        self.compile_seconds = 0.0

    # -- construction ---------------------------------------------------------------------------
    @property
    def choice(self) -> str:
        return _CAPTURE_KIND[self.streams]

    def capture(
        self,
        stream_factory: StreamFactory | None = None,
        buckets: Sequence[int] | None = None,
        streams: str | int | None = None,
        warmup: int = 3,
        keep_graph: bool = False,
    ) -> GraphSet:
        """Capture graphs for ``buckets`` (default: all) on streams from ``stream_factory``.

        Pass a partition's stream factory to confine every kernel to that partition's SMs. ``streams``
        overrides the compile-time choice ("auto", "max", 1, "forward": the plain graph of the
        model's own forward, where compile kept the model, or "single_cl"/"multi_cl": the
        channels-last DAG of ``channels_last="auto"``); ``warmup`` eager runs precede each
        capture (cuDNN picks its algorithms there); ``keep_graph`` keeps each captured ``cudaGraph_t``
        (``raw_cuda_graph()``) for a launch graph that embeds it. The returned :class:`GraphSet` owns its
        static buffers and pool; keep it alive as long as you replay it.
        """
        if self.device.type != "cuda":
            raise RuntimeError("CompiledModel.capture needs a CUDA device; this model was compiled for "
                               f"{self.device}")
        if streams is not None and streams not in _CAPTURE_KIND:
            raise ValueError(f"streams must be one of {', '.join(map(repr, _CAPTURE_KIND))}, got {streams!r}")
        choice = self.choice if streams is None else _CAPTURE_KIND[streams]
        if choice == "forward" and "forward" not in self._executors:
            raise ValueError("streams='forward' needs the model's own forward, which compile did not keep "
                             "(its parameters were not all on the compile device)")
        if choice.endswith("_cl"):
            self._require_channels_last(choice)
        wanted = tuple(buckets) if buckets is not None else self.buckets
        unknown = [b for b in wanted if b not in self.buckets]
        if unknown:
            raise ValueError(f"buckets {unknown} are not among this model's buckets {self.buckets}")
        with torch.cuda.device(self.device):
            return capture_graphs(self._executors, self._examples, wanted, choice=choice,
                                  stream_factory=stream_factory, warmup=warmup, keep_graph=keep_graph)

    def drop_channels_last(self) -> None:
        """Free the channels-last DAG (its NHWC weights) once no bucket uses it."""
        self.graph_cl = None
        self._executors.pop("single_cl", None)
        self._executors.pop("multi_cl", None)
        self._cl_dropped = True

    @property
    def channels_last(self) -> bool | str:
        """The layouts this model's graphs run in: True (every convolution NHWC), "auto" (the
        channels-last DAG kept for some buckets) or False (the model's own layout only)."""
        if self.graph.channels_last_weights:
            return True
        return "auto" if self.graph_cl is not None else False

    @property
    def fused_convolutions(self) -> int:
        """Convolutions fused with their bias and ReLU in the DAGs this model keeps (its NCHW one and,
        where a bucket kept it, the channels-last one): 0 where nothing was fused."""
        return self.graph.fused_convolutions + (self.graph_cl.fused_convolutions if self.graph_cl is not None else 0)

    @property
    def split_linears(self) -> int:
        """Float32 linear layers whose GEMM splits its reduction where that was timed faster
        (``compile(split_gemms=...)``; their choices: ``gpuloom.engine.gemm.choices()``); 0 where none."""
        return self.graph.split_linears

    @property
    def fused_epilogues(self) -> int:
        """Convolutions whose bias, residual add and activation run as one kernel
        (``compile(fuse_epilogues=...)``, :mod:`gpuloom.engine.epilogue`); 0 where none."""
        return self.graph.fused_epilogues

    @property
    def fused_gates(self) -> int:
        """Squeeze-excitation gates (1x1 convolution, activation, 1x1 convolution, gate, scaling) run as
        two kernels each (``compile(fuse_gates=...)``, :mod:`gpuloom.engine.excitation`); 0 where none."""
        return self.graph.fused_gates

    def _require_channels_last(self, kind: str) -> None:
        """ValueError, saying why, where ``kind`` (an executor) is missing: only the channels-last
        DAG's can be (``single``/``multi`` always exist)."""
        if kind in self._executors:
            return
        if self._cl_dropped:
            why = "compile timed it and no bucket kept it, so it was freed"
        else:
            why = ("not asked for, compiled for the CPU (nothing to time there), captured with torch.fx, or no "
                   "4-D convolution weight to convert")
        raise ValueError(f"streams={kind!r} needs the channels-last DAG of compile(channels_last='auto'), "
                         f"which this model does not have: {why}")

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the default graphs (pool + static buffers); 0 on the CPU path."""
        return self._graphs.memory_bytes if self._graphs is not None else 0

    @property
    def stream_choice(self) -> dict[int, str]:
        if self._graphs is None:
            return {}
        return {b: e.kind for b, e in sorted(self._graphs.buckets.items())}

    # -- calling --------------------------------------------------------------------------------
    def signature(self) -> str:
        return "(" + ", ".join(s.describe() for s in self.specs) + f") with 1 <= B <= {self.max_batch}"

    @functools.cached_property
    def _bucket_table(self) -> tuple[int, ...]:
        """``_bucket_table[n]``: the bucket a batch of ``n`` runs in, for 1 <= n <= max_batch."""
        table, i = [self.buckets[0]], 0
        for n in range(1, self.max_batch + 1):
            while self.buckets[i] < n:
                i += 1
            table.append(self.buckets[i])
        return tuple(table)

    @functools.cached_property
    def _accepted(self) -> dict[tuple, tuple[int, int]]:
        """Input signatures that passed :meth:`_check` -> (batch, bucket). Every check depends only on
        the number of inputs and each one's type, shape, dtype and device, so a signature seen once
        is accepted for good; with the dtypes, devices and per-sample shapes fixed there are at most
        ``max_batch`` of them (per input type)."""
        return {}

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds ``batch`` (a table look-up)."""
        if 1 <= batch <= self.max_batch:
            return self._bucket_table[batch]
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} is larger than max_batch={self.max_batch}; expected {self.signature()}")

    def _check(self, inputs: Sequence[Any]) -> int:
        if len(inputs) != len(self.specs):
            raise TypeError(f"expected {len(self.specs)} input(s) {self.signature()}, got {len(inputs)}")
        batch = None
        for spec, x in zip(self.specs, inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {spec.name!r} must be a torch.Tensor, got {type(x).__name__}; "
                                f"expected {self.signature()}")
            problem = None
            if x.dtype != spec.dtype:
                problem = f"dtype {x.dtype}"
            elif x.device != spec.device:
                problem = f"device {x.device}"
            elif x.dim() != len(spec.shape) + 1:
                problem = f"rank {x.dim()} (shape {tuple(x.shape)})"
            elif tuple(x.shape[1:]) != spec.shape:
                problem = f"shape {tuple(x.shape)}"
            if problem:
                raise ValueError(f"input {spec.name!r} has {problem}; expected {spec.describe()} "
                                 f"(full signature {self.signature()}). gpuloom never casts or moves inputs.")
            if batch is None:
                batch = x.shape[0]
            elif x.shape[0] != batch:
                raise ValueError(f"all inputs must share the batch size: {spec.name!r} has {x.shape[0]}, "
                                 f"the first input has {batch}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} is larger than max_batch={self.max_batch}; expected {self.signature()}")
        return batch

    def _batch_and_bucket(self, inputs: tuple[Any, ...]) -> tuple[int, int]:
        """(batch, bucket) of a call: a dict look-up of the input signature when it was accepted
        before (about 0.3 us a tensor), else the full :meth:`_check` (which raises on bad input)."""
        try:
            key = tuple([(type(x), x.shape, x.dtype, x.device) for x in inputs])
            hit = self._accepted.get(key)
        except (AttributeError, TypeError):  # not a tensor (or an unhashable look-alike): full check
            key = hit = None
        if hit is not None:
            return hit
        n = self._check(inputs)
        hit = (n, self.bucket_for(n))
        if key is not None:
            if len(self._accepted) >= _MAX_ACCEPTED:  # only reachable with many tensor subclasses
                self._accepted.clear()
            self._accepted[key] = hit
        return hit

    def __call__(self, *inputs: torch.Tensor, zero_copy: bool = False) -> Any:
        """Run the model. On the GPU: copy into the bucket's static inputs and replay on the current
        stream (asynchronous, like any CUDA op). ``zero_copy=True`` returns views of the static output
        buffers, valid until the next call for the same bucket.

        The hot path costs a few microseconds of host time: a known input signature skips the full
        check, grad mode is switched off only when it is on, and the graph is launched directly
        (``CUDAGraph.replay`` enqueues on the current stream of the device it was captured on, which
        is where the inputs were copied)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._call(inputs, zero_copy)
        return self._call(inputs, zero_copy)

    def _call(self, inputs: tuple[torch.Tensor, ...], zero_copy: bool) -> Any:
        n, b = self._batch_and_bucket(inputs)
        graphs = self._graphs
        if graphs is None:
            return self._executors["multi"].run(inputs)
        entry = graphs.buckets[b]
        if n == b:
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x)
        else:
            for static, x in zip(entry.inputs, inputs):
                static[:n].copy_(x)
        entry.graph.replay()
        out = entry.outputs
        if n == b and not zero_copy and type(out) is torch.Tensor:
            return out.clone()
        return _slice(out, n, b, copy=not zero_copy)

    def run_eager_plan(self, *inputs: torch.Tensor, streams: str | int = "max") -> Any:
        """Run the DAG without graphs (debugging): on CPU in order, on GPU on the plan's streams.
        ``streams``: "max", 1, or "multi_cl"/"single_cl" (the channels-last DAG, where compiled)."""
        self._check(inputs)
        kind = {1: "single", "max": "multi"}.get(streams, streams)
        if kind not in ("single", "multi", "single_cl", "multi_cl"):
            raise ValueError(f"streams must be 'max', 1, 'multi_cl' or 'single_cl', got {streams!r}")
        self._require_channels_last(kind)
        ex = self._executors[kind]
        if self.device.type != "cuda":
            return ex.run(inputs)
        with torch.no_grad():
            cur = torch.cuda.current_stream(self.device)
            extra = [torch.cuda.Stream(self.device) for _ in range(ex.plan.num_streams - 1)]
            return ex.run(inputs, [cur, *extra])

    @property
    def rewrites(self) -> dict[str, int]:
        """What compile's graph passes changed, by pass (only those that changed something): folded
        BatchNorms, NHWC weights, fused convolutions, split GEMMs, fused epilogues and gates."""
        counts = {"folded_batchnorms": self.graph.folded_batchnorms,
                  "channels_last_weights": self.graph_cl.channels_last_weights if self.graph_cl is not None
                  else self.graph.channels_last_weights,
                  "fused_convolutions": self.fused_convolutions, "split_linears": self.split_linears,
                  "fused_epilogues": self.fused_epilogues, "fused_gates": self.fused_gates}
        return {k: v for k, v in counts.items() if v}

    def __repr__(self) -> str:
        where = "cuda graphs" if self._graphs is not None else "cpu, no graphs"
        rewrites = "".join(f", {k}={v}" for k, v in self.rewrites.items())
        return (f"CompiledModel(ops={len(self.graph.ops)}, streams={self.plan.num_streams}, "
                f"syncs={self.plan.num_syncs}, buckets={self.buckets}, device={self.device}, {where}, "
                f"capture={self.graph.method}{rewrites})")


def _slice(value: Any, n: int, bucket: int, *, copy: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if n != bucket and value.dim() >= 1 and value.shape[0] == bucket:
            value = value[:n]
        return value.clone() if copy else value
    if isinstance(value, tuple):
        return tuple(_slice(v, n, bucket, copy=copy) for v in value)
    if isinstance(value, list):
        return [_slice(v, n, bucket, copy=copy) for v in value]
    if isinstance(value, dict):
        return {k: _slice(v, n, bucket, copy=copy) for k, v in value.items()}
    return value


def capture_groups(cm: Any, *, single: bool = False) -> dict[Any, list[int]]:
    """``cm``'s buckets grouped by the ``streams`` argument of ``cm.capture`` that captures each again
    the way compile kept it (``stream_choice``: "single" -> 1, "multi" -> "max", "forward" ->
    "forward", the channels-last kinds -> themselves; a bucket without a choice, "max"). ``single``:
    multi-stream buckets get one stream instead (1, or "single_cl")."""
    choice = dict(getattr(cm, "stream_choice", None) or {})
    groups: dict[Any, list[int]] = {}
    for b in cm.buckets:
        kind = choice.get(b, "multi")
        if single and kind.startswith("multi"):
            kind = kind.replace("multi", "single")
        groups.setdefault(STREAMS_OF_KIND[kind], []).append(b)
    return groups


def _all_on(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` (its forward can run there)."""
    return all(t.device == device for t in [*model.parameters(), *model.buffers()])


def _model_device(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> torch.device:
    for p in model.parameters():
        return p.device
    return inputs[0].device if inputs else torch.device("cpu")


def resolve_channels_last(channels_last: bool | str | None, streams: str | int) -> bool | str:
    """compile's ``channels_last`` as given, or for None (the default) what the streams choice allows:
    both layouts timed where ``streams="auto"`` times candidates anyway, the model's own otherwise."""
    if channels_last is None:
        return "auto" if streams == "auto" else False
    if not is_channels_last(channels_last):
        raise ValueError(f"channels_last must be False, True or 'auto', got {channels_last!r}")
    return channels_last


def _triton_option(name: str, value: bool | None, dev: torch.device) -> bool:
    """An option that runs gpuloom's Triton kernels: as given, or for None on for CUDA where Triton imports."""
    if value is None:
        return dev.type == "cuda" and epilogue.available()
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None, got {value!r}")
    return value


def resolve_fuse_convolutions(fuse: bool | str | None, *, reinplace: bool, channels_last: bool | str) -> bool | str:
    """compile's ``fuse_convolutions`` as given, or for None (the default since the thirty-fourth
    session) "channels_last": the NHWC graph fused (engine runs 100-101: 1.27-1.74x faster than the
    unfused NHWC graph; runs 102-104: the fused default 1.12x the unfused one at float32 batch 1,
    worst row 0.958x where both kept the same unfused NCHW graph), the NCHW graph left as it was,
    where fusing lost on mobilenet_v2 (run 94). ``reinplace`` with the ``"auto"`` candidate would
    fuse nothing (the candidate is copied after reinplace, whose in-place ReLUs and adds the fusion
    does not match): the default gets False there, an explicit "channels_last" a ValueError."""
    if fuse is None:
        return False if reinplace and channels_last == "auto" else "channels_last"
    if not is_fuse_convolutions(fuse):
        raise ValueError(f"fuse_convolutions must be False, True or 'channels_last', got {fuse!r}")
    if fuse == "channels_last" and reinplace and channels_last == "auto":
        raise ValueError("fuse_convolutions='channels_last' with reinplace=True fuses nothing in the "
                         "channels_last='auto' candidate; pass channels_last=True, or leave reinplace off")
    return fuse


def compile(
    model: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    max_batch: int = 32,
    streams: str | int = "auto",
    device: str | torch.device | None = None,
    buckets: Sequence[int] | None = None,
    input_names: Sequence[str] | None = None,
    fold_batchnorm: bool = True,
    reinplace: bool = False,
    channels_last: bool | str | None = None,
    fuse_convolutions: bool | str | None = None,
    split_gemms: bool | None = None,
    fuse_epilogues: bool | None = None,
    fuse_gates: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompiledModel:
    """Compile ``model`` ahead of time into multi-stream CUDA graphs, one per batch bucket.

    Args:
        model: an ``nn.Module`` in eval mode, on ``device``.
        example_inputs: a tensor or a tuple of tensors, each with the batch as dimension 0. Their
            per-sample shapes and dtypes are the compiled signature.
        max_batch: the largest batch a call may have.
        streams: ``"auto"`` (on the GPU, time per bucket the single- and multi-stream graphs of the DAG
            and the plain graph of the model's own forward, and keep the fastest), ``"max"``
            (Nimble's plan: maximum logical concurrency), or ``1`` (one stream).
        device: where to run; default: the model's device. CPU runs the DAG without graphs.
        buckets: batch buckets to capture; default 1, 2, 4, ..., max_batch.
        input_names: names used in error messages (default: the forward's argument names).
        fold_batchnorm: fold inference BatchNorms into the convolutions they follow (one kernel
            instead of two; results differ from eager only by rounding).
        reinplace: run ReLU / residual adds whose input has no other reader in place
            (experimental, off until measured on the GPU).
        channels_last: store the convolution weights NHWC, so the convolutions and the activations
            between them run channels-last (tensor-core friendly; torch.compile's layout for
            convolution nets, which won most batch-8 rows). The model's own forward, a candidate of
            ``streams="auto"``, keeps its layout. ``"auto"`` (with ``streams="auto"``, on the GPU): time
            the channels-last DAG's graphs beside the others and keep the fastest per bucket (the
            convolution weights are held in both layouts while compiling; where no bucket keeps the
            channels-last DAG, it is freed). On the H200 channels-last ran resnet50, resnet101,
            inception_v3 and nasnetalarge 1.23-1.55x faster at batch 1 (float32) and mobilenet_v2,
            efficientnet_b0 and googlenet up to 25% slower in some runs, and ``"auto"`` kept the faster
            layout on every row measured. Where a bucket keeps the channels-last DAG, both DAGs (and
            the convolution weights in both layouts) stay after compile. Default
            (None): ``"auto"`` with ``streams="auto"``, else False. The runtime passes each model's
            own setting (False unless its config says otherwise: its shipped profiles were measured
            in NCHW).
        fuse_convolutions: run each 2-D convolution (one group, with a bias: every one a BatchNorm
            was folded into) that only feeds a ReLU, a ReLU6, or a residual add and a ReLU as cuDNN's
            fused convolution + bias (+ add) + ReLU, where PyTorch's cuDNN path adds the bias with a
            kernel of its own (CUDA only). ``"channels_last"``: only in the channels-last graph
            (``channels_last=True``, or the candidate ``channels_last="auto"`` times beside the NCHW
            graph, which stays unfused); a no-op on the CPU and with ``channels_last=False``. ``True``:
            every graph (CUDA only). Default (None): ``"channels_last"``, or False with ``reinplace=True``
            and ``channels_last="auto"`` (whose candidate it could not fuse). On the H200 (engine runs
            94, 100-104) fusing made the channels-last graphs up to 1.74x faster (resnet50 float16,
            batch 8; 1.12x geomean over ten models in float32 at batch 1, never more than noise slower)
            and the NCHW ones 0.90-1.12x (mobilenet_v2 slower by its ReLU6 convolutions). Not
            ``"channels_last"`` with ``reinplace=True`` and ``channels_last="auto"``.
        split_gemms: run each float32 linear layer's GEMM with its reduction split in 2-8 parts (one
            batched GEMM, then a sum) where that was timed faster for its shape, at its first call in
            a capture's warm-ups (``gpuloom.engine.gemm``): at a small batch a GEMM's few output rows
            leave most SMs idle. CUDA only. Default (None): on for CUDA. On the H200 (run 127) it ran
            two of bert_base's four GEMMs 1.9x faster at batch 1; a shape where no split wins keeps
            cuBLAS's own call. Results differ from eager's only by the order of the sums.
        fuse_epilogues: run each convolution's bias, residual add and SiLU / sigmoid / ReLU6 (where
            the convolution's only reader is one of them) as one kernel (``gpuloom.engine.epilogue``,
            Triton), where PyTorch's cuDNN path runs the bias add, the add and the activation one
            kernel each. ReLUs stay ``fuse_convolutions``'s. Default (None): on for CUDA where Triton
            imports. ``True`` on the CPU runs the same rewritten graph with eager's ops (for tests).
            Results differ from eager's only by the activation's last bit.
        fuse_gates: run each squeeze-excitation gate (1x1 convolution, ReLU / SiLU, 1x1 convolution,
            sigmoid / hardsigmoid on a pooled ``[N, C, 1, 1]`` map, then the map scaled by it;
            EfficientNet's and MobileNetV3's) as two Triton kernels (``gpuloom.engine.excitation``)
            where eager runs two GEMVs, their epilogues and the multiply: efficientnet_b0 1.24x at
            batch 1 on the H200 (engine run 140). Default (None): as ``fuse_epilogues``'s. ``True`` on
            the CPU runs the rewritten graph with eager's ops (for tests). Results differ from eager's
            by the order of the sums (and TF32: the kernels multiply in full float32).
        progress: called with a short message at each compile stage.

    Raises:
        CaptureError: neither torch.export nor torch.fx could capture the model (says which op).
        ValueError / TypeError: bad arguments, with what was expected.
    """
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"gpuloom.compile expects an nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("gpuloom.compile compiles inference graphs: call model.eval() first "
                         "(training-mode BatchNorm/Dropout would be baked into the graph)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if not example_inputs or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in example_inputs):
        raise TypeError("example_inputs must be a tensor or a tuple of tensors with a batch dimension first")
    if streams not in ("auto", "max", 1):
        raise ValueError(f"streams must be one of 'auto', 'max' or 1, got {streams!r}")
    channels_last = resolve_channels_last(channels_last, streams)
    if channels_last == "auto" and streams != "auto":
        raise ValueError("channels_last='auto' times both layouts, which only streams='auto' does; "
                         f"got streams={streams!r} (pass channels_last=True or False with it)")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    dev = torch.device(device) if device is not None else _model_device(model, example_inputs)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    for x in example_inputs:
        if x.device.type != dev.type:
            raise ValueError(f"example inputs must be on {dev}, found one on {x.device}")
    fuse_convolutions = resolve_fuse_convolutions(fuse_convolutions, reinplace=reinplace, channels_last=channels_last)
    if fuse_convolutions is True and dev.type != "cuda":
        raise ValueError("fuse_convolutions=True runs cuDNN's fused convolutions, which need a CUDA device; "
                         f"this model compiles for {dev}")
    # "channels_last": fused where the graph is channels-last, on CUDA only (the fused ops have no CPU kernel)
    fuse_cl = fuse_convolutions is True or (fuse_convolutions == "channels_last" and dev.type == "cuda")
    if split_gemms is None:
        split_gemms = dev.type == "cuda"
    elif not isinstance(split_gemms, bool):
        raise ValueError(f"split_gemms must be True, False or None, got {split_gemms!r}")
    elif split_gemms and dev.type != "cuda":
        raise ValueError("split_gemms=True times its GEMMs on the GPU, which needs a CUDA device; "
                         f"this model compiles for {dev}")
    fuse_epilogues = _triton_option("fuse_epilogues", fuse_epilogues, dev)
    fuse_gates = _triton_option("fuse_gates", fuse_gates, dev)
    bucket_list = tuple(sorted(set(buckets))) if buckets is not None else default_buckets(max_batch)
    if bucket_list[0] < 1 or bucket_list[-1] != max_batch:
        raise ValueError(f"buckets must be positive and end at max_batch={max_batch}, got {bucket_list}")

    say("capturing the operator graph")
    graph = capture_graph(model, example_inputs, max_batch=max_batch, fold_batchnorm=fold_batchnorm,
                          reinplace=reinplace, channels_last=channels_last is True,
                          fuse_convolutions=fuse_cl if channels_last is True else fuse_convolutions is True,
                          split_gemms=split_gemms, fuse_epilogues=fuse_epilogues, fuse_gates=fuse_gates)
    graph.module.to(dev)
    graph_cl = None
    if channels_last == "auto" and dev.type == "cuda":  # a timed choice: there is nothing to time on the CPU
        graph_cl = channels_last_variant(graph, fuse_convolutions=fuse_cl)
        say("built the channels-last variant of the graph" if graph_cl is not None else
            "no channels-last variant: no 4-D convolution weight to convert, or the model was captured with torch.fx")
    names = list(input_names) if input_names else [
        n.name for n in graph.module.graph.nodes if n.op == "placeholder"
    ]
    if len(names) != len(example_inputs):
        names = [f"input{i}" for i in range(len(example_inputs))]
    specs = [InputSpec(nm, tuple(x.shape[1:]), x.dtype, dev) for nm, x in zip(names, example_inputs)]
    cm = CompiledModel(graph, specs, [x.detach() for x in example_inputs], max_batch=max_batch,
                       buckets=bucket_list, streams=streams, device=dev,
                       module=model if _all_on(model, dev) else None, graph_cl=graph_cl)
    for ex in cm._executors.values():
        ex.refresh_attrs()
    if dev.type == "cuda":
        say(f"capturing CUDA graphs for buckets {bucket_list}")
        cm._graphs = cm.capture()
        for b, why in sorted(cm._graphs.skipped.items()):
            say(f"bucket {b}: timed without the candidates that could not be captured ({why})")
        if cm.graph_cl is not None and not any(k.endswith("_cl") for k in cm.stream_choice.values()):
            cm.drop_channels_last()
            say("no bucket kept the channels-last graph: its weights are freed")
    cm.compile_seconds = time.perf_counter() - t0
    return cm
