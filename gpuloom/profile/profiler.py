"""The latency profiler: L(model, batch, SMs) measured by graph replay inside real SM partitions.

Per model the work is: compile (or build the fallback runner) once; then for each partition size
``s`` of the grid (8, 16, ..., 128, 132 on an H200) carve one green-context partition of ``s`` SMs,
capture every batch bucket's graph on the partition's streams (so its kernels are confined to those
SMs), and for each bucket replay it a few times as warm-up and ``reps`` times timed with CUDA events
on the partition's stream; the point's latency is the median. The partition is destroyed before the
next size. ``reps`` adapts to the latency (about ``target_ms`` of timed replays per point, between
``min_reps`` and ``max_reps``) so that 7 batches x 17 SM counts fit in under a minute.

Runners (how a model becomes replayable graphs):

* ``EngineRunner``: ``gpuloom.compile`` (multi-stream Nimble graphs); every stream of a capture
  comes from the partition's ``stream_factory``. The per-bucket single/multi choice made at compile
  time on the whole GPU is kept for every partition.
* ``GraphRunner`` (fallback, for models the engine rejects and until the engine is available): a
  plain single-stream ``torch.cuda.CUDAGraph`` of the eager forward, captured on the partition's
  stream.

The predicted knee comes from ``kernel_records``: one eager forward per batch under
``torch.profiler`` (CUDA activity), whose Kineto kernel events carry grid, block, registers per
thread and shared memory (see ``gpuloom.profile.knee``).

Everything here needs torch and a CUDA GPU; ``gpuloom.profile.knee`` and the store do not.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..engine.capture import cublas_workspaces_in_pool, rng_restored_if_capture_fails
from ..gpu import NoGpuError, PartitionError, Partitioner, device_facts, sm_grid
from .knee import DEFAULT_VARIANT, KernelRecord, OccupancyLimits, measured_knee, parse_chrome_trace, predict_variant
from .knee import variants as knee_variants
from .store import GpuInfo, Profile, today

__all__ = [
    "ModelSpec", "load_model", "GraphRunner", "EngineRunner", "make_runner", "ProfileRun", "profile_model",
    "kernel_records", "time_replays", "plot_profile", "BERT_BASE",
]

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)


# -- models ----------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """A model ready to profile: the module (eval mode, on its device) and how to make inputs."""

    name: str  # profile name, e.g. "resnet50"
    module: torch.nn.Module
    input_shapes: tuple[tuple[int, ...], ...]  # per input, without batch
    input_dtypes: tuple[torch.dtype, ...]
    dtype: str = "float32"  # the model's compute dtype, as stored in the profile

    def make_inputs(self, batch: int, device: torch.device | str) -> list[torch.Tensor]:
        """Random inputs of ``batch`` rows (never zeros: they can run faster than real data)."""
        out = []
        g = torch.Generator(device="cpu").manual_seed(batch)
        for shape, dt in zip(self.input_shapes, self.input_dtypes):
            if dt.is_floating_point:
                x = torch.randn((batch, *shape), generator=g).to(dt)
            else:
                x = torch.randint(0, 1000, (batch, *shape), generator=g).to(dt)
            out.append(x.to(device))
        return out


class BertBaseEncoder(torch.nn.Module):
    """A BERT-base-sized encoder: ``nn.TransformerEncoder``, 12 layers, d=768, 12 heads, ff=3072, GELU.

    Input: hidden states ``(batch, 128, 768)`` float (the embedding lookup is left out: it is a gather
    that costs next to nothing). Random weights.
    """

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, ff: int = 3072) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


BERT_BASE = "bert_base"
_INPUT_299 = {"inception_v3"}
_NO_AUX = {"inception_v3", "googlenet"}


def load_model(name: str, *, device: str | torch.device = "cuda", input_shape: tuple[int, ...] | None = None
               ) -> ModelSpec:
    """A ``ModelSpec`` for a torchvision name, a timm name, ``bert_base``, or ``module:factory``.

    ``module:factory`` imports ``module`` and calls ``factory()``, which returns an ``nn.Module`` or
    ``(module, input_shape)``; ``input_shape`` (without batch) defaults to ``3x224x224``. Random
    weights throughout. Raises ``ValueError`` for a name no source knows.
    """
    shape = tuple(input_shape) if input_shape else None
    if name == BERT_BASE:
        m: torch.nn.Module = BertBaseEncoder()
        shape = shape or (128, 768)
    elif ":" in name:
        mod_name, fn_name = name.split(":", 1)
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"model {name!r}: expected 'module:factory' naming an importable callable ({e})") from e
        made = fn()
        if isinstance(made, tuple):
            m, shape = made[0], tuple(made[1])
        else:
            m = made
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model {name!r}: factory returned {type(m).__name__}, expected an nn.Module")
        shape = shape or (3, 224, 224)
        name = fn_name
    else:
        m, default_shape = _named_model(name)
        shape = shape or default_shape
    m = m.eval().to(device)
    return ModelSpec(name=name, module=m, input_shapes=(tuple(shape),), input_dtypes=(torch.float32,))


def _named_model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    import torchvision

    tv_names = set(torchvision.models.list_models())
    if name in tv_names:
        kwargs: dict[str, Any] = {"weights": None}
        if name in _NO_AUX:
            kwargs["aux_logits"] = False
            kwargs["init_weights"] = True
        m = torchvision.models.get_model(name, **kwargs)
        return m, (3, 299, 299) if name in _INPUT_299 else (3, 224, 224)
    try:
        import timm
    except ImportError:
        timm = None
    if timm is not None and timm.is_model(name):
        m = timm.create_model(name, pretrained=False)
        size = tuple(m.default_cfg.get("input_size", (3, 224, 224)))
        return m, size
    raise ValueError(f"unknown model {name!r}: expected a torchvision or timm model name, {BERT_BASE!r}, "
                     f"or 'module:factory'")


# -- runners ---------------------------------------------------------------------------------------

class Captured(Protocol):
    """Graphs of every bucket captured in one partition."""

    stream: Any  # the stream replays are enqueued on (the partition's main stream)

    def replay(self, bucket: int) -> None: ...  # asynchronous, on ``stream``

    def close(self) -> None: ...  # drop the graphs (before the partition is destroyed)


class Runner(Protocol):
    kind: str  # "engine" or "graph"
    buckets: tuple[int, ...]

    def capture(self, partition: Any) -> Captured: ...  # a gpuloom.gpu.Partition, or None: whole GPU


class _GraphCaptured:
    def __init__(self, graphs: dict[int, torch.cuda.CUDAGraph], stream: Any, keep: list[Any]) -> None:
        self.graphs, self.stream, self._keep = graphs, stream, keep

    def replay(self, bucket: int) -> None:
        with torch.cuda.stream(self.stream):
            self.graphs[bucket].replay()

    def close(self) -> None:
        self.graphs.clear()
        self._keep.clear()


class GraphRunner:
    """Fallback runner: one single-stream ``torch.cuda.CUDAGraph`` of the eager forward per bucket.

    Inputs are random static buffers made once per bucket and shared by every capture. cuDNN picks
    its algorithms once, on the whole GPU, in ``__init__`` (``cudnn.benchmark`` as the engine does).
    """

    kind = "graph"

    def __init__(self, spec: ModelSpec, buckets: Sequence[int], device: str | torch.device = "cuda") -> None:
        self.spec, self.buckets = spec, tuple(sorted(buckets))
        self.device = torch.device(device)
        self.inputs = {b: spec.make_inputs(b, self.device) for b in self.buckets}
        torch.backends.cudnn.benchmark = True
        with torch.no_grad():
            for b in self.buckets:
                for _ in range(2):
                    spec.module(*self.inputs[b])
        torch.cuda.synchronize()

    def capture(self, partition: Any) -> Captured:
        stream = partition.stream if partition is not None else None
        stream = stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graphs, keep = {}, []
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad(), torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse the pool
                x = self.inputs[b]
                self.spec.module(*x)  # warm-up on this stream: lazy per-stream library state
                g = torch.cuda.CUDAGraph()
                with rng_restored_if_capture_fails(), cublas_workspaces_in_pool():
                    g.capture_begin(pool=pool)
                    try:
                        out = self.spec.module(*x)
                    finally:
                        g.capture_end()
                graphs[b] = g
                keep.append(out)
        return _GraphCaptured(graphs, stream, keep)


class _EngineCaptured:
    def __init__(self, sets: dict[int, Any]) -> None:
        self.sets = sets
        self.stream = next(iter(sets.values())).stream

    def replay(self, bucket: int) -> None:
        self.sets[bucket].replay(bucket)

    def close(self) -> None:
        self.sets.clear()


def engine_kind(channels_last: bool | str = False, fuse_convolutions: bool | str = False,
                split_gemms: bool = False, fuse_epilogues: bool = False) -> str:
    """What a profile of ``gpuloom.compile`` graphs timed (its ``runner``): ``engine``, or with the
    options that change it, ``engine:channels_last=true,fuse_convolutions=channels_last``. A model
    served with channels_last, fused convolutions, split GEMMs or fused epilogues needs a profile made so. Each
    option is named where it is not False (off): the plain engine's graph is ``engine``."""
    options = [f"{k}={str(v).lower()}" for k, v in (("channels_last", channels_last),
                                                     ("fuse_convolutions", fuse_convolutions),
                                                     ("split_gemms", split_gemms),
                                                     ("fuse_epilogues", fuse_epilogues)) if v is not False]
    return "engine" + (":" + ",".join(options) if options else "")


