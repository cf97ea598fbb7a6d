"""A discrete-event loop: a heap of (time, priority, sequence, callback), after SimPy's core.

The sequence number makes simultaneous events deterministic: at equal time and priority, events run
in the order they were scheduled. :class:`EventLoop` keeps a simulated clock that jumps to the next
event; a wall-clock loop for the GPU backend overrides :meth:`EventLoop._advance` (wait until the
event's time, or until a completion is posted) -- the same split as SimPy's ``Environment`` and
``RealtimeEnvironment``.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any, Callable

# Priorities at equal times: completions free partitions before arrivals are queued, and both
# happen before policy wake-ups, so a policy decides on the fullest picture of "now".
COMPLETION = 0
ARRIVAL = 1
WAKEUP = 2


class EventLoop:
    """Simulated-time event loop. ``now`` is in ms.

    Who calls what: backends and the runtime call :meth:`schedule`; only the runtime calls
    :meth:`step`.
    """

    def __init__(self, start_ms: float = 0.0) -> None:
        self.now: float = float(start_ms)
        self._heap: list[tuple[float, int, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def schedule(self, time_ms: float, priority: int, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` at ``time_ms`` (not before ``now``)."""
        if time_ms < self.now:
            assert self.now - time_ms < 1e-6, f"event scheduled in the past: {time_ms} < {self.now}"
            time_ms = self.now
        heappush(self._heap, (time_ms, priority, self._seq, callback, args))
        self._seq += 1

    def peek(self) -> float:
        """Time of the next event, or +inf when there is none."""
        return self._heap[0][0] if self._heap else float("inf")

    def step(self) -> bool:
        """Advance to the next event and run it. Returns False when no event is left."""
        if not self._heap:
            return False
        time_ms, _, _, cb, args = heappop(self._heap)
        self._advance(time_ms)
        cb(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)

    def _advance(self, time_ms: float) -> None:
        """Move the clock to ``time_ms``. Simulated: jump. A real-time loop waits here."""
        self.now = time_ms


