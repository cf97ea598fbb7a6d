"""The online inference service: load models, submit requests from any thread, get futures back.

This is what a network server (issue 6) sits on. It adds no scheduling of its own: requests go to a
:class:`~gpuloom.runtime.core.Runtime` (its queues and the chosen policy, the same policy object as
in simulation) driving an :class:`~gpuloom.runtime.exec_backend.ExecBackend` (CUDA graphs on SM
partitions, or the CPU path).

    svc = InferenceService(policy="dstack")          # cuda if available, else cpu
    svc.start()
    svc.load(ModelConfig("mlp", inputs=(TensorSpec("x", (16,), "float32"),), slo_ms=50), module)
    fut = svc.submit("mlp", {"x": np.zeros((4, 16), np.float32)})
    fut.result()["output0"].shape                    # (4, ...): this request's rows only
    svc.close()

**Rows and batching.** A client request may carry ``n >= 1`` rows. The runtime batches *rows*: each
row becomes one runtime request (policies count requests, and a batch of ``b`` requests is ``b``
rows, so every policy batches by samples unchanged); the service joins the request's rows back into
one response. Rows of one request arrive together with one deadline and sit next to each other in the queue, so
they nearly always run in one batch; if any row fails or is dropped, the whole request does.

**Books.** Every accepted request ends as exactly one of success, failure, dropped (by reason), and
:meth:`InferenceService.stats` shows ``accepted == success + failure + dropped + in_flight``. Rejected
submissions (invalid input, overload) are counted apart and never enter the books.

**Rates.** Policies plan from each model's expected rate: ``ModelConfig.rate_hint`` for the first
plan; at every later (re)load the measured rate of the last minute is used, and ``dstack`` re-plans
from its own rate estimates while serving.

Beside it: :mod:`~gpuloom.runtime.model_config` (``ModelConfig``, ``TensorSpec``),
:mod:`~gpuloom.runtime.errors` (what a request's future fails with) and
:mod:`~gpuloom.runtime.model_profiles` (the profile a loaded model is planned with) and
:mod:`~gpuloom.runtime.model_compile` (a model compiled as the service serves it); the first three's
public names are importable from here too. Split out of this module: :mod:`~gpuloom.runtime.books`
(the per-model books: ``Histogram``, ``_Model``, ``_Call``; importable from here too) and
:mod:`~gpuloom.runtime.loop_hosting` (``LoopHosting``, which ``InferenceService`` inherits: where the
runtime's loop runs and what feeds it from outside).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import heapq
import logging
import math
import os
import threading
import time
import warnings
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..gpu.partition import check_workqueues
from ..policy import make_policy
from ..policy.base import ModelInfo, PolicyContext
from ..policy.types import Layout, Result, Status
from ..profile.store import Profile, ProfileStore
from .books import CANCELLED, Histogram, RequestFuture, _Call, _Model
from .core import Runtime
from .cuda_device import check_lane_streams, check_outputs
from .device import DeviceLayer, PinnedRow, make_device_layer
from .errors import (DeadlineExceeded, Dropped, Expired, InvalidInput, ModelFailed, ModelNotReady, Overloaded,
                     ServiceError, Shed, UnknownModel)
from .exec_backend import ExecBackend, ExecOutput, check_complete_on, check_launch_on, check_lookahead
from .gcpause import GcMonitor, RareFullCollections, freeze_loaded, full_collection_awaited, thaw
from .gilswitch import DEFAULT_MS as DEFAULT_SWITCH_INTERVAL_MS
from .gilswitch import ShortSwitchInterval, check_interval_ms
from .loop_hosting import LoopHosting
from .model_config import DTYPES, ModelConfig, TensorSpec
from .model_compile import compile_model
from .model_profiles import crude_profile, profile_for, trim_profile

log = logging.getLogger(__name__)

# The GIL switch interval while a model is compiled next to models being served (load_many). On the
# build VM, a 50 ms-SLO model served over HTTP (two workers) while another model loaded: its slowest
# request during the 0.4 s compile took 36-58 ms at Python's 5 ms and 19-37 ms at 0.5 ms, with about
# twice as many of its requests served meanwhile (scripts/diag_load_while_serving.py). Only while
# compiling: in steady serving a short interval did not help on the H200 (gilswitch.py).
LOAD_SWITCH_INTERVAL_MS = 0.5

#: the coarsest step a failed layout makes the service plan partitions in (SMs; see _replan)
MAX_PARTITION_STEP_SMS = 32

#: each of DTYPES as a numpy dtype: submit compares ``x.dtype`` against these (~0.05 us) instead of
#: ``str(x.dtype)`` against the name (~3.6 us: numpy builds a dtype's name in Python); the outcome is
#: the same for every dtype (byte order, aliases such as "long", structured ones)
_NP_DTYPES = {name: np.dtype(name) for name in DTYPES}
#: the deadline, ms from now, of a request that waited its whole deadline before it reached the
#: service: past by the scheduler's next look, which drops it (DeadlineExceeded), books and all
_NO_TIME_LEFT_MS = 1e-3
_SERVED = Status.SERVED  # read per row answered (an Enum attribute costs more than a module constant)


# -- helpers ------------------------------------------------------------------------------------
def _held_bytes(module: Any, runner: Any) -> int:
    """What unloading a model can give back: its module's parameters and buffers (when the service
    compiled it from an ``nn.Module``; a ``CompiledModel`` passed in is the caller's, shared) and its
    compiled graphs' memory."""
    n = int(getattr(runner, "memory_bytes", 0) or 0) if runner is not module else 0
    params, buffers = getattr(module, "parameters", None), getattr(module, "buffers", None)
    if callable(params) and callable(buffers):  # an nn.Module (torch is not imported here)
        n += sum(t.numel() * t.element_size() for t in (*params(), *buffers()))
    return n


#: the expiry heap is pruned of answered calls once it holds more than this many entries and 4x the live ones
_EXPIRY_PRUNE_FROM = 4096


def _split_rows(arrays: list[np.ndarray], copy: bool) -> list[list[np.ndarray]]:
    """A request's input arrays (in the model's input order) as per-row payloads: copied once with
    ``copy`` (the caller may reuse its arrays once submit returns), else contiguous views."""
    arrays = [np.array(x, copy=True, order="C") if copy else np.ascontiguousarray(x) for x in arrays]
    return [[a[i] for a in arrays] for i in range(arrays[0].shape[0])]


# -- the service --------------------------------------------------------------------------------
_NO_SCOPE = contextlib.nullcontext()


def _no_scope(rows: int) -> contextlib.nullcontext:
    """``InferenceService.answer_scope``'s default: nothing around a batch's answers."""
    return _NO_SCOPE