def applied_kind(compiled: Any, channels_last: bool | str = False, fuse_convolutions: bool | str = False,
                 split_gemms: bool = False, fuse_epilogues: bool = False) -> str:
    """:func:`engine_kind` of the options that changed ``compiled``'s graph (its ``rewrites``): an
    option with nothing to change in a model (``fuse_epilogues`` on resnet50) leaves the plain graph,
    so a profile of it and the model served with it both say ``engine``. The profiler names its
    profiles and the service checks a stored one this one way. ``engine`` for anything not compiled."""
    done = getattr(compiled, "rewrites", None)
    if not isinstance(done, dict):
        return engine_kind()
    return engine_kind(channels_last if done.get("channels_last_weights") else False,
                       fuse_convolutions if done.get("fused_convolutions") else False,
                       split_gemms if done.get("split_linears") else False,
                       fuse_epilogues if done.get("fused_epilogues") or done.get("fused_gates") else False)


class EngineRunner:
    """Runner over ``gpuloom.compile``: multi-stream graphs, every stream from the partition.

    Compiles once (on the whole GPU, where ``streams="auto"`` decides single vs multi per bucket)
    and then captures each bucket with that decision inside each partition.
    """

    kind = "engine"

    def __init__(self, spec: ModelSpec, buckets: Sequence[int], device: str | torch.device = "cuda",
                 streams: str | int = "auto", channels_last: bool | str = False,
                 fuse_convolutions: bool | str = False, compiled: Any = None, split_gemms: bool = False,
                 fuse_epilogues: bool = False) -> None:
        import gpuloom

        self.spec, self.buckets = spec, tuple(sorted(buckets))
        if compiled is not None:  # compiled already, with these options (the service, at a model's load)
            self.cm = compiled
        else:
            example = spec.make_inputs(1, device)
            self.cm = gpuloom.compile(spec.module, tuple(example), max_batch=self.buckets[-1], streams=streams,
                                      device=device, buckets=self.buckets, channels_last=channels_last,
                                      fuse_convolutions=fuse_convolutions, split_gemms=split_gemms,
                                      fuse_epilogues=fuse_epilogues,
                                      fuse_gates=fuse_epilogues)  # the service's option covers both kernels
        self.kind = applied_kind(self.cm, channels_last, fuse_convolutions, split_gemms, fuse_epilogues)
        from ..engine.compiled import capture_groups

        self.choice = {b: ch for ch, bs in capture_groups(self.cm).items() for b in bs}
        if streams != "auto":
            self.choice = {b: streams for b in self.buckets}
        # one eager warm-up per capture is enough once cuDNN has chosen its algorithms at compile time
        import inspect

        self._takes_warmup = "warmup" in inspect.signature(self.cm.capture).parameters

    def capture(self, partition: Any) -> Captured:
        # one capture per stream choice, each drawing its streams from a fresh factory of the same
        # partition, so all graphs share the partition's few streams
        sets = {}
        by_choice: dict[Any, list[int]] = {}
        for b in self.buckets:
            by_choice.setdefault(self.choice[b], []).append(b)
        from ..engine import gemm

        confined = partition is not None and partition.confined
        with gemm.scope(partition.sms if confined else None):  # split GEMMs choose on the partition's SMs
            for ch, bs in by_choice.items():
                factory = partition.stream_factory() if partition is not None else None
                kw = {"warmup": 1} if self._takes_warmup else {}
                gs = self.cm.capture(stream_factory=factory, buckets=bs, streams=ch, **kw)
                for b in bs:
                    sets[b] = gs
        return _EngineCaptured(sets)


