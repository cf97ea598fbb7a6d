"""End-to-end benchmark: an open-loop load generator driving the real runtime (``gpuloom bench``).

For each policy an :class:`~gpuloom.runtime.service.InferenceService` is started and the workload's
models are loaded into it (compiled once per process, shared by every policy). A *point* replays
the workload's arrivals (:func:`gpuloom.bench.workload.arrival_times`, scaled by a load factor) for a
fixed duration, open loop: each request is submitted at its precomputed time whatever happened to
the previous ones, with real input tensors of the model's shape. A rate sweep finds the highest load
factor keeping ``target`` SLO attainment (doubling, then bisection) -- the headline number.

Measured per point (client side, so the network-less service is judged like a user would):
goodput (requests/s served within their SLO), SLO attainment (on time / submitted; rejected,
dropped, failed and late requests are misses), p50/p99 latency of served requests, Jain fairness
over per-model attainment; and from the service: SM utilization (useful SM-ms / (SMs x wall ms)),
GPU idle ratio (share of wall time with requests queued and no batch running), dispatch overhead
(host ms spent dispatching / device ms of the batches).

With ``tiny=True`` every model of the workload is a small MLP of the same name, so the whole
pipeline runs on a CPU in seconds (CI); otherwise the zoo models are built with
:func:`gpuloom.profile.profiler.load_model`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..runtime import loghist
from ..runtime.gcpause import GcMonitor
from ..runtime.threadcpu import cpu_share, thread_cpu
from .labels import policy_of
from .metrics import finite_values, jain, percentile
from .workload import Workload, arrival_times, deadlines_ms, resolve_profiles

TINY_DIM = 32
# a point counts at its load only if 99% of its requests were submitted within this many ms of their
# arrival times: on the H200 the load generator thread, sharing the runtime's interpreter, fell
# 0.9-1.9 s behind (p50) at x0.5-0.75 of mix6 (session 8), offering far less than the point said
LATE_LIMIT_MS = 20.0
ARRIVALS = ("thread", "loop")  # who submits a point's requests (run_point's ``arrivals``)


def check_arrivals(arrivals: str) -> str:
    """``arrivals`` unchanged, or ValueError unless it is one of :data:`ARRIVALS`."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be thread or loop, got {arrivals!r}")
    return arrivals


def offered_as_scheduled(arrivals: dict) -> bool:
    """Whether 99% of a point's requests were submitted within LATE_LIMIT_MS of their arrival times
    (``arrivals``: a point's record of them; True where it has none, as before the check existed)."""
    p99 = (arrivals.get("late_ms") or {}).get("p99")
    return p99 is None or p99 <= LATE_LIMIT_MS


@dataclass(frozen=True)
class ModelPoint:
    """One model at one load point (client-side counts)."""

    model: str
    submitted: int
    rejected: int  # Overloaded / not ready at submit
    served: int
    on_time: int
    dropped: int
    failed: int
    offered_rps: float
    goodput_rps: float
    slo_attainment: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int] = field(default_factory=dict)
    # where the service says its served requests' time went during the point (its histograms):
    # waiting to be dispatched vs dispatch to outputs on the host; mean and the p99's bucket bound, ms
    queue_ms: dict = field(default_factory=dict)
    compute_ms: dict = field(default_factory=dict)
    shed: int = 0  # of rejected: refused as over the plan's share of an overloaded GPU (Shed)


@dataclass(frozen=True)
class Point:
    """One policy at one load factor."""

    policy: str
    scale: float
    duration_s: float
    offered_rps: float
    goodput_rps: float
    slo_attainment: float
    p50_ms: float
    p99_ms: float
    fairness: float
    sm_utilization: float
    gpu_idle_ratio: float  # queued work, no batch running
    idle_ratio: float  # no batch running at all
    dispatch_overhead: float  # host dispatch ms / device ms
    models: tuple[ModelPoint, ...]
    layouts: list = field(default_factory=list)  # partitions at the end and their work in the point (lane_deltas)
    layout_changes: int = 0  # layouts switched to during the point (re-plans: each drains the partitions)
    layouts_built: int = 0  # of which built (captured) during the point rather than taken from the cache
    gc: dict = field(default_factory=dict)  # garbage-collector pauses during the point: per generation, total, longest ms
    loop_lag: dict = field(default_factory=dict)  # posts the runtime's loop took > 1/5/20 ms late, and the longest
    sim: dict = field(default_factory=dict)  # the same arrivals through the simulator (simulate_point)
    profile_check: list = field(default_factory=list)  # measured vs profiled ms per (model, SMs, batch)
    host: dict = field(default_factory=dict)  # the launching thread: batches/s, busy ms/s, ms per launch phase
    arrivals: dict = field(default_factory=dict)  # who submitted (run_point's ``arrivals``) and how late, ms
    plan: dict = field(default_factory=dict)  # the policy's summary at the end (dstack: partitions, batches, slowdowns)

    def ok(self, target: float) -> bool:
        """Met ``target`` at the load it claims: a point whose requests went out behind their arrival
        times (the load generator could not keep up) offered less load than its scale says."""
        return self.slo_attainment >= target and self.offered_as_scheduled

    @property
    def offered_as_scheduled(self) -> bool:
        """Whether 99% of requests were submitted within LATE_LIMIT_MS of their arrival times."""
        return offered_as_scheduled(self.arrivals)


def tiny_module(name: str, dim: int = TINY_DIM) -> Any:
    """A small MLP standing in for ``name`` (deterministic weights per name)."""
    import torch

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m.eval()


def resolve_device_and_profiles(workload: Workload, *, device: str | None, profiles_dir: str | None,
                                tiny: bool) -> tuple[str, Any, list[str]]:
    """``(device, profiles, warnings)`` for a benchmark of ``workload``: the device asked for (default
    cuda when available), the profiles in ``profiles_dir`` or, on CUDA with real models, the shipped
    ones for the workload's GPU (``None``: the service's default). ValueError when cuda is asked for
    without CUDA, for a CUDA device this machine lacks, or for a profile directory that does not exist
    or holds no profiles (as ``gpuloom plan`` and ``simulate`` refuse it)."""
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if dev.startswith("cuda:") and not (dev[5:].isdigit() and int(dev[5:]) < torch.cuda.device_count()):
        raise ValueError(f"--device {dev}: expected cuda:N with N from 0 to {torch.cuda.device_count() - 1} "
                         f"(this machine's CUDA devices)")
    if profiles_dir:
        return dev, resolve_profiles(workload, profiles_dir=profiles_dir)[0], []
    if dev.startswith("cuda") and not tiny:
        profiles, warns = resolve_profiles(workload)
        return dev, profiles, list(warns)
    return dev, None, []


