"""Where the online runtime's loop runs, and what feeds it from outside the service's own threads.

:class:`LoopHosting` holds the methods of :class:`~gpuloom.runtime.service.InferenceService` that
place the runtime's loop (on a thread of its own, or stepped by the HTTP server's event loop:
:meth:`~LoopHosting.host_loop_on`), run a client's callbacks on it (:meth:`~LoopHosting.call_on_loop_at`),
register the front-end workers' intakes that wake it from other processes
(:meth:`~LoopHosting.add_intake`), and report its lag and CPU. ``InferenceService`` inherits them;
split out of ``service.py``.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable

from .errors import ModelNotReady
from .events import ARRIVAL
from .model_profiles import longest_batch_ms
from .waker import make_waker

# the service's logger: these are its methods, and their records keep the name they always had
log = logging.getLogger("gpuloom.runtime.service")


class LoopHosting:
    """A mixin of :class:`~gpuloom.runtime.service.InferenceService`: the runtime loop's placement
    and outside feeds. Not usable alone; it relies on these attributes of the service:

    * ``_lock`` (the service's ``RLock``), ``_started``, ``_closed``;
    * ``_runtime`` (the :class:`~gpuloom.runtime.core.Runtime` serving now, or None) and ``_backend``
      (its :class:`~gpuloom.runtime.exec_backend.ExecBackend`, or None);
    * ``_models`` (name -> the model's books, ``_Model``: its ``profile``);
    * ``device`` (the :class:`~gpuloom.runtime.device.DeviceLayer`: its ``kind``) and
      ``resolved_launch_on()``;
    * ``_waker`` (set in ``__init__`` from :meth:`_shared_waker`), ``_intakes`` (a list),
      ``_host`` and ``_host_batch_limit_ms`` (both None until :meth:`host_loop_on`).
    """

    def call_on_loop_at(self, when_s: float, fn: Any) -> None:
        """Run ``fn()`` on the runtime's loop thread at monotonic time ``when_s`` (s), or as soon as it
        can if that has passed. For a client that shares the loop's thread instead of a thread of its
        own (the bench's ``arrivals=loop``: no other Python thread competes for the interpreter).

        A call already due waits its turn behind the completions and submissions posted before it, so
        a client that falls behind cannot starve the runtime's own work (a timer set in the past would
        run before them, and a client that keeps catching up would keep the policy from dispatching).
        ``fn`` must be short; what it raises is logged, and does not stop the loop."""
        rt = self._runtime
        if rt is None or not self._started or self._closed:
            raise ModelNotReady("the service is not running")
        loop = rt.loop  # a RealtimeLoop: the service's runtime serves online (Runtime.start checks)

        def guarded() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a client's error must not stop the runtime
                log.exception("a callback run on the runtime's loop failed")

        def schedule() -> None:  # on the loop's thread
            delay_ms = (when_s - time.monotonic()) * 1000.0
            if delay_ms > 0:
                loop.schedule(loop.wall_ms() + delay_ms, ARRIVAL, guarded)
            else:
                loop.post(ARRIVAL, guarded)

        if when_s <= time.monotonic():
            loop.post(ARRIVAL, guarded)
        else:
            loop.post(ARRIVAL, schedule)

    def _shared_waker(self) -> Any:
        """A loop semaphore other processes can post (``make_waker(shared=True)``), its descriptor
        closed once this service is gone."""
        waker = make_waker(shared=True)
        weakref.finalize(self, waker.close)
        return waker

    def host_loop_refusal(self) -> str | None:
        """Why the runtime's loop cannot run on another event loop (:meth:`host_loop_on`), or None."""
        if self.device.kind != "cpu" or self.resolved_launch_on() != "inline":
            return (f"the runtime's loop can run on the HTTP server's event loop only on the CPU device with inline "
                    f"launches; this service runs on {self.device.kind!r} with launch_on={self.resolved_launch_on()!r}")
        if self._intakes:
            return ("the runtime's loop cannot run on the HTTP server's event loop while front-end workers feed it "
                    "(they wake the runtime's own thread)")
        return None

    def host_loop_on(self, host: Any, *, longest_batch_ms: float | None = None) -> None:
        """Run the runtime's loop on ``host`` (the HTTP server's asyncio event loop, running) instead
        of on the runtime's thread: now, and for every runtime a later load starts. Each request is
        then queued, decided, computed and answered on the host's thread, with no hand-off per
        request (``Runtime.host_on``; ``gpuloom serve --runtime-on http``). The CPU device only,
        with inline launches: on a GPU the loop sleeps on a semaphore the device posts; front-end
        workers (:meth:`add_intake`) post it from their processes, so they cannot be used with it.
        ValueError says why not (:meth:`host_loop_refusal`). Undo with :meth:`unhost_loop`. While
        hosted, :meth:`loop_cpu`'s thread figure is the whole host thread's (HTTP included).

        ``longest_batch_ms``: host the loop only while every loaded model's largest batch takes at
        most this long (its profile, timed at load): everything else the host does waits for the
        batch running, so a model with long batches would hold health checks and other models'
        requests up for as long. Decided again after each load and unload (``--runtime-on auto``)."""
        with self._lock:
            why = self.host_loop_refusal()
            if why is not None:
                raise ValueError(why)
            self._host = host
            self._host_batch_limit_ms = longest_batch_ms
        self._place_loop()

    def unhost_loop(self) -> None:
        """The runtime's loop goes back to a thread of its own (``Runtime.take_back``): before the
        host stops, or while it must stay free (a server draining answers new connections meanwhile)."""
        with self._lock:
            self._host = None
            rt = self._runtime
        if rt is not None:
            rt.take_back()

    @property
    def loop_hosted(self) -> bool:
        """Whether the runtime's loop is to run on the host's event loop now (:meth:`host_loop_on`
        was called and the loaded models' batches are short enough); the hand-over itself is posted
        to the loop and happens at its next event."""
        with self._lock:
            return self._host_wanted() is not None

    def _host_wanted(self) -> Any:
        """The host the loop should run on for the models loaded now, or None. Called with ``_lock``."""
        limit = self._host_batch_limit_ms
        if self._host is None or limit is None:
            return self._host
        if all(longest_batch_ms(m.profile) <= limit for m in self._models.values()):
            return self._host
        return None

    def _place_loop(self) -> None:
        """Hand the runtime's loop to the host, or back to a thread of its own, as :meth:`host_loop_on`
        asked and the loaded models allow (both are no-ops where the loop already is)."""
        with self._lock:
            rt = self._runtime
            host = self._host_wanted()
        if rt is None:
            return
        if host is not None:
            rt.host_on(host)
            return
        if rt.hosted:
            log.info("a loaded model's batches take longer than %.1f ms: the runtime's loop runs on its own thread",
                     self._host_batch_limit_ms)
        rt.take_back()  # (also cancels a hand-over host_on posted that has not happened yet)

    def add_intake(self, poll: Callable[[], float]) -> int | None:
        """Run ``poll()`` on the runtime's loop thread each time it wakes, now and after any re-plan
        (``RealtimeLoop.add_poller``'s contract: it returns how soon it wants to be called again, ms, or
        ``inf``). A source of requests that other processes queue in shared memory (the HTTP workers'
        rings, ``serve/bridge.py``): submitted from the loop's own thread, with no thread to wake and
        no GIL hand-off. Returns a new descriptor of the loop's semaphore (the caller passes it on and
        closes it): a process that maps it (``SemaphoreWaker.attach``) and posts it wakes the loop.
        None when the loop cannot be woken from another process: ``poll`` is then not registered.
        Adding a ``poll`` already registered only hands out another descriptor (one poller can serve
        many producers, each with its own descriptor); one :meth:`remove_intake` removes it."""
        fd = self._waker.share_fd
        if fd is None:
            return None
        with self._lock:
            if self._host is not None:
                raise ValueError("front-end workers cannot feed a runtime whose loop runs on the HTTP server's event "
                                 "loop (host_loop_on): they wake the runtime's own thread")
            mine = os.dup(fd)  # first: if it fails (no descriptors left), nothing is registered
            if poll not in self._intakes:
                self._intakes.append(poll)
                if self._backend is not None:
                    self._backend.loop.add_poller(poll)
        return mine

    def hold_intake_posts(self, until_s: float) -> None:
        """An intake's promise (on the loop's thread): its poller will be called at monotonic
        ``until_s`` (it asked the loop for that call), so the processes feeding it need not wake the
        loop before then (``SemaphoreWaker.post_unless_quiet``): their requests wait for that call
        without a wake-up each (``serve/bridge.py``'s intake window)."""
        self._waker.quiet_until(until_s)

    def remove_intake(self, poll: Callable[[], float]) -> None:
        with self._lock:
            # the object registered, which an equal one (a bound method made anew) is not: the loop
            # removes by identity
            registered = next((p for p in self._intakes if p == poll), None)
            if registered is None:
                return
            self._intakes.remove(registered)
            if self._backend is not None:
                self._backend.loop.remove_poller(registered)

    def loop_lag(self, since: float) -> dict:
        """How late the runtime's loop took submissions and completions since monotonic ``since`` (s):
        counts over 1 / 5 / 20 ms and the longest (ms); see ``RealtimeLoop.lag_since``."""
        rt = self._runtime
        loop = rt.loop if rt is not None else None
        return loop.lag_since(since) if hasattr(loop, "lag_since") else {}

    def loop_cpu(self, on: bool | None = None) -> dict:
        """Where the runtime loop's thread spends its CPU, per callback and poller
        (``RealtimeLoop.account_cpu`` / ``cpu_report``). ``on=True`` starts charging (off by default,
        see its cost there), ``on=False`` stops; either way the report so far is returned (empty while
        no runtime exists: before the first load, after the last unload). A load after the last
        unload starts a new runtime, with charging off. Two reports apart give a window:
        ``events.cpu_delta``."""
        rt = self._runtime
        loop = rt.loop if rt is not None else None
        if not hasattr(loop, "cpu_report"):
            return {}
        if on is not None and (on != (loop.cpu is not None)):
            loop.account_cpu(on)
        return loop.cpu_report()