def make_runner(spec: ModelSpec, buckets: Sequence[int], *, runner: str = "auto", device: str = "cuda",
                log: Callable[[str], None] = print, channels_last: bool | str = False,
                fuse_convolutions: bool | str = False, split_gemms: bool = False,
                fuse_epilogues: bool = False) -> Runner:
    """``runner="engine"``, ``"graph"`` or ``"auto"`` (the engine, falling back to a plain graph).
    ``channels_last``, ``fuse_convolutions``, ``split_gemms``, ``fuse_epilogues``: the engine's options
    (``gpuloom.compile``), as a served model's config sets them; a plain graph runs the model as written."""
    if runner not in ("auto", "engine", "graph"):
        raise ValueError(f"runner: expected 'auto', 'engine' or 'graph', got {runner!r}")
    for option, value in (("channels_last", channels_last), ("fuse_convolutions", fuse_convolutions),
                          ("split_gemms", split_gemms), ("fuse_epilogues", fuse_epilogues)):
        if value is not False and runner == "graph":
            raise ValueError(f"{option} is gpuloom.compile's option: it needs runner 'engine' or 'auto'")
    if runner in ("auto", "engine"):
        try:
            return EngineRunner(spec, buckets, device, channels_last=channels_last, fuse_convolutions=fuse_convolutions,
                                split_gemms=split_gemms, fuse_epilogues=fuse_epilogues)
        except Exception as e:  # noqa: BLE001 - the fallback is documented; say why it was taken
            if runner == "engine":
                raise
            log(f"{spec.name}: gpuloom.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                "falling back to a single-stream CUDA graph of the eager model")
    return GraphRunner(spec, buckets, device)


# -- timing ----------------------------------------------------------------------------------------

def time_replays(replay: Callable[[], None], stream: Any, *, warmup: int = 2, min_reps: int = 5,
                 max_reps: int = 40, target_ms: float = 40.0) -> tuple[float, int]:
    """Median ms of single replays on ``stream`` (CUDA events), and how many were timed.

    ``warmup`` untimed replays, one probe to size the run, then ``clamp(target_ms / probe, min_reps,
    max_reps)`` timed replays, each between two events recorded on ``stream``.
    """
    for _ in range(warmup):
        replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(stream)
    replay()
    e1.record(stream)
    e1.synchronize()
    probe = e0.elapsed_time(e1)
    reps = int(max(min_reps, min(max_reps, target_ms / max(probe, 1e-3))))
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in evs:
        a.record(stream)
        replay()
        b.record(stream)
    evs[-1][1].synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs), reps