def build_models(workload: Workload, *, tiny: bool, device: str, max_batch: int = 32,
                 progress: Callable[[str], None] | None = None,
                 engine_options: dict | None = None) -> dict[str, tuple[Any, Any]]:
    """``{name: (ModelConfig, CompiledModel)}`` for the workload's models, compiled once.
    ``engine_options``: ``ModelConfig``'s engine keys for every model (``gpuloom bench --engine``);
    a model they change nothing in keeps the default's graph and its stored profile, one they
    change is profiled at its load (``service.compiled_kind``)."""
    import torch

    import gpuloom
    from gpuloom.runtime.service import ModelConfig, TensorSpec

    say = progress or (lambda s: None)
    out = {}
    dev = torch.device(device)
    for spec in workload.models:
        if tiny:
            module, shapes, dtypes = tiny_module(spec.name), ((TINY_DIM,),), (torch.float32,)
        else:
            from gpuloom.profile.profiler import load_model

            ms = load_model(spec.name, device=dev)
            module, shapes, dtypes = ms.module, ms.input_shapes, ms.input_dtypes
        say(f"compiling {spec.name}")
        module = module.eval().to(dev)
        ex = tuple(torch.randn((1, *s)).to(dt).to(dev) for s, dt in zip(shapes, dtypes))
        cfg = ModelConfig(spec.name, tuple(TensorSpec(f"input{i}", tuple(s), str(dt).removeprefix("torch."))
                                           for i, (s, dt) in enumerate(zip(shapes, dtypes))),
                          max_batch=max_batch, slo_ms=float(spec.slo_ms), weight=float(spec.weight),
                          rate_hint=float(workload.mean_rate(spec)), **(engine_options or {}))
        # as the service compiles a model by default (its layout, fusion and GEMMs): the shipped
        # profiles the plans come from were measured so, and the service refuses anything else
        cm = gpuloom.compile(module, ex, max_batch=max_batch, device=dev, input_names=[t.name for t in cfg.inputs],
                             **cfg.compile_options(dev.type))
        out[spec.name] = (cfg, cm)
    return out


# the device layer's counters a point reports: how its batches ran, as the point's increase, and
# the layout's build history, as totals at its end
BATCH_COUNTERS = ("eager_batches", "inplace_batches", "torch_launch_plans", "views_refused", "views_torch_copies")
BUILD_COUNTERS = ("heuristic_captures", "skipped_captures", "recarved_layouts", "slow_carvings", "short_carvings")
DEVICE_COUNTERS = BATCH_COUNTERS + BUILD_COUNTERS


def service_snapshot(svc) -> dict:
    """The service's counters and histograms now; two of them bracket a measurement (see hist_delta)."""
    st = svc.stats()
    be = st["backend"]
    return {"t": time.monotonic(), "busy_sm_ms": be.get("busy_sm_ms", 0.0), "device_ms": be.get("device_ms", 0.0),
            "host_ms": be.get("host_dispatch_ms", 0.0), **{f"rt_{k}": v for k, v in st["runtime"].items()},
            "partitions": st["partitions"], "gpu_sms": svc.device.gpu_sms,
            "layout_swaps": st.get("layout_swaps", 0), "layouts_built": be.get("layouts_built", 0),
            "launch_ms": dict(be.get("launch_ms", {})), "batches": sum(be.get("model_batches", {}).values()),
            "raw_launch": bool(be.get("raw_launch", False)), "copy_ms": dict(be.get("copy_ms", {})),
            "copy_ms_by_model": {m: dict(v) for m, v in be.get("copy_ms_by_model", {}).items()},
            "wake_split": dict(be.get("wake_split", {})), "workqueues": be.get("workqueues", ""),
            "outputs": be.get("outputs", ""),
            "complete_on": be.get("complete_on", "watcher"), "loop_completions": be.get("loop_completions", 0),
            "threads": thread_cpu(),
            "counters": {k: be.get(k, 0) for k in DEVICE_COUNTERS},
            "carving_checks": be.get("carving_checks", []),
            "hist": {(m, k): v[k] for m, v in st["models"].items() for k in ("queue_ms", "compute_ms") if k in v},
            "exec_ms": {(e["model"], e["sms"], e["batch"]): e for e in be.get("exec_ms", [])}}


def hist_delta(before: dict, after: dict, model: str, key: str) -> dict:
    """Mean and p99 (upper bound of its bucket) of a service histogram over the point, ms."""
    from gpuloom.runtime.books import Histogram

    a = after["hist"].get((model, key))
    if not a:
        return {}
    h = Histogram.delta(a, before["hist"].get((model, key)))
    if h.n <= 0:
        return {}
    return {"mean": h.sum / h.n, "p99_bucket": h.quantile(0.99), "n": h.n}


def profile_check(svc, before: dict, after: dict) -> list[dict]:
    """Measured device ms per batch during a point against the plan's profile, per (model, SMs,
    batch): where a ratio is far from 1, the plan was made for a GPU that is not the one serving.
    With the median and p99 of the batches' device times (``p50_ms``, ``p99_ms``: upper bounds of
    5%-wide buckets), where the backend kept their distribution, and ``hold_ms``: how long such a
    batch held its lane beyond its device time, on average (a model's own turnaround)."""
    out = []
    for key, e1 in sorted(after["exec_ms"].items()):
        e0 = before["exec_ms"].get(key, {})
        n = e1["batches"] - e0.get("batches", 0)
        if n <= 0:
            continue
        model, sms, b = key
        mean = (e1["device_ms_sum"] - e0.get("device_ms_sum", 0.0)) / n
        row = {"model": model, "sms": sms, "batch": b, "batches": n, "measured_ms": round(mean, 4)}
        if "hold_ms_sum" in e1:
            row["hold_ms"] = round((e1["hold_ms_sum"] - e0.get("hold_ms_sum", 0.0)) / n, 4)
        counts = loghist.delta(e1.get("device_ms_hist", {}), e0.get("device_ms_hist"))
        if counts:
            row["p50_ms"], row["p99_ms"] = loghist.tails(counts)
        try:
            prof = svc.profile(model)
            pred = prof.latency(prof.bucket(min(b, prof.max_batch)), sms)
            row["profile_ms"] = round(pred, 4)
            row["ratio"] = round(mean / pred, 3) if pred > 0 else None
        except Exception:  # noqa: BLE001 - no profile (tiny models): the measurement stands alone
            pass
        out.append(row)
    return out


