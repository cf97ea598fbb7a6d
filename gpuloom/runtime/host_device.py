"""Device layers without a GPU: the CPU path that serves on any machine, and a fake for the tests.

* :class:`CpuDeviceLayer` -- runs each batch through ``CompiledModel.__call__`` (its CPU path) in the
  lane's watcher thread; what ``gpuloom serve --device cpu`` and the CI serve on.
* :class:`FakeDeviceLayer` -- numpy functions with a configurable latency and injected failures: the
  runtime's and the service's tests.
* :class:`ProfiledFakeLayer` -- a fake whose batches take their profile's time from their launch: the
  diagnostics that replay a GPU's profiled latencies against the simulator's.

The contract they implement is :class:`~gpuloom.runtime.device.DeviceLayer`. Neither imports torch at
import time.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..policy.types import Layout
from .device import DeviceLayer, Lanes, Rows, allowed, cpu_numpy_outputs

log = logging.getLogger(__name__)


@dataclass
class FakeModel:
    """A stand-in model: ``fn`` maps batched numpy inputs to batched numpy outputs."""

    fn: Callable[[list[Any]], list[Any]]
    latency_ms: Callable[[int], float] | float = 1.0  # per batch of n rows
    graph_bytes: int = 0  # graph memory one capture of it takes (for the memory-budget tests)


@dataclass
class _FakeTicket:
    model: FakeModel
    batch: list[Any]
    n: int
    name: str
    lane: tuple[int, int]  # (id(lanes), lane index)
    due: float | None = None  # perf_counter when the batch is done (set by notify, or at launch by ProfiledFakeLayer)
    ends: float | None = None  # without notify: when its sleep in finish ends (set as it begins)
    sms: float | None = None  # the SMs it runs on (ProfiledFakeLayer)


class _PostTimer:
    """One thread that posts wakers at given times, as a CUDA stream's host function would: through
    the waker's C entry point where it has one, from a thread that is not the loop's. One for the
    process (:meth:`shared`): fake devices come and go in the tests, the thread stays."""

    _instance: "_PostTimer | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> "_PostTimer":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Any]] = []  # heap of (perf_counter, seq, waker)
        self._cv = threading.Condition()
        self._seq = 0
        threading.Thread(target=self._run, name="gpuloom-fake-device-timer", daemon=True).start()

    def post_at(self, when: float, waker: Any) -> None:
        with self._cv:
            heapq.heappush(self._due, (when, self._seq, waker))
            self._seq += 1
            self._cv.notify()

    def _run(self) -> None:
        import ctypes

        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.perf_counter():
                    self._cv.wait(None if not self._due else self._due[0][0] - time.perf_counter())
                wakers = []
                while self._due and self._due[0][0] <= time.perf_counter():
                    wakers.append(heapq.heappop(self._due)[2])
            for w in {id(w): w for w in wakers}.values():  # one post per waker for batches due together
                try:
                    c_post = getattr(w, "c_post", None)
                    if c_post is not None:  # what cuLaunchHostFunc does: call the C function
                        fn, arg = c_post
                        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(arg)
                    else:
                        w.post()
                except Exception:  # noqa: BLE001 - one bad waker must not stop the posts of every later test
                    log.exception("posting a fake device's waker failed")


class FakeDeviceLayer(DeviceLayer):
    """Batches "run" by sleeping in the watcher thread, then applying the model's numpy function.

    The sleep starts when the lane's watcher gets to the batch, not at its launch as on a GPU: a
    watcher waiting for the interpreter while the loop's thread works after a launch (answering
    drops, say) delays the batch as no GPU would. Diagnostics that compare timings with a GPU's or
    the simulator's time batches from their launch instead (:class:`ProfiledFakeLayer`); the tests'
    books and orders do not depend on it (made the default, it broke ``busy >= device`` for batches
    launched ahead: a launch-timed batch's device time overlaps the host's notice of the one before it).

    With :meth:`notify` (the runtime's loop books completions) a batch is instead done ``latency``
    after its lane's previous one (:meth:`_due_at`), and one timer thread posts the waker then,
    through its C entry point where it has one (as a CUDA stream would). ``build_delay_s`` makes builds slow
    (background-build tests); ``inject_fault`` fails a model.
    """

    kind = "fake"
    builds_while_serving = True

    def __init__(self, *, gpu_sms: int = 132, granularity: int = 8, build_delay_s: float = 0.0,
                 memory_limit_bytes: float = float("inf"), cache_layouts: int = 4) -> None:
        super().__init__(memory_limit_bytes=memory_limit_bytes, cache_layouts=cache_layouts)
        self.gpu_sms, self.granularity = gpu_sms, granularity
        self.build_delay_s = build_delay_s
        self.builds = 0
        self.fail_in_finish: dict[str, str] = {}  # model -> error raised while "running" (not at launch)
        self.can_notify = True
        self._lane_due: dict[tuple[int, int], float] = {}  # (id(lanes), lane) -> when its last batch is done

    def _estimate(self, layout: Layout, models: Sequence[str]) -> float:
        return float(sum(self.models[m].graph_bytes for p in layout.partitions for m in models if allowed(p, m)))

    def _build(self, lanes: Lanes) -> None:
        if self.build_delay_s:
            time.sleep(self.build_delay_s)
        self.builds += 1
        lanes.memory_bytes = int(self._estimate(lanes.layout, lanes.models))
        lanes.state = {m: self.models[m] for m in lanes.models}

    def _launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any:
        import numpy as np

        fm: FakeModel = lanes.state[model]
        batch = [np.stack([r[j] for r in rows]) for j in range(len(rows[0]))]
        return _FakeTicket(fm, batch, len(rows), model, (id(lanes), index))

    def _latency_ms(self, t: _FakeTicket) -> float:
        return t.model.latency_ms(t.n) if callable(t.model.latency_ms) else float(t.model.latency_ms)

    def notify(self, ticket: Any, waker: Any) -> bool:
        if not self.can_notify:
            return False
        if ticket.due is None:  # (a ProfiledFakeLayer batch is timed from its launch already)
            ticket.due = self._due_at(ticket, time.perf_counter())
        _PostTimer.shared().post_at(ticket.due, waker)
        return True

    def _due_at(self, ticket: _FakeTicket, now: float) -> float:
        """When (perf_counter) the batch of ``ticket``, launched ``now``, is done: its latency after
        its lane's previous batch. A subclass with a device timeline of its own overrides this."""
        due = max(now, self._lane_due.get(ticket.lane, 0.0)) + self._latency_ms(ticket) / 1000.0
        self._lane_due[ticket.lane] = due
        return due

    def is_done(self, ticket: Any) -> bool:
        return ticket.due is None or time.perf_counter() >= ticket.due

    def done_yet(self, ticket: Any) -> bool:
        due = ticket.due if ticket.due is not None else ticket.ends
        return due is not None and time.perf_counter() >= due

    def finish(self, ticket: Any) -> tuple[list[Any], float]:
        ms = self._latency_ms(ticket)
        t0 = time.perf_counter()
        if ticket.due is None:
            ticket.ends = t0 + ms / 1000.0
            time.sleep(ms / 1000.0)
        elif t0 < ticket.due:
            time.sleep(ticket.due - t0)
        err = self.fail_in_finish.get(ticket.name)
        if err:
            raise RuntimeError(err)
        out = ticket.model.fn(ticket.batch)
        return list(out), (time.perf_counter() - t0) * 1000.0 if ticket.due is None else ms


class ProfiledFakeLayer(FakeDeviceLayer):
    """A fake GPU that runs exactly as profiled: a batch takes its model's profiled latency at its bucket
    on its partition's SMs (a shared lane: the SMs it shares, as if it ran alone: shared lanes do not slow
    each other here, so only one-lane policies and exclusive partitions meet the simulator like for like).

    As on a stream, a batch runs from its launch, or from its lane's previous batch's end if later, not
    from when its lane's watcher gets to it (:class:`FakeDeviceLayer`'s plain timing charges the loop's
    work after a launch to the batch). ``profiles``: anything whose ``get(model)`` gives a
    :class:`~gpuloom.profile.store.Profile` (a dict, a ``ProfileStore``). ``host_ms``: host time spent per
    launch on the launching thread, half in Python holding the interpreter and half sleeping (the CUDA
    layer's launches take ~0.3 ms, some of it in calls that release the interpreter)."""

    def __init__(self, profiles: Any, *, host_ms: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.profiles = profiles
        self.host_ms = host_ms

    def _launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any:
        if self.host_ms > 0:
            end = time.perf_counter() + self.host_ms / 2000.0
            while time.perf_counter() < end:
                pass
            time.sleep(self.host_ms / 2000.0)
        ticket = super()._launch(lanes, index, model, rows)
        ticket.sms = lanes.layout.partitions[index].sms
        ticket.due = self._due_at(ticket, time.perf_counter())  # finish() sleeps until then
        return ticket

    def _latency_ms(self, t: _FakeTicket) -> float:
        return self.profiles.get(t.name).latency(t.n, t.sms)


def batch_inputs(torch: Any, np: Any, rows: Rows) -> list[Any]:
    """One tensor per input holding the batch's rows. A single row is copied from a view with a batch
    axis (a copy: the model may write into its input): 58 us against ``np.stack``'s 96 (median) after
    10 ms idle on the build VM, as at 100 requests/s (``scripts/diag_cpu_batch_cold.py``)."""
    if len(rows) == 1:
        return [torch.from_numpy(x[None].copy()) for x in rows[0]]
    return [torch.from_numpy(np.stack([r[j] for r in rows])) for j in range(len(rows[0]))]


# ------------------------------------------------------------------------------------------------
class CpuDeviceLayer(DeviceLayer):
    """Runs each batch through ``CompiledModel.__call__`` (its CPU path) in the lane's watcher thread.

    Lanes are no-ops (nothing is confined on a CPU); a model's calls are serialized by a lock, as
    the compiled executor is not known to be re-entrant. ``gpu_sms``/``granularity`` are the
    nominal H200 ones, so plans made for the GPU validate unchanged.
    """

    kind = "cpu"
    builds_while_serving = True  # a CPU "build" captures nothing

    def __init__(self, *, gpu_sms: int = 132, granularity: int = 8, threads: int | None = None) -> None:
        super().__init__()
        import torch

        self._torch = torch
        self.gpu_sms, self.granularity = gpu_sms, granularity
        if threads:
            torch.set_num_threads(threads)
        self._locks: dict[str, threading.Lock] = {}

    def add_model(self, name: str, model: Any) -> None:
        self._locks.setdefault(name, threading.Lock())
        super().add_model(name, model)

    def _build(self, lanes: Lanes) -> None:
        lanes.state = {m: self.models[m] for m in lanes.models}

    def _launch(self, lanes: Lanes, index: int, model: str, rows: Rows) -> Any:
        return (lanes.state[model], self._locks[model], rows)

    def finish(self, ticket: Any) -> tuple[list[Any], float]:
        import numpy as np

        cm, lock, rows = ticket
        torch = self._torch
        xs = batch_inputs(torch, np, rows)
        t0 = time.perf_counter()
        with lock, torch.inference_mode():
            out = cm(*xs)
        ms = (time.perf_counter() - t0) * 1000.0
        return cpu_numpy_outputs(out, len(rows)), ms


__all__ = ["CpuDeviceLayer", "FakeDeviceLayer", "FakeModel"]