# -- the sweep -------------------------------------------------------------------------------------

@dataclass
class ProfileRun:
    """What one profiling run produced: the profile and how it was made."""

    profile: Profile
    runner: str  # "engine" or "graph"
    seconds: float  # wall time of the sweep (captures + timing), s
    setup_seconds: float  # compile / runner construction, s
    reps: dict[str, int] = field(default_factory=dict)  # "batch@sms" -> timed replays
    kernels: dict[int, list[KernelRecord]] = field(default_factory=dict)  # batch -> kernel records
    predicted: dict[str, dict[int, int]] = field(default_factory=dict)  # method -> batch -> SMs

    def knee_rows(self, eps: float = 0.1) -> list[dict[str, Any]]:
        """One row per batch: measured and predicted knee, latency at the knee and on the whole GPU."""
        p = self.profile
        rows = []
        for i, b in enumerate(p.batches):
            km = measured_knee(p.sms, p.latency_ms[i], eps)
            rows.append({
                "batch": b,
                "knee_measured": km,
                "knee_predicted": p.predicted_knee.get(b),
                "latency_knee_ms": round(p.latency(b, km), 4),
                "latency_full_ms": round(p.full_latency(b), 4),
            })
        return rows


def check_sm_counts(sms: Sequence[int], sm_count: int, granularity: int) -> None:
    """Raise ``PartitionError`` unless every SM count is one partition the device can carve alone: a
    multiple of ``granularity`` up to the device, or the whole device."""
    bad = [s for s in sms if not (0 < s <= sm_count and (s % granularity == 0 or s == sm_count))]
    if bad:
        raise PartitionError(
            f"SM counts {bad}: each must be a multiple of {granularity} up to {sm_count - sm_count % granularity}, "
            f"or the whole device ({sm_count}), on this device; the default grid is "
            f"{','.join(str(s) for s in sm_grid(sm_count, granularity))}")