class InferenceService(LoopHosting):
    """Serve many models on one device with one scheduling policy. Thread-safe.

    Args:
        policy: a registered policy name (``gpuloom.policy.policy_names()``; not ``ideal``).
        device: ``"cuda"``, ``"cuda:N"``, ``"cpu"``; default cuda when available, else cpu.
        profiles: where to look up each model's latency profile by name (default: the shipped H200
            profiles on CUDA, none on CPU). Without one, on CUDA the model is profiled at load over
            the device's SM grid (``measure_profiles``) and the result kept in ``profile_cache``; on
            CPU, or with ``measure_profiles=False``, a crude profile is timed at load (on CUDA with a
            warning; on CPU, where latency does not depend on SMs, that is the whole profile).
        measure_profiles: on CUDA, profile a model that has none at its load (default True): latency
            per batch bucket on every SM count of the grid, inside real partitions, as
            ``gpuloom profile`` does (seconds to a minute a model; timed beside the models being
            served, if any, so less clean than on an idle GPU).
        profile_cache: directory of the profiles measured at load (``gpuloom.profile.cache``;
            default ``~/.cache/gpuloom/profiles``, or ``$GPULOOM_PROFILE_CACHE``); None keeps none.
        queue_limit: accepted-but-unanswered requests per model before :class:`Overloaded`.
        policy_options: keyword options of the policy's constructor.
        device_layer: a ready :class:`DeviceLayer` instead of ``device`` (tests: ``FakeDeviceLayer``;
            ``gpuloom bench --share-device``: one layer, and its captured layouts, for every policy). It
            stays open when the service closes: its owner closes it. A layer the service made, it closes.
            One service at a time on a layer.
        lookahead_ms: launch-ahead on exclusive partitions (a partition takes its next batch this
            long before its running one is predicted to end; 0 = only when idle; see
            ExecBackend.DEFAULT_LOOKAHEAD_MS for the default and why). See
            :meth:`gpuloom.runtime.core.Runtime._open_lane`.
        tune_gc: keep the garbage collector's full collections out of serving
            (:mod:`gpuloom.runtime.gcpause`): after each load, freeze what is alive (compiled
            models are hundreds of thousands of objects; a full collection scanning them stopped
            every thread for 320-340 ms), and while the service runs make automatic full
            collections 100x rarer (those of the requests alive under load took 53-75 ms). Only the
            first load collects before freezing; an unload thaws (the unloaded model is freed by
            the next full collection, not by a pause now, and that collection freezes the rest
            again; a load meanwhile freezes nothing), and so does close, which also restores the
            thresholds.
        unload_collect_mib: with ``tune_gc``, an unloaded model whose weights and graph memory come to
            at least this many MiB is freed at once: its unload runs one full collection, a pause of
            every served model (the whole heap is scanned: on the build VM 150 ms beside one small
            model, 310 ms unloading vgg16 beside resnet50, scripts/diag_unload_pause.py) to give the
            memory back now rather than at the next full collection, which under ``tune_gc`` can be
            hours away (none came in 15 minutes of the soak with a reload every 20 s). Smaller models
            wait for it, but their memory counts: the unload that brings the unloaded models still
            waiting to this many MiB collects, so reloads never hold more than this of dead models.
            0: every unload collects; ``float("inf")``: none does. Default 256.
        switch_interval_ms: the interpreter's GIL switch interval while the service runs (process-
            wide, restored at close; None, the default, leaves it alone). Python's 5 ms lets any
            busy thread hold the runtime's loop thread off for up to 5 ms at each of its torch
            calls; a shorter one measured worse on the H200 (:mod:`gpuloom.runtime.gilswitch`).
        launch_on: ``"auto"`` (default), ``"loop"``, ``"lane"`` or ``"inline"``: which thread launches a
            batch (:class:`ExecBackend`; ``"lane"`` takes the launch off the runtime's thread,
            ``"inline"`` runs the whole batch on it: no hand-off to a watcher thread). ``"auto"``:
            ``"inline"`` on the CPU device, ``"loop"`` on any other. On CPU over HTTP at 100 req/s
            inline had the lower p99 in 7 of 8 side-by-side runs and more requests/s at 8 and 32
            clients in all (one model; docs/reports/serving.md); several CPU models' batches then
            run one after another on the runtime's thread (not measured).
        early_answer: resolve a served request's future on the partition's watcher thread as soon as
            its batch is done, instead of after the runtime's thread has booked the completion (one
            thread hand-off less on every answer; :attr:`ExecBackend.on_served`).
        raw_launch: on CUDA, issue each launch's copies, graph launch and events as raw driver calls
            (:mod:`gpuloom.gpu.launch`) instead of torch calls (the device layer made here; a
            ``device_layer`` passed in keeps its own setting).
        workqueues: on CUDA, ``"balanced"`` creates each SM partition with hardware workqueues of
            its own where the driver can (CUDA 13.1+), so that one partition's work does not queue
            behind another's; ``"shared"`` (default): the device's, as the driver does by default
            (:class:`~gpuloom.gpu.Partitioner`). Not measured yet.
        lane_streams: on CUDA, ``"single"`` captures every model with one stream on every lane instead
            of each bucket's compile-time choice (``"compiled"``, default); an experiment
            (:class:`~gpuloom.runtime.cuda_device.CudaDeviceLayer`). Not measured yet.
        outputs: on CUDA, ``"views"`` hands requests views of a finished batch's page-locked output
            buffers instead of copies of their rows (``"copies"``, default); off by default until
            measured on more than one machine (run 62: bert_base's copy 1.94 -> 0.10 ms a batch).
            Needs ``raw_launch=True`` (refused otherwise: see
            :class:`~gpuloom.runtime.cuda_device.CudaDeviceLayer`).
        complete_on: ``"watcher"`` (default) or ``"loop"``: who learns that a batch is done
            (:attr:`ExecBackend.COMPLETE_ON`). ``"loop"``: the GPU wakes the runtime's thread itself
            (a host function posting its semaphore; raw launches only), which books the batch, where
            ``"watcher"`` wakes a watcher thread that then posts the runtime's.
        expiry_grace_s: a request the runtime has not answered this long after its deadline is
            answered by the service with :class:`Expired` (counted as dropped "expired", logged as an
            error): whatever goes wrong below, every accepted request gets an answer.
    """

    def __init__(
        self,
        *,
        policy: str = "dstack",
        device: str | None = None,
        profiles: ProfileStore | None = None,
        queue_limit: int = 1024,
        policy_options: dict | None = None,
        device_layer: DeviceLayer | None = None,
        load_timeout_s: float = 600.0,
        lookahead_ms: float = ExecBackend.DEFAULT_LOOKAHEAD_MS,
        tune_gc: bool = True,
        switch_interval_ms: float | None = DEFAULT_SWITCH_INTERVAL_MS,
        launch_on: str = "auto",
        early_answer: bool = False,
        raw_launch: bool = True,
        workqueues: str = "shared",
        lane_streams: str = "compiled",
        outputs: str = "copies",
        complete_on: str = "watcher",
        expiry_grace_s: float = 5.0,
        measure_profiles: bool = True,
        profile_cache: str | os.PathLike | None = "default",
        unload_collect_mib: float = 256.0,
    ) -> None:
        self.lookahead_ms = check_lookahead(lookahead_ms)  # here, not at the first load
        self.tune_gc = bool(tune_gc)
        if not (isinstance(unload_collect_mib, (int, float)) and unload_collect_mib >= 0):
            raise ValueError(f"unload_collect_mib must be >= 0 MiB (0: always; float('inf'): never), "
                             f"got {unload_collect_mib!r}")
        self.unload_collect_mib = float(unload_collect_mib)
        self.unload_collections = 0  # unloads that collected at once (unload_collect_mib)
        self._uncollected_bytes = 0  # unloaded models' memory still waiting for a full collection
        self.switch_interval_ms = None if switch_interval_ms is None else check_interval_ms(switch_interval_ms)
        self._switch_held = False
        self.launch_on = launch_on if launch_on == "auto" else check_launch_on(launch_on)
        self._early_answer = bool(early_answer)
        self.raw_launch = bool(raw_launch)
        self.workqueues = check_workqueues(workqueues)  # here, not when the device layer is made
        self.lane_streams = check_lane_streams(lane_streams)
        self.outputs = check_outputs(outputs, self.raw_launch)
        self.complete_on = check_complete_on(complete_on)
        if not expiry_grace_s > 0:
            raise ValueError(f"expiry_grace_s must be > 0 s, got {expiry_grace_s!r}")
        self.expiry_grace_s = float(expiry_grace_s)
        self._expiry_stop = threading.Event()
        self._by_deadline: list = []  # heap of (deadline, runtime ids) of accepted calls (expire_overdue)
        self._gc_held = False  # this service holds RareFullCollections (between start and close)
        self._gc = GcMonitor.installed()
        self.policy_name = policy
        self.policy_options = dict(policy_options or {})
        probe = make_policy(policy, **self.policy_options)  # unknown names / bad options fail here, not at load
        if probe.simulation_only:
            raise ValueError(f"policy {policy!r} is a simulation-only bound; it cannot serve (pick another policy)")
        if not isinstance(queue_limit, int) or queue_limit < 1:
            raise ValueError(f"queue_limit must be a positive int, got {queue_limit!r}")
        self.queue_limit = queue_limit
        self._device_arg = device
        self._layer = device_layer
        self._owns_layer = device_layer is None  # close() closes only a layer it made
        self._profiles_resolved = False  # the shipped profiles looked up once the layer's kind is known
        self.profiles = profiles
        self.measure_profiles = bool(measure_profiles)
        if profile_cache == "default":
            from ..profile.cache import default_cache_dir

            profile_cache = default_cache_dir()
        self.profile_cache = profile_cache  # a directory, or None
        self.load_timeout_s = load_timeout_s
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()
        # answer_scope(rows): a context entered around each batch's answers (_on_results); a server in
        # front sets its own (serve.ring.batch_replies: one wake-up per worker for a big batch's replies)
        self.answer_scope: Callable[[int], Any] = _no_scope
        self._admin = threading.RLock()  # one load/unload at a time (reload loads a model not loaded under it)
        self._swapping: set[str] = set()  # models between their versions (reload): refused, not gone
        self._cv = threading.Condition(self._lock)
        self._runtime: Runtime | None = None
        self._backend: ExecBackend | None = None
        self._layout_waiting: set[int] = set()  # id(policy) of the policies _replan_once waits on
        self._layout_seen: dict[int, BaseException | None] = {}  # id(policy) -> first layout outcome
        self._layout_failed: dict[int, Layout] = {}  # id(policy) -> its first layout, when that failed
        # Partition sizes are planned in multiples of the device's granularity times this. It doubles
        # (up to MAX_PARTITION_STEP_SMS) when a layout with partitions under the new step fails to
        # build: on the H200 cuDNN could not run on some 8-SM partitions (docs/reports/runtime.md).
        self.granularity_factor = 1
        self._rid: dict[int, tuple[_Call, int]] = {}  # runtime request id -> (call, row)
        self._started = False
        self._closed = False
        self._t_start = time.monotonic()
        self._backend_stats: list[dict] = []  # of runtimes stopped when the last model left
        # what the runtime's loop sleeps on, the same for every backend this service makes (one is made
        # anew when a model is loaded after the last one left): other processes hold it (add_intake)
        self._waker = self._shared_waker()
        self._intakes: list[Callable[[], float]] = []  # pollers on every runtime loop (add_intake)
        self._host: Any = None  # host_loop_on: the event loop every runtime's loop runs on
        self._host_batch_limit_ms: float | None = None  # ... while every model's largest batch takes at most this

    @property
    def early_answer(self) -> bool:
        """Whether a served request is answered on its partition's watcher thread (``early_answer``)."""
        return self._early_answer

    @early_answer.setter
    def early_answer(self, on: bool) -> None:
        """Any thread: from the next batch to finish on. Why settable: a benchmark compares both on one
        loaded service (``scripts/serve_e2e.py --early-answer off,on``), without loading the models twice."""
        with self._lock:
            self._early_answer = bool(on)
            if self._backend is not None:
                self._hook_early_answer()

    def _hook_early_answer(self) -> None:
        """The backend answers served requests on its watchers (``on_served``) exactly while early_answer is
        on: its one wiring, at the backend's creation and at each switch. Each is answered once: the
        runtime's later call for the same request finds it done."""
        self._backend.on_served = self._on_result if self._early_answer else None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def device(self) -> DeviceLayer:
        if self._layer is None:
            self._layer = make_device_layer(self._device_arg, raw_launch=self.raw_launch, workqueues=self.workqueues,
                                            lane_streams=self.lane_streams, outputs=self.outputs)
        if not self._profiles_resolved:  # a layer made here or handed in: the same profiles either way
            self._profiles_resolved = True
            if self.profiles is None and self._layer.kind == "cuda":
                try:
                    self.profiles = ProfileStore.builtin("h200")
                except Exception:  # noqa: BLE001 - no shipped profiles: crude ones at load
                    self.profiles = None
        if self._layer.expected_ms is None:
            self._layer.expected_ms = self._expected_ms
        return self._layer

    def _expected_ms(self, name: str, batch: int, sms: int) -> float | None:
        """What a batch of ``name`` should take alone on ``sms`` SMs: its profile (the device layer
        checks a partition's carving against it). None for an unknown model or outside the profile."""
        m = self._models.get(name)
        try:
            return m.profile.latency(batch, sms) if m is not None else None
        except (ValueError, KeyError, IndexError):  # ProfileError is a ValueError
            return None

    def start(self) -> None:
        """Make the device ready; models can be loaded and requests submitted afterwards."""
        if self._closed:
            raise ModelNotReady("the service was closed; make a new one")
        if self._started:
            return
        _ = self.device
        self._started = True
        self._t_start = time.monotonic()
        threading.Thread(target=self._expire_loop, name="gpuloom-expiry", daemon=True).start()
        if self.tune_gc:
            RareFullCollections.enter()
            self._gc_held = True
        if self.switch_interval_ms is not None:
            ShortSwitchInterval.enter(self.switch_interval_ms)
            self._switch_held = True

    def close(self, *, drain: bool = True, timeout_s: float = 30) -> None:
        """Stop taking requests and answer every accepted one: served (``drain``, within
        ``timeout_s``) or failed with :class:`Dropped` ("shutdown")."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        rt = self._runtime
        if rt is not None:
            rt.stop(drain=drain, timeout_s=timeout_s)
        self._fail_outstanding("shutdown")
        self._expiry_stop.set()
        if self._layer is not None and self._layer.expected_ms == self._expected_ms:
            self._layer.expected_ms = None  # a layer handed to another service checks against its profiles
        if self._backend is not None:
            self._backend.close(keep_device=not self._owns_layer)
        elif self._layer is not None and self._owns_layer:
            self._layer.close()
        self._started = False
        if self._gc_held:
            # what this service froze can be collected again; while other services run, the next
            # full collection freezes what they still hold
            thaw(refreeze=RareFullCollections.holders() > 1)
            RareFullCollections.leave()
            self._gc_held = False
        if self._switch_held:
            ShortSwitchInterval.leave(self.switch_interval_ms)
            self._switch_held = False

    def resolved_launch_on(self) -> str:
        """``launch_on`` with ``"auto"`` resolved for this service's device: ``"inline"`` on the CPU
        (no watcher hand-off per batch), ``"loop"`` elsewhere (CUDA, fake devices)."""
        if self.launch_on != "auto":
            return self.launch_on
        return "inline" if self.device.kind == "cpu" else "loop"

    def is_live(self) -> bool:
        """The service runs and its runtime loop is healthy."""
        rt = self._runtime
        return self._started and not self._closed and (rt is None or rt.error is None)

    def ready(self, name: str) -> bool:
        m = self._models.get(name)
        return m is not None and m.state == "ready" and self.is_live()

    def swapping(self, name: str) -> bool:
        """Whether ``name`` is between two versions (:meth:`reload`): not ready for a moment, but still
        served. A server stays ready meanwhile, as Triton's does while it swaps versions (before, a
        reload took the whole server out of readiness and health probes; a review, sixty-ninth session)."""
        return name in self._swapping

    def profile(self, name: str) -> Profile:
        """The latency profile ``name`` is planned with (trimmed to its max_batch)."""
        m = self._models.get(name)
        if m is None:
            raise UnknownModel(f"no model {name!r} is loaded; loaded: {sorted(self._models)}")
        return m.profile

    def models(self) -> list[ModelConfig]:
        with self._lock:
            return [m.config for m in self._models.values()]

    def config(self, name: str) -> ModelConfig | None:
        """The config of loaded model ``name``, or None: one lookup, read per request by the server
        (on the runtime's thread for the HTTP workers' requests), where :meth:`models` copies the list."""
        m = self._models.get(name)
        return m.config if m is not None else None

    # -- models -------------------------------------------------------------------------------
    def load(self, config: ModelConfig, module: Any) -> None:
        """Compile ``module`` (``gpuloom.compile`` with ``config.max_batch``), find its profile, re-plan
        with it; returns when the model is ready to serve (its graphs are captured).

        Raises ValueError for an already loaded name or outputs that do not match the model, and
        ModelNotReady when its layout could not be set up (e.g. graph memory; the message says why).
        """
        if not isinstance(config, ModelConfig):
            raise TypeError(f"load expects a ModelConfig, got {type(config).__name__}")
        self.load_many([(config, module)])

    def load_many(self, models: Sequence[tuple[ModelConfig, Any]]) -> None:
        """Load several models with one plan and one layout build (``load`` once per model would
        re-plan and capture every loaded model again after each one). All or nothing: when the
        layout cannot be set up, none of them stays loaded (ModelNotReady says why)."""
        self._not_on_host("load")
        models = list(models)
        bad = [type(c).__name__ for c, _ in models if not isinstance(c, ModelConfig)]
        if bad:
            raise TypeError(f"load_many expects (ModelConfig, module) pairs, got {bad[0]}")
        names = [c.name for c, _ in models]
        if len(set(names)) != len(names):
            raise ValueError(f"load_many: duplicate model names in {names}")
        what = f"model {names[0]!r}" if len(names) == 1 else f"models {names}"
        if not self._started or self._closed:
            raise ModelNotReady("the service is not running: call start() first")
        with self._admin:
            taken = [n for n in names if n in self._models]
            if len(taken) == 1:
                raise ValueError(f"model {taken[0]!r} is already loaded; unload it first")
            if taken:
                raise ValueError(f"models {taken} are already loaded; unload them first")
            entries = self._compiled(models)
            for e in entries:
                self.device.add_model(e.config.name, e.runner)
                with self._lock:
                    self._models[e.config.name] = e
            t0 = time.perf_counter()
            err = self._replan()
            if err is None:  # where a load's time goes (a user waiting on a start asks)
                n = len(self._models)
                log.info("%s: the layout serving %d model%s set up in %.1f s", what, n, "s" if n != 1 else "",
                         time.perf_counter() - t0)
            if err is not None:
                with self._lock:
                    for e in entries:
                        self._models.pop(e.config.name, None)
                for e in entries:
                    self.device.remove_model(e.config.name)
                self._replan()
                raise ModelNotReady(f"{what} could not be set up: {type(err).__name__}: {err}") from err
            now = time.monotonic()
            batches = self._backend.model_batches if self._backend is not None else {}
            for e in entries:
                e.state = "ready"
                e.loaded_at = now
                e.exec_base = batches.get(e.config.name, 0)  # (a name loaded before, others served meanwhile)
                self._warn_if_slower_than_slo(e)
            if self.tune_gc:
                # the first load collects, then freezes (nothing is served yet); a later one only
                # freezes: a full collection now would stop the models being served (a 50 ms-SLO
                # model's requests timed out during a load in the test suite's large heap)
                freeze_loaded(collect=len(self._models) == len(entries))

    def reload(self, config: ModelConfig, module: Any, *, timeout_s: float = 60.0) -> None:
        """Replace the loaded model ``config.name`` with a new version (``module``), as Triton swaps
        versions: the new one is compiled and profiled first while the old one serves, so a version
        that fails there leaves the old one serving, untouched. Then the old one's requests finish
        (within ``timeout_s``; those still queued then are dropped "model unloaded"), the new one
        takes its place and the layout is set up again; meanwhile the model's requests are refused
        with ModelNotReady (retry), never UnknownModel. When the layout cannot be set up with the new
        version, the old one is put back and ModelNotReady says why. A name not loaded is loaded.

        Why: unloading first and then loading left a gap of the whole compile in which the model was
        unknown (404s), and lost the serving version when the new one failed to compile (a review,
        sixty-ninth session)."""
        self._not_on_host("reload")
        if not isinstance(config, ModelConfig):
            raise TypeError(f"reload expects a ModelConfig, got {type(config).__name__}")
        if not self._started or self._closed:
            raise ModelNotReady("the service is not running: call start() first")
        name = config.name
        with self._admin:
            old = self._models.get(name)
            if old is None:
                self.load(config, module)
                return
            new, = self._compiled([(config, module)])
            self._swapping.add(name)
            try:
                self._swap(old, new, timeout_s)
            finally:
                self._swapping.discard(name)
            held = old.held_bytes
            old = None  # nothing here may keep the old version alive past the collection below
            self._collect_unloaded(name, held)  # (its collection freezes the new version with the rest)

    def _swap(self, old: "_Model", new: "_Model", timeout_s: float) -> None:
        """:meth:`reload`'s second half, with ``_admin`` held: ``new`` serves in ``old``'s place, or
        ``old`` again (ModelNotReady) when the layout cannot be set up with ``new``."""
        name = old.config.name
        with self._lock:
            old.state = "unloading"  # refused meanwhile (ModelNotReady), its requests finish
            self._cv.wait_for(lambda: old.in_flight == 0, timeout=timeout_s)
            left = [rid for rid, (call, _) in self._rid.items() if call.model is old]
            new.take_books(old.books())  # its statistics go on, as the server's counters do
            self._models[name] = new  # (state "loading": refused with ModelNotReady until set up)
        rt = self._runtime
        if left and rt is not None:  # still queued after the timeout: not for the new version
            rt.cancel(left, "model unloaded")
        self.device.remove_model(name)
        self.device.add_model(name, new.runner)
        t0 = time.perf_counter()
        err = self._replan()
        if err is not None and self._closed:  # (the service closed under the reload: nothing to put back)
            raise ModelNotReady(f"model {name!r}: the service closed during its reload") from err
        if err is not None:
            with self._lock:
                self._models[name] = old
            self.device.remove_model(name)
            self.device.add_model(name, old.runner)
            self._replan()
            old.state = "ready"
            raise ModelNotReady(f"model {name!r}: its new version could not be set up (the old one serves on): "
                                f"{type(err).__name__}: {err}") from err
        log.info("model %r: the layout serving its new version set up in %.1f s", name, time.perf_counter() - t0)
        new.state = "ready"
        self._warn_if_slower_than_slo(new)

    def _warn_if_slower_than_slo(self, m: "_Model") -> None:
        """A model whose profile says that even a batch of one on the whole device misses its SLO:
        say so at load (its requests with the default deadline will fail with DeadlineExceeded)
        rather than let the user find out from errors."""
        p, slo = m.profile, m.config.slo_ms
        fastest = p.latency(p.batches[0], self.device.gpu_sms)  # (past the profile's SMs: its whole-GPU row)
        if fastest > slo:
            how = "timed at load" if p.source == "synthetic" else "its measured profile"
            warnings.warn(f"model {m.config.name!r}: a batch of {p.batches[0]} takes {fastest:.3g} ms on the whole "
                          f"device ({how}), over its SLO of {slo:g} ms: requests with the default deadline will fail "
                          f"with DeadlineExceeded; give it a larger slo_ms (requests with longer deadlines are "
                          f"served)", stacklevel=4)

    def retune(self, rates: Mapping[str, float]) -> None:
        """Re-plan for known request rates (req/s per model; others keep theirs), forgetting the
        measured ones, and wait until the new layout serves: what a benchmark does before each load
        point so that every policy starts from the offered rates rather than from the last point's."""
        self._not_on_host("retune")
        with self._admin:
            with self._lock:
                for name, r in rates.items():
                    m = self._models.get(name)
                    if m is None:
                        raise UnknownModel(f"no model {name!r} is loaded; loaded: {sorted(self._models)}")
                    if not (isinstance(r, (int, float)) and 0 <= r < math.inf):
                        raise ValueError(f"rate of {name!r} must be a non-negative number of requests/s, got {r!r}")
                    m.config = dataclasses.replace(m.config, rate_hint=float(r))
                    m.arrivals.clear()
            err = self._replan()
            if err is not None:
                raise ModelNotReady(f"re-planning for rates {dict(rates)} failed: {type(err).__name__}: {err}") from err

    def unload(self, name: str, *, timeout_s: float = 60.0) -> None:
        """Stop accepting requests for ``name``; its queued and running requests finish (within
        ``timeout_s``, else they are dropped with "model unloaded"); then it is removed."""
        self._not_on_host("unload")
        with self._admin:
            with self._lock:
                m = self._models.get(name)
                if m is None:
                    raise UnknownModel(f"no model {name!r} is loaded; loaded: {sorted(self._models)}")
                m.state = "unloading"
                self._cv.wait_for(lambda: m.in_flight == 0, timeout=timeout_s)
                del self._models[name]
                held = m.held_bytes
                m = None  # nothing here may keep the model alive past the collection below
            # off the device first, so the re-plan's build leaves it out (a build made while it was
            # still there kept its graphs and weights alive until the next layout change)
            self.device.remove_model(name)
            self._replan()
            self._collect_unloaded(name, held)

    def _collect_unloaded(self, name: str, held: int) -> None:
        """After a model (or a model's old version) left: make its objects collectable and give its
        ``held`` bytes back, at once past ``unload_collect_mib`` of them."""
        if self.tune_gc:
            # the model's objects (FX graphs are cyclic; they hold its weights) must become
            # collectable: thaw, and let the next full collection free them rather than stop the
            # models still served for one now; that collection freezes the rest again (a load
            # before it freezes nothing: it would freeze the unloaded model's cycles for good)
            if not full_collection_awaited():  # one has run since the last unload: all freed
                self._uncollected_bytes = 0
            thaw(refreeze=True)
            self._uncollected_bytes += held
            if self._uncollected_bytes >= self.unload_collect_mib * 2**20:  # give it back now, for a pause
                t0 = time.perf_counter()
                gc.collect()  # frees the models' cycles; the refreeze (thaw's) runs at its end
                self.unload_collections += 1
                log.info("unloaded %s: a full collection (%.0f ms) gave back %.0f MiB of unloaded models "
                         "at once (unload_collect_mib=%g)", name, (time.perf_counter() - t0) * 1e3,
                         self._uncollected_bytes / 2**20, self.unload_collect_mib)
                self._uncollected_bytes = 0

    # -- requests -----------------------------------------------------------------------------
    def submit(self, name: str, inputs: Mapping[str, np.ndarray], *, deadline_ms: float | None = None,
               waited_ms: float = 0.0, checked_for: ModelConfig | None = None,
               on_done: Callable[[dict[str, np.ndarray] | None, ServiceError | None], None] | None = None,
               ) -> concurrent.futures.Future | None:
        """Queue one request of ``n`` rows; its future gives ``{output name: array of n rows}``.

        ``deadline_ms``: answer within this many ms from now (default: the model's SLO); a request
        the scheduler cannot serve in time fails with :class:`DeadlineExceeded`.

        ``waited_ms``: how long the request already waited before it reached the service (in an HTTP
        front-end worker): its deadline, given or the SLO, counts from then, so the scheduler drops
        what has no time left instead of serving it late. One that has waited its whole deadline
        fails with DeadlineExceeded at the scheduler's next look.

        ``checked_for``: the model config the caller has already checked ``inputs`` against, every
        name, dtype, shape and the row count (the server's protocol checks, remembered per request
        layout by the HTTP workers' bridge). While it is still the model's config, the checks are not
        made again; the rows are only split.

        The inputs are copied before this returns, unless they lie in memory the device reads in
        place (``device.pinned_empty`` or ``device.register_host``: a worker's shared arena, a load
        generator's pinned pool); those must stay unchanged until the request is answered.

        ``on_done``: instead of a future (None is returned), ``on_done(outputs, None)`` once served, or
        ``on_done(None, error)``; called once, on the thread that answers (the runtime's, mostly),
        under the service's lock: it must be short. Why: a future made, called back, resolved and read
        per request cost the runtime's thread about 11 us of CPU per request of the HTTP workers'
        bridge on the build VM, where the whole took 130 (``scripts/diag_intake_ab.py``). What it
        raises is logged.

        Raises (at once) UnknownModel, ModelNotReady, InvalidInput, Overloaded. The future fails (or
        ``on_done`` is given) with DeadlineExceeded, Dropped or ModelFailed.
        """
        m = self._models.get(name)
        if m is None:
            raise UnknownModel(f"no model {name!r} is loaded; loaded: {sorted(self._models)}")
        if m.state != "ready" or self._closed or not self._started:
            raise ModelNotReady(f"model {name!r} is not ready ({'service closed' if self._closed else m.state})")
        cfg = m.config
        if checked_for is cfg:  # checked by the caller against this very config: only split
            rows = _split_rows([inputs[t.name] for t in cfg.inputs], not self.device.stages)
        else:
            rows = self._rows(cfg, inputs)
        if deadline_ms is not None and not (isinstance(deadline_ms, (int, float)) and deadline_ms > 0):
            raise InvalidInput(f"deadline_ms must be a positive number of ms, got {deadline_ms!r}")
        timeout_ms = float(deadline_ms) if deadline_ms is not None else cfg.slo_ms
        if waited_ms > 0.0:  # (a NaN compares False: ignored)
            timeout_ms = max(timeout_ms - waited_ms, _NO_TIME_LEFT_MS)
        if m.in_flight >= self.queue_limit:  # cheap early answer before staging (checked again below)
            with self._lock:
                m.rejected += 1
            raise Overloaded(f"model {name!r} has {m.in_flight} requests waiting (limit {self.queue_limit})",
                             retry_after_s=self._retry_after(m))
        rt = self._runtime
        admit = rt.policy.admit_rps if rt is not None else None
        if admit and name in admit:
            wait = self._admit(m, admit[name], len(rows))
            if wait is not None:
                rt.note_refused(name, len(rows))
                raise Shed(f"model {name!r} is over its planned share: the policy admits {admit[name]:.0f} "
                           f"requests/s of it, less than its demand (the GPU, or its host, is overloaded)",
                           retry_after_s=wait)
        layer = self.device
        if layer.stages:  # CUDA: rows into pinned memory on this (the client's) thread, outside any lock
            if layer.is_pinned(rows[0] + rows[-1]):  # already there (a worker's arena): launched in place
                rows = [PinnedRow(r) for r in rows]
            else:
                rows = [layer.stage(r) for r in rows]
        with self._lock:
            if m.in_flight >= self.queue_limit:
                m.rejected += 1
                raise Overloaded(f"model {name!r} has {m.in_flight} requests waiting (limit {self.queue_limit})",
                                 retry_after_s=self._retry_after(m))
            call = _Call(m, len(rows), time.monotonic() + timeout_ms / 1000.0, deadline_ms is not None, on_done,
                         None if on_done is not None else RequestFuture(self._cancel_rows))
            m.accepted += 1
            m.arrivals.append(call.t0)
            try:
                reqs = rt.submit(name, rows, timeout_ms=timeout_ms)
            except RuntimeError as e:
                m.accepted -= 1
                raise ModelNotReady(f"model {name!r}: {e}") from e
            for i, r in enumerate(reqs):
                self._rid[r.id] = (call, i)
            rids = tuple(r.id for r in reqs)
            if call.future is not None:
                call.future.rids = rids
            heap = self._by_deadline
            heapq.heappush(heap, (call.deadline_s, rids))
            if len(heap) > _EXPIRY_PRUNE_FROM and len(heap) > 4 * len(self._rid):
                # mostly answered calls whose deadlines are far off (a client may ask for any): keep the
                # live ones only, or they stay until deadline + grace, for good with a huge deadline
                rid = self._rid
                heap[:] = [e for e in heap if any(i in rid for i in e[1])]
                heapq.heapify(heap)
        return call.future

    def infer(self, name: str, inputs: Mapping[str, np.ndarray], *, deadline_ms: float | None = None,
              timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """``submit(...).result(timeout_s)``; a request not answered within ``timeout_s`` is
        cancelled (its rows still queued leave the queue) before TimeoutError is raised."""
        fut = self.submit(name, inputs, deadline_ms=deadline_ms)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def _cancel_rows(self, rids: tuple[int, ...], reason: str) -> None:
        """Any thread (:class:`RequestFuture`): the rows of ``rids`` still queued leave their queues,
        answered Dropped(``reason``)."""
        rt = self._runtime
        if rt is not None:
            rt.cancel(rids, reason)

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per model counts, latency histograms (ms), batch sizes, goodput and SLO attainment; per
        partition SMs and busy ratio; totals (``accepted == success + failure + dropped + in_flight``)."""
        now = time.monotonic()
        with self._lock:
            per = {}
            tot = Counter()
            for name, m in self._models.items():
                age = max(1e-9, now - m.loaded_at)
                dropped = dict(m.dropped)
                answered = m.answered
                per[name] = {
                    "state": m.state,
                    "accepted": m.accepted,
                    "success": m.success,
                    "failure": m.failure,
                    "dropped": dropped,
                    "rejected": m.rejected,
                    "shed": m.shed,
                    "in_flight": m.in_flight,
                    "on_time": m.on_time,
                    "queue_ms": m.queue_ms.to_json(),
                    "compute_ms": m.compute_ms.to_json(),
                    "total_ms": m.total_ms.to_json(),
                    "batch_size": {str(k): v for k, v in sorted(m.batch.items())},
                    "goodput_rps": m.on_time / age,
                    # of the requests offered: answered, or refused for overload (a full queue, shed); as
                    # gpuloom bench and gpuloom load count it (a review, sixty-ninth session: 1.0 while 62%
                    # were refused 429)
                    "slo_attainment": m.on_time / offered if (offered := answered + m.rejected + m.shed) else 1.0,
                    "slo_ms": m.config.slo_ms,
                }
                for k in ("accepted", "success", "failure", "in_flight", "rejected", "shed", "on_time"):
                    tot[k] += per[name][k]
                tot["dropped"] += sum(dropped.values())
            be = self._backend.stats() if self._backend is not None else {"partitions": []}
            for name, mb in (be.get("model_batches") or {}).items():
                if name in per:  # batches of this model run since it was loaded (a reload goes on counting)
                    per[name]["exec_count"] = mb - self._models[name].exec_base
            rt = self._runtime
            idle = dict(rt.idle) if rt is not None else {}
            if rt is not None:  # times the answers stopped for a batch that finished meanwhile (a float, as the rest)
                idle["answer_yields"] = float(rt.answer_yields)
                idle["answer_ms"], idle["answered"] = rt.answer_ms, float(rt.answered)
                idle["intake_ms"], idle["taken_in"] = rt.intake_ms, float(rt.taken_in)
            swaps = rt.layout_swaps if rt is not None else 0
        return {
            "policy": self.policy_name,
            "device": self._layer.kind if self._layer is not None else None,
            "uptime_s": now - self._t_start,
            "models": per,
            "partitions": be.get("partitions", []),
            # the SM step partitions are planned in (coarser after a layout failed to build; see _replan)
            "partition_step_sms": (self._layer.granularity * self.granularity_factor) if self._layer is not None else None,
            "backend": be,
            "runtime": idle,
            "layout_swaps": swaps,  # layouts the current runtime switched to (re-plans, loads), the first included
            "gc": self._gc.snapshot(),  # the process's garbage-collector pauses (gcpause.GcMonitor)
            "unload_collections": self.unload_collections,  # unloads that collected at once (unload_collect_mib)
            "totals": dict(tot),
        }

    # -- internals ----------------------------------------------------------------------------
    def _rows(self, cfg: ModelConfig, inputs: Mapping[str, np.ndarray]) -> list[list[np.ndarray]]:
        """Validate ``inputs`` and split them into per-row payloads (copied once: the caller may reuse
        its arrays). Runs on every request, on the client's thread: kept lean (see _NP_DTYPES)."""
        if type(inputs) is not dict and not isinstance(inputs, Mapping):  # a dict skips the ABC check
            raise InvalidInput(f"inputs must be a dict of name -> numpy array; expected "
                               f"{', '.join(t.describe() for t in cfg.inputs)}")
        if set(inputs) != cfg.input_names:
            raise InvalidInput(f"model {cfg.name!r} expects inputs {[t.name for t in cfg.inputs]}, got {sorted(inputs)}")
        # the device copies each row when it stages it (CUDA: into pinned memory); else copy here,
        # as the caller may reuse its arrays once submit returns
        copy = not self.device.stages
        n = None
        arrays = []
        for spec in cfg.inputs:
            x = inputs[spec.name]
            if not isinstance(x, np.ndarray):
                raise InvalidInput(f"input {spec.name!r} must be a numpy array, got {type(x).__name__}; "
                                   f"expected {spec.describe()}")
            if x.dtype != _NP_DTYPES[spec.dtype]:
                raise InvalidInput(f"input {spec.name!r} has dtype {x.dtype}; expected {spec.describe()}")
            if x.ndim != len(spec.shape) + 1 or x.shape[1:] != spec.shape:
                raise InvalidInput(f"input {spec.name!r} has shape {tuple(x.shape)}; expected {spec.describe()} "
                                   f"(the first dimension is the rows of this request)")
            if n is None:
                n = x.shape[0]
            elif x.shape[0] != n:
                raise InvalidInput(f"inputs must have the same number of rows: {spec.name!r} has {x.shape[0]}, "
                                   f"{cfg.inputs[0].name!r} has {n}")
            arrays.append(x)
        if not 1 <= n <= cfg.max_batch:
            raise InvalidInput(f"model {cfg.name!r} takes 1..{cfg.max_batch} rows per request, got {n}")
        return _split_rows(arrays, copy)

    def _admit(self, m: _Model, rate: float, n: int) -> float | None:
        """None if ``n`` more rows of ``m`` may enter now at the policy's planned ``rate``
        (admission.py); else the seconds until they may, and the call is booked as rejected and shed,
        and as an arrival: the service's own re-plans (load, unload, failed layouts) plan for the
        whole demand, not for what was admitted."""
        now = time.monotonic()
        with self._lock:
            if m.admission.take(rate, n, now):
                return None
            m.rejected += 1
            m.shed += 1
            m.arrivals.append(now)
            return m.admission.wait_s(rate, n)

    def _retry_after(self, m: _Model) -> float:
        served_rate = m.success / max(1e-3, time.monotonic() - m.loaded_at)
        return float(min(10.0, max(0.05, m.in_flight / served_rate if served_rate > 0 else 1.0)))

    def _on_result(self, result: Result, out: ExecOutput | None) -> None:
        """Runtime thread: one row answered; resolve its request's future once every row is."""
        with self._lock:
            self._book_row(result, out, time.monotonic())

    def _on_results(self, answers: list[tuple[Result, ExecOutput | None]]) -> None:
        """Runtime thread: the rows of a batch (or of a drop) answered together: booked in order as
        :meth:`_on_result` books one, under one acquisition of the lock, with one clock reading, inside
        :attr:`answer_scope` (the server's: one wake-up per worker for the batch's replies)."""
        with self.answer_scope(len(answers)), self._lock:
            now = time.monotonic()
            for result, out in answers:
                try:
                    self._book_row(result, out, now)
                except Exception:  # noqa: BLE001 - as the runtime does per row: the others still get theirs
                    log.exception("booking the answer of request %d failed", result.request.id)

    def _book_row(self, result: Result, out: ExecOutput | None, now: float) -> None:
        """Under the lock: one row's answer into its request; settle the request once every row is in."""
        entry = self._rid.pop(result.request.id, None)
        if entry is None:
            return
        call, i = entry
        if out is not None and result.status is _SERVED:
            call.outputs[i] = out.outputs
            queue_ms = out.start_ms - result.request.arrival_ms
            if queue_ms > call.queue_ms:
                call.queue_ms = queue_ms
            compute_ms = out.end_ms - out.start_ms
            if compute_ms > call.compute_ms:
                call.compute_ms = compute_ms
            if out.batch > call.batch:
                call.batch = out.batch
        elif call.error is None:
            call.error = self._error_of(result, out)
        call.left -= 1
        if not call.left:
            self._settle(call, now)

    def _error_of(self, result: Result, out: ExecOutput | None) -> ServiceError:
        if result.status == Status.SERVED:
            return ModelFailed("the backend returned no output for this request")
        if result.status == Status.FAILED:
            return ModelFailed(f"model {result.request.model!r} failed: {result.reason}")
        if result.reason.startswith("deadline"):
            return DeadlineExceeded(f"request for {result.request.model!r} could not be served by its deadline "
                                    f"({result.request.deadline_ms - result.request.arrival_ms:.1f} ms)")
        return Dropped(result.reason or "unspecified")

    def _settle(self, call: _Call, now: float) -> None:
        """Under the lock: count the request's fate (at monotonic ``now``) and resolve its future (or
        call its ``on_done``)."""
        call.settled = True
        m = call.model
        if call.error is None and call.future is not None and call.future.cancelled():
            # its caller gave up on it (a gRPC client's cancel or deadline) after its rows were in a batch:
            # run, but answered to no one, as the server books it (the same outcome in both books)
            call.error = Dropped(CANCELLED)
        late = now > call.deadline_s + 1e-4
        if call.error is None and late and call.explicit:
            call.error = DeadlineExceeded(f"request for {m.config.name!r} finished after its deadline")
        if call.error is None:
            m.success += 1
            m.on_time += not late
            m.queue_ms.add(call.queue_ms)
            m.compute_ms.add(call.compute_ms)
            m.total_ms.add((now - call.t0) * 1000.0)
            m.batch[call.batch] += 1
            names = m.config.output_names
            if len(call.outputs) == 1:  # one row: a view of its batch's fresh output, no copy (the common case)
                result = {nm: call.outputs[0][j][None] for j, nm in enumerate(names)}
            else:
                result = {nm: np.stack([row[j] for row in call.outputs]) for j, nm in enumerate(names)}
            self._resolve(call, result, None)
        else:
            if isinstance(call.error, ModelFailed):
                m.failure += 1
            else:
                if isinstance(call.error, Expired):
                    reason = "expired"
                elif isinstance(call.error, Dropped):
                    reason = call.error.reason
                else:
                    reason = "deadline"
                m.dropped[reason] += 1
                m.n_dropped += 1
            self._resolve(call, None, call.error)
        if m.in_flight == 0:
            self._cv.notify_all()

    @staticmethod
    def _resolve(call: _Call, outputs: dict[str, np.ndarray] | None, error: ServiceError | None) -> None:
        """Give a settled request its answer: through its future, or its ``on_done`` (what that raises
        is logged, as a future logs what its callbacks raise)."""
        fut = call.future
        if fut is None:
            try:
                call.on_done(outputs, error)
            except Exception:  # noqa: BLE001 - the other requests of the batch still get theirs
                log.exception("the answer callback of a %s request failed", call.model.config.name)
            return
        try:
            if error is None:
                fut.set_result(outputs)
            else:
                fut.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # its caller cancelled the future (an HTTP client gone): booked all the same

    def _expire_loop(self) -> None:
        """Every quarter second (at most), answer the requests left unanswered past deadline + grace."""
        period = min(0.25, self.expiry_grace_s / 4)
        while not self._expiry_stop.wait(period):
            self.expire_overdue(time.monotonic())

    def policy_summary(self, timeout_s: float = 5.0) -> dict:
        """The running policy's own summary (``Policy.describe``: dstack's partitions, batches,
        re-plans and slowdowns), read on the loop's thread (a re-plan there replaces the schedule
        field by field); empty when the service is not running or the loop does not answer in time."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.call_on_loop_at(0.0, lambda: done.set_result(self._runtime.policy.describe()))
            return done.result(timeout_s)
        except (ModelNotReady, concurrent.futures.TimeoutError):
            return {}

    def expire_overdue(self, now: float) -> int:
        """Answer with :class:`Expired` every request unanswered ``expiry_grace_s`` after its deadline
        (monotonic ``now``, s); returns how many. Their late results from the runtime are ignored.

        A request its model's queue still holds waited for a policy that serves late requests rather
        than drop them (triton, clipper, temporal under overload): one warning per model and sweep, and
        the runtime takes it out of the queue (:meth:`Runtime.cancel`) so that it runs on no GPU. One
        the runtime took and never answered is a runtime bug: an error each."""
        limit = now - self.expiry_grace_s
        overdue = []
        rt = self._runtime
        with self._lock:
            heap = self._by_deadline  # (deadline, the call's runtime ids), earliest first
            while heap and heap[0][0] < limit:
                _, rids = heapq.heappop(heap)
                calls = [e[0] for e in (self._rid.pop(rid, None) for rid in rids) if e is not None]
                if calls and not calls[0].settled:  # else answered in time, the usual case
                    waits = rt is not None and any(rt.is_queued(rid) for rid in rids)
                    overdue.append((calls[0], waits))
                    if waits:  # out of its queue: answered now, it takes no GPU time after
                        rt.cancel(rids, "expired")
            queued: dict[str, list[float]] = {}
            for call, waits in overdue:
                name, past = call.model.config.name, now - call.deadline_s
                if waits:
                    queued.setdefault(name, []).append(past)
                else:
                    log.error("model %s: a request was not answered by the runtime %.1f s after its deadline; "
                              "answering it as expired (a runtime bug: please report it)", name, past)
                call.error = Expired(f"request for {name!r} was not answered within "
                                     f"{self.expiry_grace_s:g} s of its deadline")
                self._settle(call, time.monotonic())
        for name, past in queued.items():
            log.warning("model %s: %d request(s) still queued %.1f-%.1f s after their deadlines under policy "
                        "%r, answered as expired: the model is served below its load", name, len(past),
                        min(past), max(past), self.policy_name)
        return len(overdue)

    def _fail_outstanding(self, reason: str) -> None:
        """Answer every request still unanswered (after the runtime stopped) with Dropped(reason)."""
        with self._lock:
            calls = {id(c): c for c, _ in self._rid.values()}
            self._rid.clear()
            for call in calls.values():
                if not call.settled:
                    call.error = call.error or Dropped(reason)
                    self._settle(call, time.monotonic())

    def _on_layout(self, layout: Layout, error: BaseException | None) -> None:
        rt = self._runtime
        if rt is not None:
            policy = rt.layout_policy  # the policy this layout was for (a failed switch keeps the old one current)
            with self._lock:
                if id(policy) not in self._layout_waiting:
                    return  # a later layout of a policy already set up (a re-plan): nobody waits on it
                if id(policy) not in self._layout_seen and error is not None:
                    self._layout_failed[id(policy)] = layout
                self._layout_seen.setdefault(id(policy), error)
                self._cv.notify_all()

    def _context(self) -> PolicyContext:
        now = time.monotonic()
        infos = {}
        for name, m in self._models.items():
            rate = m.rate(now)
            infos[name] = ModelInfo(name, m.profile, float(m.config.slo_ms), float(m.config.weight),
                                    float(rate if rate is not None else m.config.rate_hint))
        dev = self.device
        return PolicyContext(infos, dev.gpu_sms, dev.granularity * self.granularity_factor, simulated=False)

    def _replan(self) -> BaseException | None:
        """Serve the current model set with a fresh policy; if its first layout fails to build and has
        exclusive partitions smaller than twice the planning step, plan again with partitions in steps
        twice as large (up to ``MAX_PARTITION_STEP_SMS``). Returns the last layout error, if any.
        Called with ``_admin`` held."""
        policy_id: list[int] = []
        err = self._replan_once(policy_id)
        while err is not None and isinstance(err, RuntimeError) and policy_id:
            failed = self._layout_failed.pop(policy_id[-1], None)
            step = self.device.granularity * self.granularity_factor
            small = [p.sms for p in (failed.partitions if failed is not None else ()) if not p.shared and p.sms < 2 * step]
            rt = self._runtime
            if not small or 2 * step > MAX_PARTITION_STEP_SMS or rt is None or not rt.running:
                break
            self.granularity_factor *= 2
            log.warning("layout %r failed to build (%s: %s); planning partitions in steps of %d SMs instead of %d",
                        failed, type(err).__name__, err, 2 * step, step)
            err = self._replan_once(policy_id)
        with self._lock:
            for pid in policy_id:  # failures that were not retried: nobody will read them
                self._layout_failed.pop(pid, None)
        self._place_loop()  # the model set changed: the host (host_loop_on) may take the loop, or give it back
        return err

    def _not_on_host(self, what: str) -> None:
        """A re-plan waits for the loop to set the new layout up: on the host's thread (host_loop_on)
        that wait would never end."""
        rt = self._runtime
        if rt is not None and rt.on_host_thread():
            raise RuntimeError(f"{what} cannot run on the thread whose event loop runs the runtime's loop "
                               f"(host_loop_on): it waits for that loop; call it in an executor (loop.run_in_executor)")

    def _replan_once(self, policy_id: list[int]) -> BaseException | None:
        """Serve the current model set with a fresh policy object; wait until its first layout is up.
        Returns the layout's error, if any (``policy_id`` gets the policy's id)."""
        with self._lock:
            if not self._models:
                rt, self._runtime = self._runtime, None
            else:
                rt = None
            ctx = self._context() if self._models else None
        if ctx is None:  # no model left: stop the runtime (a later load starts a new one)
            if rt is not None:
                rt.stop(drain=True, timeout_s=self.load_timeout_s)
                if rt.running:  # its loop thread did not end: it would take the next loop's posts
                    log.error("the runtime's loop did not stop within %.0f s; the next one sleeps on a new "
                              "semaphore (front-end workers connected now wake it only through their "
                              "drain threads)", self.load_timeout_s)
                    self._waker = self._shared_waker()
                self._fail_outstanding("model unloaded")
                be, self._backend = self._backend, None
                if be is not None:
                    self._backend_stats.append(be.stats())
                    be.close(keep_device=True)
            return None
        policy = make_policy(self.policy_name, **self.policy_options)
        policy_id.append(id(policy))
        with self._lock:
            self._layout_waiting.add(id(policy))
        if self._runtime is None:
            self._backend = ExecBackend(self.device, knee=self._knee, lookahead_ms=self.lookahead_ms,
                                        launch_on=self.resolved_launch_on(), complete_on=self.complete_on,
                                        waker=self._waker)
            with self._lock:
                for poll in self._intakes:
                    self._backend.loop.add_poller(poll)
            self._hook_early_answer()
            self._runtime = Runtime(policy, self._backend, ctx)
            self._runtime.start(self._on_result, on_layout=self._on_layout, on_results=self._on_results)
        else:
            self._runtime.reconfigure(policy, ctx)
        with self._lock:
            rt = self._runtime
            deadline = time.monotonic() + self.load_timeout_s
            while id(policy) not in self._layout_seen and rt.running and time.monotonic() < deadline:
                self._cv.wait(0.2)  # woken by _on_layout; the timeout notices a crashed loop
            self._layout_waiting.discard(id(policy))
            if id(policy) in self._layout_seen:
                err = self._layout_seen.pop(id(policy))
            elif not rt.running:
                err = rt.error or RuntimeError("the runtime loop stopped")
            else:
                err = TimeoutError(f"no layout after {self.load_timeout_s} s")
        return err

    def _knee(self, model: str, batch: int) -> int:
        m = self._models.get(model)
        if m is None:
            return self.device.gpu_sms
        knee = m.knee_by_batch.get(batch)
        if knee is None:
            p = m.profile
            knee = m.knee_by_batch[batch] = p.knee(p.bucket(min(batch, p.max_batch)))
        return knee

    def _compiled(self, models: Sequence[tuple[ModelConfig, Any]]) -> list["_Model"]:
        """Each model compiled and profiled (the slow, failure-prone part of a load or a reload), as
        the entry the service will keep for it; none is added to the service here."""
        entries = []
        # compiling (torch.export, planning streams) is long pure Python; with models being served,
        # hand the GIL over every LOAD_SWITCH_INTERVAL_MS so their requests are not held up for
        # whole 5 ms slices at each of their threads' hand-offs (see LOAD_SWITCH_INTERVAL_MS)
        ShortSwitchInterval.enter(LOAD_SWITCH_INTERVAL_MS)
        try:
            for config, module in models:
                # on the device's build thread, where the captures run: cuDNN's timings made while
                # compiling are kept per thread, and the captures then find them (device.Builder)
                runner, config, profile = self.device.builder.call(
                    lambda config=config, module=module: self._compile_and_profile(config, module))
                entries.append(_Model(config, profile, runner, held_bytes=_held_bytes(module, runner)))
        finally:
            ShortSwitchInterval.leave(LOAD_SWITCH_INTERVAL_MS)
        return entries

    def _compile_and_profile(self, config: ModelConfig, module: Any) -> tuple[Any, ModelConfig, Profile]:
        """One model's share of a load, run on the device's builder thread (see ``load_many``)."""
        with self.device.exclusive():  # no graph capture of a re-plan may run meanwhile
            t0 = time.perf_counter()
            runner, config = self._compile_reclaiming(config, module)
            t1 = time.perf_counter()
            profile = profile_for(config, runner, self.device, self.profiles, measure=self.measure_profiles,
                                  cache_dir=self.profile_cache)
        cached = getattr(getattr(runner, "graph", None), "graph_from_cache", False)
        log.info("model %s: compiled in %.1f s%s, profile in %.1f s", config.name, t1 - t0,
                 " (its export graph from the graph cache)" if cached else "", time.perf_counter() - t1)
        return runner, config, profile

    def _compile_reclaiming(self, config: ModelConfig, module: Any) -> tuple[Any, ModelConfig]:
        """:meth:`_compile`, once more after a full collection if it ran out of memory: an unloaded
        model's weights are freed only by one (``gcpause.thaw``), which ``RareFullCollections`` makes
        rare, so a load made to fit in their place would otherwise fail (``DeviceLayer.build`` does
        the same for captures)."""
        try:
            return self._compile(config, module)
        except Exception as e:  # noqa: BLE001 - only out-of-memory errors are retried
            if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"):
                raise
            freed = self.device.reclaim()
            log.info("out of memory compiling %r (%s); collected garbage (%s), retrying once", config.name, e, freed)
        return self._compile(config, module)

    def _compile(self, config: ModelConfig, module: Any) -> tuple[Any, ModelConfig]:
        """:func:`~gpuloom.runtime.model_compile.compile_model` on this service's device (a method, so
        that diagnostics and tests can time or replace one load's compile)."""
        return compile_model(config, module, self.device)


__all__ = [
    "CANCELLED", "DeadlineExceeded", "Dropped", "Expired", "Histogram", "InferenceService", "InvalidInput", "ModelConfig", "ModelFailed",
    "ModelNotReady", "Overloaded", "ServiceError", "Shed", "TensorSpec", "UnknownModel", "crude_profile", "trim_profile",
]
