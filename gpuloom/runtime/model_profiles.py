"""Latency profiles for the models a service loads: which stored profile fits a compiled model, and a
crude one timed at load where none does.

The planner needs L(batch, SMs) for every model. A shipped or cached profile fits a compiled model
only if it timed the same graph (:func:`compiled_kind` against the profile's ``runner``); otherwise
the service measures one on the GPU (:mod:`gpuloom.profile.profiler`) or, on the CPU or when asked,
times the model crudely at its smallest and largest batch (:func:`crude_profile`).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from ..profile.store import GpuInfo, Profile
from .device import DeviceLayer
from .host_device import FakeModel
from .model_config import ModelConfig

log = logging.getLogger(__name__)


def plain_runner(runner: str) -> str:
    """A stored profile's ``runner`` as :func:`compiled_kind` spells it: the eager forward's graph
    (``"graph"``) and an unnamed one (older profiles) time the plain engine's graphs, ``"engine"``."""
    return "engine" if runner in ("", "graph") else runner


def compiled_kind(config: ModelConfig, runner: Any) -> str:
    """What a profile of ``runner`` (the model as ``config`` compiled it) would name as its runner:
    ``profiler.applied_kind`` of the config's engine options, those that changed the compiled graph.
    An option that changed nothing (``fuse_epilogues`` on a model without such epilogues or gates)
    leaves the plain engine's graph, whose stored profile then still holds."""
    from ..profile.profiler import applied_kind

    return applied_kind(runner, config.channels_last, config.fuse_convolutions, config.split_gemms,
                        config.fuse_epilogues)


def longest_batch_ms(p: Profile) -> float:
    """How long ``p``'s largest batch takes with the whole device: the longest a batch of the model
    holds the thread that runs it (``InferenceService.host_loop_on``'s limit)."""
    return p.latency(p.max_batch, p.sms[-1])


def trim_profile(p: Profile, max_batch: int) -> Profile:
    """``p`` without batch buckets above ``max_batch`` (the engine captures none beyond it)."""
    keep = [i for i, b in enumerate(p.batches) if b <= max_batch]
    if not keep:
        raise ValueError(f"profile of {p.model!r} has no batch <= max_batch={max_batch} (has {p.batches})")
    if len(keep) == len(p.batches):
        return p
    return Profile(model=p.model, input_shapes=p.input_shapes, dtype=p.dtype, gpu=p.gpu,
                   batches=tuple(p.batches[i] for i in keep), sms=p.sms,
                   latency_ms=tuple(p.latency_ms[i] for i in keep), date=p.date, source=p.source)


def crude_profile(config: ModelConfig, runner: Any, device: DeviceLayer, reps: int = 3, max_reps: int = 20,
                  budget_ms: float = 300.0) -> Profile:
    """A profile from timing the compiled model at batch 1 and ``max_batch`` on the whole device
    (linear in batch in between). On CUDA latency is assumed to scale with 1/SMs (knee = the whole GPU:
    conservative); on CPU it does not depend on SMs. Good enough to plan with; not a measurement.

    Each batch is run ``reps`` times, and again while it has taken less than ``budget_ms`` (up to
    ``max_reps``), after one warm-up; the fastest run counts. A load times this while other models
    compile or serve: on two busy cores the median of three came out 400x a tiny model's latency
    (40 ms for 0.1) and planned it as unservable; the fastest run is the one least disturbed."""
    from ..profile.synthetic import sm_grid

    gpu = GpuInfo(name=f"{device.kind} (crude)", sm_count=device.gpu_sms, sm_granularity=device.granularity)
    buckets = tuple(getattr(runner, "buckets", None) or sorted({1, config.max_batch}))  # (max batch 1: one)
    ends = sorted({buckets[0], buckets[-1]})  # the batches timed (one where they are the same)
    lat = {}
    if isinstance(runner, FakeModel):
        for b in ends:
            lat[b] = runner.latency_ms(b) if callable(runner.latency_ms) else float(runner.latency_ms)
    else:
        import torch

        for b in ends:
            xs = []
            for spec, t in zip(runner.specs, config.inputs):
                xs.append(torch.zeros((b, *spec.shape), dtype=spec.dtype, device=spec.device))
            times = []
            with torch.inference_mode():
                while len(times) < reps + 1 or (len(times) < max_reps + 1 and sum(times[1:]) < budget_ms):
                    if device.kind == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    runner(*xs)
                    if device.kind == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1000.0)
            lat[b] = max(1e-3, min(times[1:]))  # times[0] is the warm-up
    b0, b1 = buckets[0], buckets[-1]
    sms = sm_grid(gpu)
    rows = []
    for b in buckets:
        base = lat[b0] if b1 == b0 else lat[b0] + (lat[b1] - lat[b0]) * (b - b0) / (b1 - b0)
        base = max(base, 1e-3)
        if device.kind == "cuda":
            rows.append(tuple(base * gpu.sm_count / s for s in sms))
        else:
            rows.append(tuple(base for _ in sms))
    # keep the rows non-decreasing in batch (noise)
    fixed = []
    for r in rows:
        fixed.append(tuple(max(v, fixed[-1][j]) for j, v in enumerate(r)) if fixed else r)
    shapes = tuple(t.shape for t in config.inputs)
    return Profile(model=config.name, input_shapes=shapes, dtype=config.inputs[0].dtype, gpu=gpu, batches=buckets,
                   sms=sms, latency_ms=tuple(fixed), source="synthetic")