def profile_model(spec: ModelSpec, *, batches: Sequence[int] = DEFAULT_BATCHES, sms: Sequence[int] | None = None,
                  runner: str | Runner = "auto", device: int = 0, eps: float = 0.1, progress: bool = True,
                  predict: bool = True, knee_method: str = DEFAULT_VARIANT, warmup: int = 2, min_reps: int = 5,
                  max_reps: int = 40, target_ms: float = 40.0, log: Callable[[str], None] = print,
                  channels_last: bool | str = False, fuse_convolutions: bool | str = False,
                  split_gemms: bool = False, fuse_epilogues: bool = False) -> ProfileRun:
    """Measure ``spec``'s latency on every (batch, SM count) of the grid, inside real partitions.

    ``sms`` defaults to the device's grid (granularity steps up to the whole device). Returns a
    ``ProfileRun`` whose ``profile`` is ready for ``ProfileStore.put``. Raises ``NoGpuError``
    without a GPU.
    """
    if not torch.cuda.is_available():
        raise NoGpuError("profiling measures graph replays inside SM partitions and needs a CUDA GPU; "
                         "none is available (torch.cuda.is_available() is False). Shipped profiles: "
                         "gpuloom.profile.ProfileStore.builtin('h200')")
    facts = device_facts(device)
    grid = tuple(sorted(set(int(s) for s in (sms or facts.grid()))))
    check_sm_counts(grid, facts.sm_count, facts.sm_granularity)  # now, not after a minute of compiling
    batches = tuple(sorted(set(int(b) for b in batches)))
    t0 = time.perf_counter()
    if isinstance(runner, str):
        run_obj = make_runner(spec, batches, runner=runner, device=f"cuda:{device}", log=log,
                              channels_last=channels_last, fuse_convolutions=fuse_convolutions,
                              split_gemms=split_gemms, fuse_epilogues=fuse_epilogues)
    else:
        run_obj = runner
    setup = time.perf_counter() - t0
    lat: dict[tuple[int, int], float] = {}
    reps: dict[str, int] = {}
    real_sms: list[int] = []
    t1 = time.perf_counter()
    with _progress(progress, f"{spec.name} [{run_obj.kind}]", len(grid) * len(batches)) as advance:
        for s in grid:
            with Partitioner([s], mode="green", device=device) as parts:
                part = parts[0]
                real_sms.append(part.sms)
                cap = run_obj.capture(part)
                try:
                    for b in batches:
                        ms, n = time_replays(lambda: cap.replay(b), cap.stream, warmup=warmup, min_reps=min_reps,
                                             max_reps=max_reps, target_ms=target_ms)
                        lat[(b, s)] = ms
                        reps[f"{b}@{part.sms}"] = n
                        advance()
                    part.synchronize()
                finally:
                    cap.close()
                    del cap
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - t1
    if sorted(set(real_sms)) != real_sms:
        raise RuntimeError(f"partitions of {grid} SMs came out as {real_sms} SMs: not distinct and ascending")
    info = GpuInfo(name=facts.name, sm_count=facts.sm_count, sm_granularity=facts.sm_granularity,
                   driver=facts.driver, torch=facts.torch)
    rows = tuple(tuple(lat[(b, s)] for s in grid) for b in batches)
    kernels: dict[int, list[KernelRecord]] = {}
    predicted: dict[str, dict[int, int]] = {}
    if predict:
        lim = OccupancyLimits.from_device(facts)
        for b in batches:
            kernels[b] = kernel_records(spec, b, device=f"cuda:{device}")
        full = {b: lat[(b, grid[-1])] for b in batches}
        predicted = predict_all(kernels, tuple(real_sms), lim, full_latency_ms=full, eps=eps)
    profile = Profile(model=spec.name, input_shapes=spec.input_shapes, dtype=spec.dtype, gpu=info,
                      batches=batches, sms=tuple(real_sms), latency_ms=rows, date=today(), source="measured",
                      predicted_knee=predicted.get(knee_method, {}), runner=run_obj.kind)
    return ProfileRun(profile=profile, runner=run_obj.kind, seconds=seconds, setup_seconds=setup, reps=reps,
                      kernels=kernels, predicted=predicted)