#: the load generator's inputs lie in page-locked memory and launch in place, as the server's worker
#: arenas do; copying 600 KB per request on the generator's thread made it fall seconds behind on the
#: H200 (docs/reports/runtime.md, ninth session) and measured the client instead of the runtime.
#: run_point once defaulted to copies while gpuloom bench used this: gpu_runtime_check.py's figures
#: before the forty-eighth session were taken with copies
DEFAULT_PINNED_INPUTS = True


def run_point(svc, workload: Workload, policy: str, *, scale: float, duration_s: float, seed_inputs: int = 4,
              drain_s: float | None = None, pinned_inputs: bool = DEFAULT_PINNED_INPUTS,
              arrivals: str = "thread") -> Point:
    """Replay ``workload`` x ``scale`` for ``duration_s`` against the running service ``svc``.

    ``pinned_inputs``: the requests' inputs lie in memory the device reads in place
    (``svc.device.pinned_empty``), as a front-end worker's page-locked arena does for the server,
    so the service launches them without copying them first; else plain arrays, copied at submit.

    ``arrivals``: who submits the requests. ``"thread"``: this (the calling) thread, sleeping until
    each arrival time, as a client thread in the runtime's process would. ``"loop"``: the runtime's
    own loop thread, at each arrival time (``svc.call_on_loop_at``), so no second Python thread
    competes with the runtime's for the interpreter: what the runtime sustains when its clients live
    in other processes. Either way a request's latency counts from when it was submitted; how late
    that was after its arrival time is reported (``Point.arrivals["late_ms"]``)."""
    check_arrivals(arrivals)
    wl = dataclasses.replace(workload.scaled(scale), duration_s=duration_s)
    times = arrival_times(wl)
    # each request's deadline, ms after it is sent: the SLO, or a drawn multiple of it for a model with
    # deadline_factors (sent as the request's own deadline, as a client's timeout would be)
    due = deadlines_ms(wl, times)
    own_deadline = {m.name for m in wl.models if m.deadline_factors}
    cfgs = {c.name: c for c in svc.models()}
    rng = np.random.default_rng(0)

    def tensor(shape: tuple[int, ...], dtype: str) -> np.ndarray:
        a = _random(rng, shape, dtype)
        if pinned_inputs:
            pinned = svc.device.pinned_empty(shape, dtype)
            pinned[...] = a
            return pinned
        return a

    pools = {}
    for m in times:
        c = cfgs[m]
        pools[m] = [{t.name: tensor((1, *t.shape), t.dtype) for t in c.inputs} for _ in range(seed_inputs)]
    events = sorted((t, m, d) for m, ts in times.items() for t, d in zip(ts, due[m]))
    lock = threading.Lock()
    lat: dict[str, list[tuple[bool, float, str, float]]] = {m: [] for m in times}  # (ok, ms, error kind, deadline ms)
    rejected = {m: 0 for m in times}
    shed = {m: 0 for m in times}  # of rejected: over the plan's share (Shed)
    before = service_snapshot(svc)
    t0 = time.monotonic()

    def record(m: str, sent: float, deadline: float):
        def cb(f):
            ms = (time.monotonic() - sent) * 1000.0
            e = f.exception()
            with lock:
                lat[m].append((e is None, ms, "" if e is None else type(e).__name__, deadline))
                pending.discard(f)  # its outputs go as soon as they are counted, as a client's would
        return cb

    # the futures not yet answered: a point keeps no answered request's outputs (thousands of batches
    # of up to 6 MB held to the end of a point would grow the process, and with outputs="views" pin it)
    pending: set = set()
    late_ms: list[float] = []  # per request: submitted this long after its arrival time
    from gpuloom.runtime.service import ServiceError, Shed

    def send(i: int, t: float, m: str, d: float) -> None:
        sent = time.monotonic()
        late_ms.append((sent - t0 - t) * 1000.0)
        try:
            f = svc.submit(m, pools[m][i % seed_inputs], deadline_ms=d if m in own_deadline else None)
        except ServiceError as e:
            rejected[m] += 1
            shed[m] += isinstance(e, Shed)
            return
        with lock:
            pending.add(f)
        f.add_done_callback(record(m, sent, d))

    if arrivals == "thread":
        for i, (t, m, d) in enumerate(events):
            delay = t0 + t - time.monotonic()
            if delay > 0.0005:
                time.sleep(delay)
            send(i, t, m, d)
    elif events:
        next_i = [0]
        all_sent = threading.Event()

        def inject() -> None:  # on the runtime's loop thread: the arrivals due by now (at most 16), then the next
            i = next_i[0]
            now = time.monotonic()
            stop = min(len(events), i + 16)  # a client that is behind leaves the loop to the runtime between bursts
            while i < stop and t0 + events[i][0] <= now + 0.0005:  # as early as the thread's (no sleep under 0.5 ms)
                send(i, *events[i])
                i += 1
            next_i[0] = i
            if i < len(events):
                svc.call_on_loop_at(t0 + events[i][0], inject)
            else:
                all_sent.set()

        svc.call_on_loop_at(t0 + events[0][0], inject)
        if not all_sent.wait(duration_s + 30.0):
            raise RuntimeError(f"the runtime's loop submitted {next_i[0]} of {len(events)} requests in "
                               f"{duration_s + 30:.0f} s (arrivals=loop)")
    wait_s = drain_s if drain_s is not None else 2.0 + max(c.slo_ms for c in cfgs.values()) / 1000.0 * 4
    end = time.monotonic() + wait_s
    with lock:
        waiting = list(pending)
    for f in waiting:
        try:
            f.exception(timeout=max(0.0, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - still pending: counted as a miss below
            pass
    after = service_snapshot(svc)
    models = []
    all_ok_ms = []
    for m, rows in lat.items():
        slo = cfgs[m].slo_ms
        with lock:
            rows = list(rows)
        served = [ms for ok, ms, _, _ in rows if ok]
        # within the request's own deadline, or the model's SLO as the service has it
        on_time = sum(1 for ok, ms, _, d in rows if ok and ms <= (d if m in own_deadline else slo))
        errors: dict[str, int] = {}
        for ok, _, kind, _ in rows:
            if not ok:
                errors[kind] = errors.get(kind, 0) + 1
        submitted = len(times[m])
        served.sort()
        all_ok_ms.extend(served)
        models.append(ModelPoint(
            model=m, submitted=submitted, rejected=rejected[m], shed=shed[m], served=len(served), on_time=on_time,
            dropped=sum(v for k, v in errors.items() if k in ("Dropped", "DeadlineExceeded")),
            failed=errors.get("ModelFailed", 0), offered_rps=submitted / duration_s,
            goodput_rps=on_time / duration_s, slo_attainment=on_time / submitted if submitted else 1.0,
            p50_ms=percentile(served, 50) if served else float("nan"),
            p99_ms=percentile(served, 99) if served else float("nan"), errors=errors,
            queue_ms=hist_delta(before, after, m, "queue_ms"), compute_ms=hist_delta(before, after, m, "compute_ms")))
    all_ok_ms.sort()
    wall_ms = max(1e-9, (after["t"] - before["t"]) * 1000.0)
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], float) and k != "t"}
    total_sub = sum(mp.submitted for mp in models)
    on_time = sum(mp.on_time for mp in models)
    rt_total = max(1e-9, d.get("rt_total_ms", 0.0))
    return Point(
        policy=policy, scale=scale, duration_s=duration_s, offered_rps=total_sub / duration_s,
        goodput_rps=on_time / duration_s, slo_attainment=on_time / total_sub if total_sub else 1.0,
        p50_ms=percentile(all_ok_ms, 50) if all_ok_ms else float("nan"),
        p99_ms=percentile(all_ok_ms, 99) if all_ok_ms else float("nan"),
        fairness=jain([mp.slo_attainment for mp in models]),
        sm_utilization=min(1.0, d.get("busy_sm_ms", 0.0) / (after["gpu_sms"] * wall_ms)),
        gpu_idle_ratio=d.get("rt_idle_queued_ms", 0.0) / rt_total,
        idle_ratio=d.get("rt_idle_ms", 0.0) / rt_total,
        dispatch_overhead=d.get("host_ms", 0.0) / d["device_ms"] if d.get("device_ms", 0.0) > 0 else 0.0,
        models=tuple(models),
        layouts=lane_deltas(before["partitions"], after["partitions"]),
        profile_check=profile_check(svc, before, after),
        host=host_split(before, after, wall_ms),
        gc=GcMonitor.installed().since(before["t"]),
        loop_lag=svc.loop_lag(before["t"]),
        layout_changes=after["layout_swaps"] - before["layout_swaps"],
        layouts_built=after["layouts_built"] - before["layouts_built"],
        arrivals={"by": arrivals, "late_ms": _late_summary(late_ms)},
        plan=svc.policy_summary(),
    )