class RealtimeLoop(EventLoop):
    """Wall-clock event loop for a GPU backend: ``now`` follows ``time.monotonic()`` (ms since start).

    :meth:`step` sleeps until the next event is due, waking early when another thread
    :meth:`post`\\ s one (a completion watcher) or the GPU posts :attr:`waker`. Events scheduled in
    the past run at once, in heap order. Like SimPy's ``RealtimeEnvironment``, only the clock differs
    from :class:`EventLoop`.
    """

    def __init__(self, start_ms: float = 0.0, waker: Any = None) -> None:
        """``waker``: what the loop's thread sleeps on (default: a new ``make_waker()``); a service
        passes its own so that other processes holding it wake every loop it runs."""
        import threading
        import time

        from .waker import make_waker

        super().__init__(start_ms)
        self._time = time
        self._t0 = time.monotonic() - start_ms / 1000.0
        self._mu = threading.Lock()  # guards _posted, _expected, _open
        #: what the loop's thread sleeps on; other threads (and, through ``waker.c_post``, a CUDA
        #: stream) post it (gpuloom/runtime/waker.py)
        self.waker = waker if waker is not None else make_waker()
        self._owner = 0  # thread id of the loop's thread (posts from it need no wake-up)
        self._cpu_clock: int | None = None  # that thread's CPU clock, read on it (cpu_report)
        self._owner_thread: threading.Thread | None = None  # whether that thread still runs (cpu_report)
        self._pollers: tuple[Callable[[], float], ...] = ()  # replaced, never changed in place: any thread adds
        self._posted: list[tuple[int, Callable[..., Any], tuple]] = []
        self._expected = 0  # posts announced with expect() and not yet arrived
        self._open = False  # online serving: keep waiting for posts even with nothing expected
        self._get_ident = threading.get_ident
        self._host_wake: Callable[[], None] | None = None  # host_by
        self._current_thread = threading.current_thread
        # how long posts waited for the loop's thread to take them (a stalled loop -- a long handler,
        # a garbage-collector pause, the GIL -- delays every arrival and completion alike)
        from collections import deque

        self.slow_posts: deque = deque(maxlen=4096)  # (monotonic s, lag ms) of posts that waited > 1 ms
        #: callback name -> [CPU s, calls] of what the loop's thread ran, while :meth:`account_cpu` is on
        self.cpu: dict[str, list] | None = None

    def open(self) -> None:
        """Online mode: :meth:`step` waits for posts (submissions from other threads) instead of
        returning False when its heap runs empty. Undo with :meth:`shut`."""
        with self._mu:
            self._open = True

    def shut(self) -> None:
        """Leave online mode: :meth:`step` returns False again once nothing is left or expected."""
        with self._mu:
            self._open = False
        self._wake()

    def expect(self) -> None:
        """Announce one future :meth:`post` (e.g. on submitting a batch): until it arrives the loop
        waits for it instead of ending when its heap runs empty."""
        with self._mu:
            self._expected += 1

    def on_loop_thread(self) -> bool:
        """Whether the caller is the thread that last ran :meth:`step`."""
        return self._get_ident() == self._owner

    def add_poller(self, poll: Callable[[], float]) -> None:
        """Call ``poll()`` on the loop's thread each time it wakes, before it takes posts. ``poll``
        may :meth:`post`; it returns how long from now (ms) it wants to be called again at the
        latest, with no post to wake the loop, or ``inf`` (a delay, not a time: a poller needs no
        loop's clock, and one poller serves every loop a service runs). (The execution backend
        books completions this way when the GPU posts the :attr:`waker` itself; the HTTP workers'
        requests are taken this way, ``serve/bridge.py``.)
        Any thread may add or remove a poller while the loop runs; adding one already there does
        nothing (it is called once per wake)."""
        with self._mu:
            if any(p is poll for p in self._pollers):
                return
            self._pollers = (*self._pollers, poll)
        self._wake()  # a sleeping loop calls it at once

    def remove_poller(self, poll: Callable[[], float]) -> None:
        with self._mu:
            self._pollers = tuple(p for p in self._pollers if p is not poll)

    def wall_ms(self) -> float:
        return (self._time.monotonic() - self._t0) * 1000.0

    def account_cpu(self, on: bool = True) -> None:
        """Charge the CPU time of every callback and poller the loop's thread runs to its name
        (:meth:`cpu_report`), or stop (``on=False``). About 1.5 us per timed call (each callback,
        each poller at each wake-up, each decision): off by default. Unlike a sampler, nothing is
        charged to where the thread waits. Each call's wall time is kept beside its CPU time: the
        difference is time the call spent off the CPU (waiting for the GIL, preempted, or in a
        call that released the GIL)."""
        self.cpu = {} if on else None

    def cpu_report(self) -> dict:
        """What :meth:`account_cpu` charged so far: per callback ``{"cpu_s", "calls", "wall_s"}``, and the loop
        thread's whole CPU clock (``thread_cpu_s``, None before the loop first ran): the rest of it is the
        loop's own work between callbacks (posts, heap, waits) and whatever ran before accounting began."""
        acct = self.cpu
        rows = {k: {"cpu_s": v[0], "calls": v[1], "wall_s": v[2]}
                for k, v in (acct.copy() if acct is not None else {}).items()}
        thread_cpu = None
        owner = self._owner_thread
        # Linux numbers a thread's CPU clock by its kernel id: it outlives join() for a moment and,
        # once the id is reused, reads another thread's. Only a live owner's clock is read.
        if self._cpu_clock is not None and owner is not None and owner.is_alive():
            try:
                thread_cpu = self._time.clock_gettime(self._cpu_clock)
            except OSError:  # the loop's thread has ended: its clock with it
                thread_cpu = None
        return {"callbacks": rows, "thread_cpu_s": thread_cpu}

    def charge(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its CPU charged to its name while :meth:`account_cpu` is on. Only the loop's
        own thread may call it (the runtime's work between events, its decisions, goes through here):
        it reads the calling thread's clock and updates the books without a lock."""
        acct = self.cpu
        return fn(*args) if acct is None else self._timed(acct, fn, *args)

    def _timed(self, acct: dict, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its CPU time (and wall time) charged to its name in ``acct``."""
        clock, wall = self._time.thread_time, self._time.monotonic
        t, w = clock(), wall()
        try:
            return fn(*args)
        finally:
            used, took = clock() - t, wall() - w
            key = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            row = acct.get(key)
            if row is None:
                acct[key] = [used, 1, took]
            else:
                row[0] += used
                row[1] += 1
                row[2] += took

    def post(self, priority: int, callback: Callable[..., Any], *args: Any) -> None:
        """Thread-safe: run ``callback(*args)`` on the loop's thread as soon as possible.

        Only a post into an empty list wakes the loop: a later one finds its wake-up under way (made
        by the post that found the list empty, or not needed: the loop's own thread takes its posts
        before it sleeps). Under load that spares a semaphore call per request and the loop's
        thread the wake-ups that would find nothing left to take."""
        with self._mu:
            posted = self._posted
            wake = not posted
            posted.append((priority, callback, args, self._time.monotonic()))
            self._expected = max(0, self._expected - 1)
        host_wake = self._host_wake
        if host_wake is not None:  # stepped by a host's event loop: every post calls it (it coalesces them
            host_wake()  # itself, and notices a host that has closed since the first post)
        elif wake and self._get_ident() != self._owner:  # the loop's own thread takes its posts before it sleeps
            self.waker.post()

    def completion_waiting(self) -> bool:
        """Loop's thread: whether a completion has been posted, or taken into the heap, that the loop
        has not run yet. No lock (a list other threads append to may be read while it grows); the
        heap of an online loop holds a few timers besides."""
        return any(p[0] == COMPLETION for p in self._posted) or any(e[1] == COMPLETION for e in self._heap)

    def _drain_posted(self) -> None:
        with self._mu:
            posted, self._posted = self._posted, []
        if not posted:
            return
        mono = self._time.monotonic()
        now = max(self.now, (mono - self._t0) * 1000.0)
        for priority, cb, args, t_post in posted:
            heappush(self._heap, (now, priority, self._seq, cb, args))
            self._seq += 1
            lag = (mono - t_post) * 1000.0
            if lag > 1.0:
                self.slow_posts.append((mono, lag))

    def lag_since(self, t: float) -> dict:
        """Posts taken by the loop more than 1 / 5 / 20 ms after they were made, and the longest wait
        (ms), since monotonic time ``t`` (s)."""
        lags = [ms for end, ms in list(self.slow_posts) if end > t]
        return {"over_1ms": len(lags), "over_5ms": sum(1 for x in lags if x > 5), "over_20ms": sum(1 for x in lags if x > 20),
                "max_ms": max(lags, default=0.0)}

    def peek(self) -> float:
        self._drain_posted()
        return super().peek()

    def step(self) -> bool:
        """Wait for the next event (timer or posted), run it. False when no timer is left, no
        announced post is outstanding and the loop is not :meth:`open`."""
        while True:
            wait_ms = self.ready_in()
            if wait_ms is None:
                return False
            if wait_ms <= 0.0:
                break
            self.waker.wait(None if wait_ms == float("inf") else wait_ms / 1000.0)
        self.run_next()
        return True

    def ready_in(self) -> float | None:
        """Call the pollers and take the posts; then how long until the next event is due, in ms: 0.0
        when one is due now (:meth:`run_next` runs it), ``inf`` when the loop waits for posts alone,
        None when :meth:`step` would return False. Without blocking: :meth:`step` sleeps on the
        waker in between; a host that steps the loop from its own event loop calls it back instead
        (:meth:`host_by`)."""
        ident = self._get_ident()
        if ident != self._owner:
            self._owner = ident
            self._owner_thread = self._current_thread()
            try:  # read here, on the thread itself: an id read later may be another thread's by then
                self._cpu_clock = self._time.pthread_getcpuclockid(ident)
            except (OSError, AttributeError):  # no per-thread CPU clocks on this platform
                self._cpu_clock = None
        inf = float("inf")
        acct = self.cpu
        again_in = inf
        for poll in self._pollers:
            again_in = min(again_in, poll() if acct is None else self._timed(acct, poll))
        self._drain_posted()
        heap = self._heap
        now = self.wall_ms()
        if heap and heap[0][0] <= now:
            return 0.0
        nxt = min(heap[0][0] if heap else inf, now + again_in)
        if nxt < inf:
            return max(nxt - now, 1e-6)  # (a poller due now: call it again at once, but it is no event)
        with self._mu:
            if not self._posted:  # (else posts came in after the drain above: they are due now)
                return inf if (self._expected or self._open) else None
        self._drain_posted()
        return 0.0

    def _wake(self) -> None:
        host_wake = self._host_wake
        if host_wake is not None:
            host_wake()
        else:
            self.waker.post()

    def run_next(self) -> None:
        """Run the earliest event (:meth:`ready_in` said one is due); its CPU charged while
        :meth:`account_cpu` is on."""
        acct = self.cpu
        if acct is None:
            super().step()
            return
        time_ms, _, _, cb, args = heappop(self._heap)  # EventLoop.step, the callback timed
        self._advance(time_ms)
        self._timed(acct, cb, *args)

    def host_by(self, wake: Callable[[], None] | None) -> None:
        """Hand the stepping to a host (``wake``) or take it back (None). A host steps the loop from
        its own event loop with :meth:`ready_in` and :meth:`run_next`; every post (from any thread, the
        host's own included) and every other wake-up then calls ``wake()`` instead of posting the
        waker, which nothing sleeps on any more."""
        self._host_wake = wake

    def _advance(self, time_ms: float) -> None:
        self.now = max(time_ms, self.now)


def cpu_delta(before: dict, after: dict, wall_s: float) -> dict:
    """What the loop's thread did between two :meth:`RealtimeLoop.cpu_report` readings, ``wall_s``
    apart: per callback CPU-s per s of wall time, calls per s and us per call, largest first, with
    the wall time per call and what of it was off the CPU (``off_cpu_us_per_call``: the GIL, the
    OS, GIL-releasing calls); the thread's whole CPU-s per s; and ``unaccounted`` (its own work
    between callbacks: posts, the heap, the semaphore). Callbacks are inclusive: what a callback
    calls is in its figure."""
    wall_s = max(wall_s, 1e-9)
    b = before.get("callbacks", {})
    rows = []
    for name, a in after.get("callbacks", {}).items():
        prev = b.get(name, {})
        cpu = a["cpu_s"] - prev.get("cpu_s", 0.0)
        calls = a["calls"] - prev.get("calls", 0)
        took = a.get("wall_s", 0.0) - prev.get("wall_s", 0.0)
        if calls > 0:
            rows.append({"callback": name, "cpu_s_per_s": cpu / wall_s, "calls_per_s": calls / wall_s,
                         "us_per_call": cpu / calls * 1e6, "wall_us_per_call": took / calls * 1e6,
                         "off_cpu_us_per_call": max(took - cpu, 0.0) / calls * 1e6})
    rows.sort(key=lambda r: -r["cpu_s_per_s"])
    thread = None
    if before.get("thread_cpu_s") is not None and after.get("thread_cpu_s") is not None:
        thread = (after["thread_cpu_s"] - before["thread_cpu_s"]) / wall_s
    charged = sum(r["cpu_s_per_s"] for r in rows)
    return {"thread_cpu_s_per_s": thread, "charged_cpu_s_per_s": charged,
            "unaccounted_cpu_s_per_s": None if thread is None else thread - charged, "callbacks": rows}