def predict_all(kernels: dict[int, list[KernelRecord]], grid: Sequence[int], lim: OccupancyLimits, *,
                full_latency_ms: dict[int, float] | None = None, eps: float = 0.1) -> dict[str, dict[int, int]]:
    """Predicted knee per batch by every named variant (``knee.variants``), for comparison.

    ``+gaps`` variants are computed only when ``full_latency_ms`` (batch -> whole-GPU ms) is given.
    """
    out: dict[str, dict[int, int]] = {}
    for name, kw in knee_variants().items():
        if kw.get("gaps") and full_latency_ms is None:
            continue
        out[name] = {b: predict_variant(name, recs, grid, eps=eps, lim=lim,
                                        full_latency_us=(full_latency_ms or {}).get(b, 0.0) * 1000.0)
                     for b, recs in kernels.items() if recs}
    return out


def kernel_records(spec: ModelSpec, batch: int, *, device: str = "cuda") -> list[KernelRecord]:
    """Kernels of one warm eager forward of ``spec`` at ``batch``, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    x = spec.make_inputs(batch, device)
    with torch.no_grad():
        spec.module(*x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            spec.module(*x)
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return parse_chrome_trace(path)
    finally:
        os.unlink(path)


class _progress:
    """A rich progress bar (or nothing); ``advance()`` moves it one point."""

    def __init__(self, on: bool, label: str, total: int) -> None:
        self.on, self.label, self.total = on, label, total
        self._p = None

    def __enter__(self) -> Callable[[], None]:
        if not self.on:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # on stderr, as pip's and tqdm's: stdout is the command's output (JSON, a server's log redirected)
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           transient=False, console=Console(stderr=True))
        self._p.start()
        task = self._p.add_task(self.label, total=self.total)
        return lambda: self._p.advance(task)

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.stop()


# -- output ----------------------------------------------------------------------------------------

def run_to_json(run: ProfileRun, eps: float = 0.1) -> dict[str, Any]:
    """The run as JSON: the profile, the knee rows, predictions by method, timings, kernel records."""
    return {
        "profile": run.profile.to_json(),
        "runner": run.runner,
        "sweep_seconds": round(run.seconds, 2),
        "setup_seconds": round(run.setup_seconds, 2),
        "eps": eps,
        "knees": run.knee_rows(eps),
        "predicted_by_method": {m: {str(b): k for b, k in v.items()} for m, v in run.predicted.items()},
        "throughput_per_sm": {str(b): [[s, round(v, 3)] for s, v in run.profile.throughput_per_sm(b)]
                              for b in run.profile.batches},
        "reps": run.reps,
        "kernels": {str(b): [[k.name[:80], round(k.duration_us, 3), list(k.grid), list(k.block),
                              k.registers_per_thread, k.shared_memory] for k in recs]
                    for b, recs in run.kernels.items()},
    }


def plot_profile(profile: Profile, path: str, eps: float = 0.1) -> None:
    """PNG: latency vs SMs (one line per batch, knee marked) and throughput per SM vs SMs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, b in enumerate(profile.batches):
        row = profile.latency_ms[i]
        (line,) = ax.plot(profile.sms, row, marker=".", label=f"batch {b}")
        k = measured_knee(profile.sms, row, eps)
        ax.plot([k], [profile.latency(b, k)], marker="o", ms=9, mfc="none", color=line.get_color())
        pk = profile.predicted_knee.get(b)
        if pk:
            ax.axvline(pk, color=line.get_color(), ls=":", lw=0.8)
        tp = [b * 1000.0 / v / s for s, v in zip(profile.sms, row)]
        ax2.plot(profile.sms, tp, marker=".", color=line.get_color(), label=f"batch {b}")
    ax.set_yscale("log")
    ax.set_xlabel("SMs")
    ax.set_ylabel("latency (ms, median of graph replays)")
    ax.set_title(f"{profile.model} on {profile.gpu.name}: o = measured knee (eps={eps}), : = predicted")
    ax.legend(fontsize=7)
    ax2.set_xlabel("SMs")
    ax2.set_ylabel("requests / s / SM")
    ax2.set_title("throughput per SM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(run: ProfileRun, out_dir: str, eps: float = 0.1, png: bool = True) -> dict[str, str]:
    """Write ``<model>.json`` (``run_to_json``) and ``<model>.png`` under ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{run.profile.model}.json")}
    with open(paths["json"], "w") as f:
        json.dump(run_to_json(run, eps), f)
    if png:
        paths["png"] = os.path.join(out_dir, f"{run.profile.model}.png")
        plot_profile(run.profile, paths["png"], eps)
    return paths