def profile_for(config: ModelConfig, runner: Any, dev: DeviceLayer, profiles: Any, *, measure: bool,
                cache_dir: Any) -> Profile:
    """The latency profile a service plans ``config``'s model with: the stored one of its name in
    ``profiles`` (a ``ProfileStore`` or None) where it timed the same graphs as ``runner``; else one
    measured on the GPU with ``measure`` (kept in ``cache_dir``, a directory or None); else a crude
    one timed at load (the CPU's whole profile)."""
    prof = None
    if profiles is not None and config.name in profiles:
        prof = profiles.get(config.name)
        shapes = tuple(t.shape for t in config.inputs)
        if prof.input_shapes != shapes:
            warnings.warn(f"the profile named {config.name!r} was measured for inputs {prof.input_shapes}, the "
                          f"model takes {shapes}: not using it", stacklevel=3)
            prof = None
        elif prof.gpu.sm_count != dev.gpu_sms:
            warnings.warn(f"profile of {config.name!r} was measured on {prof.gpu.sm_count} SMs; this device has "
                          f"{dev.gpu_sms}", stacklevel=3)
    measurable = dev.kind == "cuda" and measure and not isinstance(runner, FakeModel)
    kind = compiled_kind(config, runner)
    if prof is not None and plain_runner(prof.runner) != kind:
        # the stored profile timed other graphs than this model's options compile (the shipped ones
        # timed the plain engine's, without gpuloom's kernels): plan with a measurement of these, or
        # say that the plan is approximate
        measured = measured_profile(config, runner, dev, cache_dir) if measurable else None
        if measured is None:
            warnings.warn(f"the profile of {config.name!r} timed {prof.runner or 'unnamed'!r} graphs, the model "
                          f"compiles as {kind!r} (its config's engine options): planning with it anyway "
                          f"(`gpuloom profile` with the same options makes a matching one)", stacklevel=3)
        else:
            log.info("model %s: its stored profile timed %r graphs, the model compiles as %r: measured its own",
                     config.name, prof.runner, kind)
            prof = measured
    if prof is None and measurable:
        prof = measured_profile(config, runner, dev, cache_dir)
    if prof is None:
        if dev.kind == "cpu":  # latency does not depend on SMs here: batch 1 and max batch are the profile
            log.info("model %s: latency timed at batch 1 and %d (the CPU's whole profile)", config.name,
                     config.max_batch)
        else:
            warnings.warn(f"no latency profile for {config.name!r}: using a crude one measured at load "
                          f"(run `gpuloom profile` for a real one)", stacklevel=3)
        prof = crude_profile(config, runner, dev)
    return trim_profile(prof, config.max_batch)


def measured_profile(config: ModelConfig, runner: Any, device: DeviceLayer, cache_dir: Any) -> Profile | None:
    """Profile ``config``'s compiled model on this GPU, or take the one measured at an earlier load
    from the cache. None (and a warning) if measuring fails: the load goes on with a crude one."""
    import torch

    from ..gpu import device_facts
    from ..profile.cache import ProfileCache, fingerprint, op_name
    from ..profile.profiler import EngineRunner, ModelSpec, profile_model

    index = getattr(device, "device", 0)
    kind = compiled_kind(config, runner)
    try:
        facts = device_facts(index)
        gm = runner.graph.module
        params = [(n, tuple(t.shape), str(t.dtype)) for n, t in (*gm.named_parameters(), *gm.named_buffers())]
        fp = fingerprint(config.name, [t.shape for t in config.inputs], [t.dtype for t in config.inputs],
                         config.max_batch, kind, params, [op_name(n.target) for n in runner.graph.ops])
        cache = ProfileCache(cache_dir, facts.name, facts.sm_count) if cache_dir else None
        cached = cache.get(config.name, fp) if cache is not None else None
        if cached is not None:
            log.info("model %s: the profile measured at an earlier load (%s)", config.name, cache.path(config.name, fp))
            return cached
        spec = ModelSpec(config.name, None, tuple(t.shape for t in config.inputs),
                         tuple(getattr(torch, t.dtype) for t in config.inputs), dtype=config.inputs[0].dtype)
        log.info("model %s: no profile; measuring one on %d SM counts x %d batch sizes (once: it is cached)",
                 config.name, len(facts.grid()), len(runner.buckets))
        measured = profile_model(spec, batches=runner.buckets, runner=EngineRunner(spec, runner.buckets,
                                 compiled=runner, channels_last=config.channels_last,
                                 fuse_convolutions=config.fuse_convolutions, split_gemms=config.split_gemms,
                                 fuse_epilogues=config.fuse_epilogues),
                                 device=index, predict=False, log=log.info)
        if cache is not None:
            try:
                path = cache.put(config.name, fp, measured.profile)
                log.info("model %s: profiled in %.1f s; kept in %s", config.name, measured.seconds, path)
            except OSError as e:  # e.g. a read-only home: serve with the measurement, measure next time
                log.warning("model %s: profiled in %.1f s; not cached (%s)", config.name, measured.seconds, e)
        return measured.profile
    except Exception as e:  # noqa: BLE001 - a profile is for planning: the model still serves with a crude one
        warnings.warn(f"model {config.name!r}: measuring its profile failed ({type(e).__name__}: {e})",
                      stacklevel=4)
        return None


__all__ = ["compiled_kind", "crude_profile", "longest_batch_ms", "measured_profile", "plain_runner", "profile_for",
           "trim_profile"]