def _late_summary(late_ms: list[float]) -> dict:
    """p50 / p99 / max of how late requests were submitted after their arrival times (ms), and the
    median of each tenth of the requests in arrival order (``by_tenth``): a stall at the start that
    the client then catches up on reads differently from a client that keeps falling behind."""
    xs = sorted(late_ms)
    if not xs:
        return {}
    n = len(late_ms)
    tenths = [sorted(late_ms[k * n // 10:(k + 1) * n // 10]) for k in range(10)]
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": xs[-1],
            "by_tenth": [percentile(t, 50) if t else None for t in tenths]}


def lane_deltas(before: list[dict], after: list[dict]) -> list[dict]:
    """Each partition at the end of a point, with what it did during the point (counted since the
    layout started when the point changed layouts): batches, ms busy (a batch launched until its
    completion reached the runtime; one launched ahead counts from when the previous one was done),
    ms on the device, and ``gap_ms`` per batch = (busy - device) / batches.

    Split by launch-ahead: ``ahead`` batches were launched while the previous one ran, so on a GPU
    the partition did not idle before them and their ``gap_ahead_ms`` is only the completion's way
    back; ``gap_idle_ms`` is the gap of the others: the launch, the completion's way back and the
    loop's turnaround, during which an exclusive partition idles.

    ``hold_p50_ms`` / ``hold_p99_ms``: the median and p99 of the batches' holds (busy - device, each
    batch), where the backend kept their distribution: the tail the mean ``gap_ms`` hides.

    ``turnarounds`` / ``turnaround_p50_ms`` / ``turnaround_p99_ms``: the batches that found the lane
    free with their oldest request already waiting when its previous batch reached the host, and the
    median and p99 of the ms from then to their submit (the loop's turnaround, which the holds do not
    include: they start at the submit).

    ``submit_lag_p50_ms`` / ``submit_lag_p99_ms``: of every batch, the ms from the loop's clock at its
    decision to its submit (the decision's own work before the launch, part of the turnaround)."""
    def per(num: float, n: int) -> float | None:
        return num / n if n > 0 else None

    # a partition of a layout set up during the point counts from zero again (its serial differs)
    prior = {(p["index"], p["label"], p.get("layout_serial")): p for p in before}
    out = []
    for p in after:
        b = prior.get((p["index"], p["label"], p.get("layout_serial")), {})
        d = {k: p.get(k, 0) - b.get(k, 0) for k in ("batches", "busy_ms", "device_ms", "ahead", "ahead_busy_ms",
                                                    "ahead_device_ms")}
        n, busy, dev, na = d["batches"], d["busy_ms"], d["device_ms"], d["ahead"]
        out.append({"label": p["label"], "sms": p["sms"], "shared": p["shared"], "busy_ratio": p["busy_ratio"],
                    "batches": n, "busy_ms": busy, "device_ms": dev, "gap_ms": per(busy - dev, n), "ahead": na,
                    "gap_ahead_ms": per(d["ahead_busy_ms"] - d["ahead_device_ms"], na),
                    "gap_idle_ms": per((busy - d["ahead_busy_ms"]) - (dev - d["ahead_device_ms"]), n - na)})
        for name in ("hold", "turnaround", "submit_lag"):  # each kept histogram's tails over the point
            counts = loghist.delta(p.get(f"{name}_hist", {}), b.get(f"{name}_hist"))
            if counts:
                out[-1][f"{name}_p50_ms"], out[-1][f"{name}_p99_ms"] = loghist.tails(counts)
                if name == "turnaround":
                    out[-1]["turnarounds"] = sum(counts.values())
    return out


def _increase_per(a: dict, b: dict, count: str) -> dict | None:
    """Each sum's increase from ``b`` to ``a``, divided by that of ``a[count]``; None if it did not grow."""
    n = a.get(count, 0) - b.get(count, 0)
    return {k: (a[k] - b.get(k, 0.0)) / n for k in a if k != count} if n > 0 else None


def _us_per(a: dict, b: dict, total_ms: str, count: str) -> tuple[float, float] | None:
    """The increase from ``b`` to ``a`` of the sum ``total_ms`` per unit of ``count``'s, in us, and
    ``count``'s increase; None if it did not grow."""
    n = a.get(count, 0.0) - b.get(count, 0.0)
    return (round((a.get(total_ms, 0.0) - b.get(total_ms, 0.0)) / n * 1000.0, 2), n) if n > 0 else None


def _copies_per_batch(got: dict) -> dict:
    """``copy_ms`` per batch, with launch-graph batches (whose input copies are not timed) out of the
    input copies' mean: ``h2d`` per timed batch, and the untimed batches' share as ``h2d_untimed_share``."""
    untimed = got.pop("h2d_untimed", 0.0)
    if untimed:
        got["h2d"] = got.get("h2d", 0.0) / (1.0 - untimed) if untimed < 1.0 else 0.0
        got["h2d_untimed_share"] = untimed
    return got


def host_split(before: dict, after: dict, wall_ms: float) -> dict:
    """Where the runtime thread's launch time went during a point: batches started per second, ms
    of that thread per second spent launching (1000 = saturated), and ms per launch by phase (CUDA:
    inputs, replay, outputs; ``launch_ms`` of the backend stats), and per batch the device ms of its
    input and output copies and the watcher's host ms copying outputs (CUDA: ``copy_ms``), the parts
    of a lane's gap that are not the launch; and the device layer's counters (``DEVICE_COUNTERS``)."""
    def per_count(key: str, count: str) -> dict | None:
        """The point's increase of each sum in ``after[key]``, divided by that of its ``count``."""
        return _increase_per(after.get(key, {}), before.get(key, {}), count)

    out = {"batches_per_s": (after.get("batches", 0) - before.get("batches", 0)) / wall_ms * 1000.0,
           "launch_ms_per_s": (after["host_ms"] - before["host_ms"]) / wall_ms * 1000.0}
    launch = per_count("launch_ms", "launches")  # graph launches (CUDA layer only)
    if launch is not None:
        out["ms_per_launch"] = launch
        out["raw_launch"] = bool(after.get("raw_launch", False))  # driver calls (gpu/launch.py), not torch
        out["workqueues"] = after.get("workqueues", "")  # the partitions' hardware queues: shared or balanced
        out["outputs"] = after.get("outputs", "")  # a batch's outputs copied off its pinned buffers, or views
    copies = per_count("copy_ms", "batches")  # device ms of the input/output copies, watcher host ms, wake-up
    if copies is not None:
        out["copy_ms_per_batch"] = _copies_per_batch(copies)
        by_model = {}  # the same per model: where each model's hold beyond its device time goes
        for m, a in after.get("copy_ms_by_model", {}).items():
            got = _increase_per(a, before.get("copy_ms_by_model", {}).get(m, {}), "batches")
            if got is not None:
                by_model[m] = {k: round(v, 4) for k, v in _copies_per_batch(got).items()}
        if by_model:
            out["copy_ms_per_batch_by_model"] = by_model
    # the wake-up's two halves per batch (CUDA, lanes with a clock anchor): "start", from the launch's
    # first call to the GPU starting the batch; "back", from the GPU finishing it to the host running
    split = per_count("wake_split", "batches")
    if split is not None:
        out["wake_split_ms_per_batch"] = split
    if "threads" in before and "threads" in after:  # CPU s per s of each thread role (1 = a core)
        out["thread_cpu"] = cpu_share(before["threads"], after["threads"], wall_ms / 1000.0)
    a, b = after.get("counters", {}), before.get("counters", {})
    if any(a.values()):  # CUDA: batches run without a graph, launched in place, through torch; build history
        out["device_counters"] = {k: a[k] - b.get(k, 0) if k in BATCH_COUNTERS else a[k] for k in a}
    if after.get("carving_checks"):  # CUDA: the carvings timed alone (the latest, from the first build on)
        out["carving_checks"] = after["carving_checks"]
    if after.get("rt_answer_yields"):  # GPULOOM_YIELD_ANSWERS: the answers stopped for a finished batch
        out["answer_yields"] = int(after["rt_answer_yields"] - before.get("rt_answer_yields", 0.0))
    # the loop's wall time per request handed back (served or dropped) and per request taken in: a
    # request's own host work, what the simulator's host_drop_ms charges a drop (fitted per host until now)
    answers = _us_per(after, before, "rt_answer_ms", "rt_answered")
    if answers is not None:
        out["answer_us_per_request"], answered = answers
        out["answered_per_s"] = round(answered / wall_ms * 1000.0, 1)
    intake = _us_per(after, before, "rt_intake_ms", "rt_taken_in")
    if intake is not None:
        out["intake_us_per_request"] = intake[0]
    out["complete_on"] = after.get("complete_on", "watcher")
    if out["complete_on"] == "loop":  # batches the GPU woke the runtime's thread for (the rest: watchers)
        out["loop_completions"] = after.get("loop_completions", 0) - before.get("loop_completions", 0)
    return out


def simulate_point(svc, workload: Workload, policy: str, *, scale: float, duration_s: float,
                   contention: Any = None, options: dict | None = None, plan: dict | None = None) -> dict:
    """The same point through the simulated backend, with the profiles the service planned with and
    the variant's policy ``options`` (``dstack:queues=arrival`` simulates arrival order) and the
    service's queue limit: what issue 5's simulator validation compares (goodput and p99 error per
    policy). ``plan``: the point's (``Point.plan``), whose hold a dstack told none planned with."""
    from ..policy.dstack import DEFAULT_HOLD_MS
    from .experiment import simulate

    wl = dataclasses.replace(workload.scaled(scale), duration_s=duration_s)
    profs = {c.name: svc.profile(c.name) for c in svc.models()}
    if policy == "dstack" and "batch_overhead_ms" not in (options or {}):
        # the run planned a real device's hold (its plan says which); in simulation dstack would plan
        # the simulated device's
        hold = (plan or {}).get("batch_overhead_ms")
        options = {**(options or {}), "batch_overhead_ms": float(hold) if hold is not None else DEFAULT_HOLD_MS}
    run = simulate(wl, profs, policy, contention=contention, options=options, queue_limit=svc.queue_limit)
    m = run.metrics
    return {"goodput_rps": m.goodput_rps, "slo_attainment": m.slo_attainment, "p50_ms": m.p50_ms,
            "p99_ms": m.p99_ms, "sm_utilization": m.sm_utilization, "fairness": m.fairness}


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


SLOW_RATIO = 2.0  # a bucket whose measured device time is this many times its profile gets a line in the output
#: a lane whose batches' p99 submit lag (decision's clock to submit) reaches this gets a line in the output:
#: a policy that plans from the decision's clock (nexus's early drop) is late by that much. (Launching
#: the batches decided before it costs a lane 0.03-0.06 ms each on a GPU: dstack's partitions, decided
#: together, stay under it.)
SUBMIT_LAG_SAY_MS = 0.5
IN_PROGRESS = "in progress: the run ended before this policy's last point"  # PolicyResult.error while measuring


@dataclass
class PolicyResult:
    policy: str
    points: list[Point]
    max_scale: float  # highest load factor with attainment >= target (0 if none)
    max_load_rps: float  # that factor x the workload's total rate
    error: str = ""
    # where the policy's wall time went, s: "setup" (service start, models loaded, first layout
    # captured, first requests), "replan" (retunes before points: re-planning and capturing new layouts),
    # "warmup", "points" (measured load and its drain). On the H200 the GPU sat idle most of a device
    # call (run 61: loaded in 111 of 541 s): this says how much of that was captures.
    seconds: dict = field(default_factory=dict)
    # model -> the profile (``Profile.to_json``) the policy planned and simulated with: the shipped one,
    # or one measured at load (gpuloom's kernels make mobilenet_v2 and efficientnet_b0 other models than
    # the shipped profiles timed), so a report can be simulated again as it ran (fiftieth session)
    profiles: dict = field(default_factory=dict)
    # a point above max_scale missed the target; False: none was measured, so max_scale is a lower
    # bound (a sweep whose steps ran out while doubling, or loads given with --scale that all held)
    max_scale_bounded: bool = True


def rounded(seconds: dict) -> dict:
    return {k: round(v, 1) for k, v in seconds.items()}


def sweep_search(held: Callable[[float], bool], *, steps: int, max_scale: float = 64.0) -> None:
    """A rate sweep's search: ``held(s)`` measures load factor ``s`` and says whether it kept the target.
    Doubles from x1 until a miss (``steps`` points at most, none past ``max_scale``), then bisects
    ``steps`` times between the last hit and the miss (between 0 and x1 where x1 missed). Which load
    is the highest held is :func:`highest_held`'s to say, from every point measured."""
    if steps < 1:
        raise ValueError(f"a sweep needs steps >= 1, got {steps!r}")
    lo, hi, s = 0.0, None, 1.0
    for _ in range(steps):  # double until a miss
        if not held(s):
            hi = s
            break
        lo = s
        if s >= max_scale:
            break
        s *= 2
    for _ in range(steps if hi is not None else 0):  # bisect between the last hit (or 0) and the miss
        mid = (lo + hi) / 2
        if held(mid):
            lo = mid
        else:
            hi = mid


def highest_held(verdicts: Sequence[tuple[float, bool]]) -> tuple[float, bool]:
    """``(max_scale, bounded)`` from ``(load factor, held the target)`` of every point measured: the
    highest load factor that held (0.0 where none did), and whether a point above it missed (False:
    nothing measured bounds it, so it is a lower bound).

    >>> highest_held([(3.0, True), (1.0, True), (2.0, True)])  # --scale 3 and a sweep's x1, x2
    (3.0, False)
    >>> highest_held([(1.0, True), (2.0, False), (1.5, True)])
    (1.5, True)
    """
    best = max((s for s, ok in verdicts if ok), default=0.0)
    return best, any(not ok and s > best for s, ok in verdicts)


def bench_policy(workload: Workload, policy: str, models: dict[str, tuple[Any, Any]], *, device: str,
                 profiles: Any = None, duration_s: float = 5.0, scales: Sequence[float] | None = None,
                 sweep: bool = False, target: float = 0.99, steps: int = 5, max_scale: float = 64.0,
                 policy_options: dict | None = None, queue_limit: int = 1024, simulate: bool = True,
                 retune: bool = True, progress: Callable[[str], None] | None = None,
                 service_options: dict | None = None, label: str | None = None,
                 on_point: Callable[[PolicyResult], None] | None = None, warmup_s: float = 0.0,
                 device_layer: Any = None, contention: Any = None) -> PolicyResult:
    """Serve ``workload`` under ``policy``: the given ``scales``, and/or a rate sweep.

    ``device_layer``: serve on this layer (left open) instead of one made for the policy, so that
    layouts it captured for an earlier policy are served again without capturing them anew.

    ``contention``: the simulated GPU's :class:`~gpuloom.runtime.sim.ContentionModel` each point is
    also run through (``simulate``; default the plain knee model).

    ``on_point``: called after every point with the result so far (``error`` says it is in
    progress), so a caller can save it: a run killed mid-policy keeps every point it measured.

    ``service_options``: keyword options of the :class:`InferenceService` (``lookahead_ms``,
    ``tune_gc``). ``label``: the result's name (default ``policy``), so that one run can hold
    variants of a policy side by side.

    ``retune``: before each point, tell the service the point's offered rates and wait for its new
    layout (the same information for every policy; the time to re-plan and capture is not part of
    the point). Without it, a policy starts each point planned for the previous point's rates.

    ``warmup_s``: first serve the first point's load this long, unmeasured. On the H200 whichever
    policy ran first in a bench process lost to the same policy run later: light3 x8, triton 0.841
    first against 0.905-0.922 second, dstack 0.649 first against 0.878 second (runs 49, 51, 52)."""
    from gpuloom.runtime.service import InferenceService

    say = progress or (lambda s: None)
    service_options = dict(service_options or {})
    # the load generator's, not the service's (DEFAULT_PINNED_INPUTS says why in place)
    pinned_inputs = bool(service_options.pop("pinned_inputs", DEFAULT_PINNED_INPUTS))
    arrivals = str(service_options.pop("arrivals", "thread"))  # likewise
    svc = InferenceService(policy=policy, device=device, profiles=profiles, policy_options=policy_options,
                           queue_limit=queue_limit, device_layer=device_layer, **service_options)
    name = label or policy
    points: list[Point] = []
    seconds = {"setup": 0.0, "replan": 0.0, "warmup": 0.0, "points": 0.0}
    planned: dict = {}
    clock = time.monotonic

    def result(error: str = "") -> PolicyResult:
        """The points so far, with the highest load factor among them that held the target."""
        best, bounded = highest_held([(p.scale, p.ok(target)) for p in points])
        return PolicyResult(name, list(points), best, best * workload.total_rate(), error=error,
                            seconds=rounded(seconds), profiles=planned, max_scale_bounded=bounded)

    def retune_to(s: float) -> None:
        """Plan for the offered rates at load ``s`` (the same information for every policy), timed."""
        if retune:
            t = clock()
            svc.retune({m.name: workload.mean_rate(m) * s for m in workload.models})
            seconds["replan"] += clock() - t

    try:
        t_setup = clock()
        svc.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # crude profiles for tiny models
            svc.load_many(list(models.values()))  # one plan, one layout build
        planned = {cfg.name: svc.profile(cfg.name).to_json() for cfg, _ in models.values()}
        for cfg, _ in models.values():  # warm the path once
            try:
                svc.submit(cfg.name, {t.name: np.zeros((1, *t.shape), t.dtype) for t in cfg.inputs},
                           deadline_ms=60_000).result(60)
            except Exception as e:  # noqa: BLE001
                say(f"{name}: warm-up of {cfg.name} failed: {e}")
        seconds["setup"] = clock() - t_setup

        def measure(s: float) -> Point:
            retune_to(s)  # every policy plans for the offered rates of this point, not the last point's
            t = clock()
            p = run_point(svc, workload, name, scale=s, duration_s=duration_s, pinned_inputs=pinned_inputs,
                          arrivals=arrivals)
            seconds["points"] += clock() - t
            if simulate:
                try:
                    sim = simulate_point(svc, workload, policy, scale=s, duration_s=duration_s,
                                         options=policy_options, contention=contention, plan=p.plan)
                    g = p.goodput_rps
                    sim["goodput_error"] = (sim["goodput_rps"] - g) / g if g else None
                    p = dataclasses.replace(p, sim=sim)
                except Exception as e:  # noqa: BLE001 - the measurement stands without it
                    p = dataclasses.replace(p, sim={"error": f"{type(e).__name__}: {e}"})
            say(f"{name}: x{s:.3g} offered {p.offered_rps:.0f}/s goodput {p.goodput_rps:.0f}/s "
                f"attainment {p.slo_attainment:.3f} p99 {p.p99_ms:.1f} ms")
            split = (p.host or {}).get("wake_split_ms_per_batch")
            if split:  # CUDA: where a batch's wake-up went (a queue on the GPU side, or the host's GIL)
                say(f"{name}: x{s:.3g} wake-up per batch: GPU start {split['start']:.2f} ms, way back "
                    f"{split['back']:.2f} ms")
            by_model = (p.host or {}).get("copy_ms_per_batch_by_model")
            if by_model:  # CUDA: the models whose batches spend longest outside their graph, and on what
                worst = sorted(by_model.items(), key=lambda kv: -sum(kv[1].get(k, 0.0) for k in
                                                                     ("h2d", "d2h", "host_out", "wake")))[:3]
                say(f"{name}: x{s:.3g} outside the graph per batch (copy in / out on the GPU, outputs off "
                    f"the pinned buffers, wake-up), ms: " + "; ".join(
                        f"{m} {c.get('h2d', 0):.2f} / {c.get('d2h', 0):.2f} / {c.get('host_out', 0):.2f} / "
                        f"{c.get('wake', 0):.2f}" for m, c in worst))
            held = [q for q in p.layouts or () if q.get("hold_p99_ms") is not None and not q.get("shared")]
            if held:  # exclusive partitions: the tail of a batch's hold beyond its device time
                worst = max(held, key=lambda q: q["hold_p99_ms"])
                say(f"{name}: x{s:.3g} hold beyond device time per batch, p99: worst {worst['label']} "
                    f"{worst['hold_p99_ms']:.2f} ms (p50 {worst['hold_p50_ms']:.2f}); partitions "
                    + ", ".join(f"{q['hold_p99_ms']:.2f}" for q in held))
            turned = [q for q in p.layouts or () if q.get("turnarounds")]
            if turned:  # the lanes' idle time with work waiting, which the holds above do not include
                say(f"{name}: x{s:.3g} lanes' turnaround with work waiting (a batch back on the host to the next "
                    f"submit), p50 / p99 ms (batches): " + ", ".join(
                        f"{q['label']} {q['turnaround_p50_ms']:.2f} / {q['turnaround_p99_ms']:.2f} ({q['turnarounds']})"
                        for q in turned))
            lagged = [q for q in p.layouts or () if (q.get("submit_lag_p99_ms") or 0.0) >= SUBMIT_LAG_SAY_MS]
            if lagged:  # a decision's own work (drops answered, other launches) before a batch's submit
                say(f"{name}: x{s:.3g} batches submitted after their decision's clock, p50 / p99 ms: " + ", ".join(
                    f"{q['label']} {q['submit_lag_p50_ms']:.2f} / {q['submit_lag_p99_ms']:.2f}" for q in lagged))
            if not p.offered_as_scheduled:
                late = p.arrivals["late_ms"]
                say(f"{name}: x{s:.3g}: the load generator fell behind (submitted p50 {late['p50']:.1f} / p99 "
                    f"{late['p99']:.1f} ms after the arrival times; limit {LATE_LIMIT_MS:g} ms): this point does "
                    f"not count at its load")
            slow = [r for r in p.profile_check or () if r.get("ratio") and r["ratio"] > SLOW_RATIO and r["batches"] >= 10]
            for r in slow:  # the plan assumed the profile: say where the device was far slower
                say(f"{name}: x{s:.3g}: {r['model']} batch {r['batch']} on {r['sms']} SMs ran {r['ratio']:.1f}x its "
                    f"profiled time ({r['measured_ms']:.2f} vs {r['profile_ms']:.2f} ms, {r['batches']} batches)")
            points.append(p)
            if on_point is not None:
                on_point(result(IN_PROGRESS))
            return p

        first = (scales or [1.0])[0]
        if warmup_s > 0:  # unmeasured: the process's and the service's first seconds under load
            retune_to(first)
            t = clock()
            run_point(svc, workload, name, scale=first, duration_s=warmup_s, pinned_inputs=pinned_inputs,
                      arrivals=arrivals)
            seconds["warmup"] = clock() - t
            say(f"{name}: warmed up for {warmup_s:g} s at x{first:.3g}")
        for s in scales or ([] if sweep else [1.0]):
            measure(s)
        if sweep:  # the highest load held is every point's to say, those given with --scale too
            sweep_search(lambda s: measure(s).ok(target), steps=steps, max_scale=max_scale)
        say(f"{name}: time by phase: setup {seconds['setup']:.0f} s (models loaded, first layout captured), "
            f"re-plans {seconds['replan']:.0f} s, warm-up {seconds['warmup']:.0f} s, points {seconds['points']:.0f} s")
        return result()
    except Exception as e:  # noqa: BLE001 - one policy's failure must not lose the others' results
        say(f"{name}: FAILED: {type(e).__name__}: {e}")
        # what was measured before the failure still counts (a sweep cut short is a lower bound)
        return result(f"{type(e).__name__}: {e}")
    finally:
        svc.close(drain=False, timeout_s=10)


def save_json(path: str | Path, report: dict) -> None:
    """Write ``report`` to ``path`` whole or not at all (a temporary file, then a rename): reports
    are rewritten after every point, and a run killed while writing must keep the last one."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)


def planned_profiles(report: dict, store: Any, policy: str | None = None) -> dict:
    """model -> :class:`~gpuloom.profile.store.Profile` a bench ``report``'s points were planned and
    simulated with: those it recorded (``policy``'s own, else the report's shared ones, else another
    policy's), else ``store``'s (the shipped ones) cut to the report's max batch, as reports before the
    fiftieth session leave it to be assumed (wrong for models whose profile was measured at load)."""
    from ..profile.store import Profile
    from ..runtime.model_profiles import trim_profile

    pols = report.get("policies") or {}
    # a policy's own (where it differed from the others'), the report's shared ones, any other policy's
    order = ([pols[policy]] if policy in pols else []) + [report] + list(pols.values())
    out = {}
    for m in (x["name"] for x in report["workload"]["models"]):
        rec = next((r["profiles"][m] for r in order if m in (r.get("profiles") or {})), None)
        out[m] = Profile.from_json(rec) if rec is not None else \
            trim_profile(store.get(m), int(report["meta"]["max_batch"]))
    return out


def shared_profiles(per_policy: Sequence[dict]) -> tuple[dict, list[dict]]:
    """(the profiles every policy that recorded a model recorded alike, each policy's others): a
    report keeps each profile once where its policies planned with the same one (the usual case:
    one process measures a model's profile at load once)."""
    shared = {}
    for m in {m for prof in per_policy for m in prof}:
        seen = [prof[m] for prof in per_policy if m in prof]
        if all(x == seen[0] for x in seen):
            shared[m] = seen[0]
    return shared, [{m: v for m, v in prof.items() if m not in shared} for prof in per_policy]


def to_json(workload: Workload, results: Sequence[PolicyResult], *, device: str, target: float,
            meta: dict | None = None) -> dict:
    """The report: per policy points and headline, ratios to the best baseline."""
    out = {
        "schema": "gpuloom.bench/1",
        "workload": workload.to_dict(),
        "device": device,
        "target": target,
        "meta": meta or {},
        # max_scale_bounded false: no point above max_scale missed the target, so it is a lower bound
        "policies": {r.policy: {"max_scale": r.max_scale, "max_scale_bounded": r.max_scale_bounded,
                                "max_load_rps": r.max_load_rps, "error": r.error,
                                "seconds": r.seconds, "points": [finite_values({**dataclasses.asdict(p), "offered_as_scheduled": p.offered_as_scheduled})
                                           for p in r.points]} for r in results},
    }
    shared, own = shared_profiles([r.profiles for r in results])
    if shared:
        out["profiles"] = shared
    for r, mine in zip(results, own):
        if mine:
            out["policies"][r.policy]["profiles"] = mine
    # variants of a policy ("dstack:lookahead_ms=0") and repeats ("dstack#2") are not baselines
    rivals = [r for r in results if policy_of(r.policy) != "dstack"]
    base = [r for r in rivals if not r.error]
    if base:
        for ds in results:
            if policy_of(ds.policy) != "dstack":
                continue
            if ds.policy == "dstack":
                out["dstack_vs_best_baseline"] = versus_best_baseline(ds, rivals, base)
            else:  # each variant and repeat compared as well: a user tuning dstack wants its own ratio
                out.setdefault("variants_vs_best_baseline", {})[ds.policy] = versus_best_baseline(ds, rivals, base)
    return finite_values(out)


def versus_best_baseline(ds: PolicyResult, rivals: Sequence[PolicyResult], base: Sequence[PolicyResult]) -> dict:
    """One dstack run against the baseline that held the target to the highest load (``base``: the
    baselines that finished) and, at each load, against the best goodput of any baseline (``rivals``)."""
    best = max(base, key=lambda r: r.max_scale)
    return {
        "baseline": best.policy,
        # None where no baseline held the target at any load measured (an overloaded mix, by construction)
        "load_ratio": ds.max_scale / best.max_scale if best.max_scale > 0 else None,
        "dstack_max_scale": ds.max_scale,
        "baseline_max_scale": best.max_scale,
        # a dstack sweep cut short by an error gives a lower bound, not its highest load
        "dstack_complete": not ds.error,
        # every baseline's points, a run cut short by an error too: what it measured stands
        "goodput_by_scale": goodput_ratios(ds, rivals),
    }


def goodput_ratios(ds: PolicyResult, base: Sequence[PolicyResult]) -> list[dict]:
    """At each load both dstack and some baseline measured: dstack's goodput over the best baseline's
    there. What compares policies where none holds the SLO target (overload), and at every load of a
    rate sweep where the highest loads alone say little."""
    out = []
    for p in sorted(ds.points, key=lambda p: p.scale):
        rivals = [(q.goodput_rps, r.policy) for r in base for q in r.points if math.isclose(q.scale, p.scale)]
        if not rivals:
            continue
        g, name = max(rivals)
        out.append({"scale": p.scale, "baseline": name, "dstack_goodput_rps": p.goodput_rps,
                    "baseline_goodput_rps": g, "ratio": p.goodput_rps / g if g > 0 else None})
    return out


__all__ = ["ModelPoint", "Point", "PolicyResult", "bench_policy", "build_models", "goodput_ratios", "highest_held",
           "run_point", "simulate_point", "sweep_search", "tiny_module", "to_json", "versus_best_baseline"]
