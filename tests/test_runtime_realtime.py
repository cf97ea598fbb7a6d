"""The wall-clock loop a GPU backend will use, and the runtime's books when a batch fails."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from gpuloom.policy import Completion, Decision, Layout, Request, Status, make_policy
from gpuloom.policy.base import ModelInfo, PolicyContext
from gpuloom.profile.synthetic import synthetic_profile
from gpuloom.runtime import Backend, Runtime
from gpuloom.runtime.events import ARRIVAL, COMPLETION, RealtimeLoop


class ThreadedFakeBackend(Backend):
    """A stand-in for the GPU backend: each batch 'runs' on a thread for a fixed time and is posted
    back; batches of ``failing`` fail with an error."""

    def __init__(self, run_ms: float = 2.0, failing: str = "") -> None:
        self.loop = RealtimeLoop()
        self.gpu_sms, self.granularity = 132, 8
        self.run_ms, self.failing = run_ms, failing
        self._threads: list[threading.Thread] = []

    def start(self, on_completion: Callable[[Completion], None]) -> None:
        self._done = on_completion

    def configure(self, layout: Layout) -> float:
        self._layout = layout
        return self.loop.now

    def partitions(self):
        return self._layout.partitions

    def submit(self, decision: Decision, requests: Sequence[Request]) -> None:
        start = self.loop.now
        self.loop.expect()

        def work():
            time.sleep(self.run_ms / 1000.0)
            err = f"{decision.model} crashed" if decision.model == self.failing else ""
            self.loop.post(COMPLETION, self._done, Completion(decision, start, self.loop.wall_ms(), err))

        t = threading.Thread(target=work)
        self._threads.append(t)
        t.start()

    def busy_sm_ms(self) -> float:
        return 0.0


def ctx2() -> PolicyContext:
    ms = {m: ModelInfo(m, synthetic_profile(m, per_item_sm_ms=30.0), 50.0, 1.0, 100.0) for m in ("good", "bad")}
    return PolicyContext(ms, 132, 8, simulated=False)


def test_realtime_loop_runs_timers_on_the_wall_clock_and_posted_events_early():
    # The loop sleeps toward a timer 60 s away; a post from another thread (after 5 ms, or whenever a
    # loaded host runs that thread) wakes it at once. The post then schedules a timer 30 ms on, which
    # runs no earlier than that on the wall clock. (A post racing a fixed 30 ms timer can lose on a busy host.)
    far = 60_000.0
    loop, seen, posted_at = RealtimeLoop(), [], []
    loop.schedule(far, ARRIVAL, lambda: seen.append(("far", loop.now)))

    def on_post():
        posted_at.append(time.monotonic())
        seen.append(("posted", loop.now))
        loop.schedule(loop.now + 30.0, ARRIVAL, lambda: seen.append(("timer", loop.now)))

    loop.expect()
    threading.Timer(0.005, lambda: loop.post(COMPLETION, on_post)).start()
    while len(seen) < 2:
        assert loop.step()
    assert [k for k, _ in seen] == ["posted", "timer"]
    assert 4.0 <= seen[0][1] < far  # run when posted, not at the loop's next timer
    assert seen[1][1] >= seen[0][1] + 30.0 and time.monotonic() - posted_at[0] >= 0.029


def test_a_failing_model_fails_only_its_own_requests_and_the_books_balance():
    reqs = [Request(i, "good" if i % 2 else "bad", 2.0 * i, 2.0 * i + 50.0) for i in range(10)]
    backend = ThreadedFakeBackend(run_ms=2.0, failing="bad")
    rec = Runtime(make_policy("triton", max_queue_delay_ms=0.0), backend, ctx2()).run(reqs, until_ms=20.0, drain_ms=30.0)
    for t in backend._threads:
        t.join()
    by = {r.request.id: r for r in rec.results}
    assert all(by[i].status == Status.FAILED and "crashed" in by[i].reason for i in range(0, 10, 2))
    assert all(by[i].status == Status.SERVED for i in range(1, 10, 2))
    assert rec.count(Status.SERVED) + rec.count(Status.FAILED) == len(reqs)


def test_the_realtime_loop_measures_how_long_posts_waited_for_a_stalled_loop():
    # The post is made from inside the stall, so it waits the whole 80 ms whenever a loaded host runs the
    # threads (a timer thread posting 5 ms in could come after the stall); the lag is held against the
    # wait seen from outside the loop, from before the post to its callback.
    loop = RealtimeLoop()
    loop.open()
    ran, at = [], {}

    def took():
        at["took"] = time.monotonic()
        ran.append(1)
        loop.shut()

    def post():
        at["posted"] = time.monotonic()
        loop.post(0, took)

    def stall():  # a long handler (or a garbage-collector pause) holds the loop's thread
        at["t0"] = time.monotonic()  # (this handler's own post was taken before it ran)
        poster = threading.Thread(target=post)
        poster.start()
        poster.join()
        time.sleep(0.08)

    loop.post(0, stall)
    while loop.step():
        pass
    lag = loop.lag_since(at["t0"])
    assert ran == [1]
    assert lag["over_20ms"] == 1 and 80 <= lag["max_ms"] <= (at["took"] - at["posted"]) * 1000.0, (lag, at)
    assert loop.lag_since(time.monotonic())["over_1ms"] == 0


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_loop_charges_cpu_to_the_callbacks_that_used_it_and_not_to_its_waits():
    from gpuloom.runtime.events import cpu_delta

    loop = RealtimeLoop()
    busy_polls = []

    def poll() -> float:
        busy_polls.append(1)
        return float("inf")

    def heavy():
        _spin(0.03)

    def light():
        pass

    def sleepy():  # off the CPU: its wall time is charged, its CPU time is not
        time.sleep(0.02)

    loop.add_poller(poll)
    loop.open()
    assert loop.cpu_report() == {"callbacks": {}, "thread_cpu_s": None}  # the loop has not run yet
    th = threading.Thread(target=lambda: [loop.step() for _ in range(9)])  # the nine posts below
    loop.account_cpu(True)
    th.start()
    started = threading.Event()
    loop.post(ARRIVAL, started.set)  # the loop's thread is in step(): its CPU clock is known
    assert started.wait(5)
    before = loop.cpu_report()
    t0 = time.monotonic()
    for _ in range(3):
        loop.post(COMPLETION, heavy)
        time.sleep(0.05)  # the loop sleeps on its semaphore in between: no CPU charged for that
        loop.post(ARRIVAL, light)
        time.sleep(0.01)
    loop.post(ARRIVAL, sleepy)
    after, charged = [], []
    # the runtime's work between events goes through charge(), on the loop's thread, and returns its value
    loop.post(ARRIVAL, lambda: (charged.append(loop.charge(lambda: 7)), after.append(loop.cpu_report())))
    th.join(5)
    assert not th.is_alive()
    assert charged == [7]
    # the thread has ended: its CPU clock with it (never another thread's that got its id)
    assert loop.cpu_report()["thread_cpu_s"] is None
    d = cpu_delta(before, after[0], time.monotonic() - t0)
    rows = {r["callback"]: r for r in d["callbacks"]}
    heavy_key = next(k for k in rows if k.endswith("heavy"))
    assert rows[heavy_key]["us_per_call"] > 20_000  # each call spun 30 ms of CPU
    assert rows[next(k for k in rows if k.endswith("light"))]["us_per_call"] < 5_000
    assert rows[next(k for k in rows if k.endswith("poll"))]["calls_per_s"] > 0
    assert rows[heavy_key]["cpu_s_per_s"] == max(r["cpu_s_per_s"] for r in d["callbacks"])  # largest first
    slept = rows[next(k for k in rows if k.endswith("sleepy"))]
    assert slept["us_per_call"] < 5_000 and slept["off_cpu_us_per_call"] > 15_000  # its 20 ms were off the CPU
    assert slept["wall_us_per_call"] >= slept["us_per_call"] + slept["off_cpu_us_per_call"] - 1
    assert rows[heavy_key]["wall_us_per_call"] >= 0.99 * rows[heavy_key]["us_per_call"]
    # the thread's whole CPU is about what was charged: 3 x 30 ms
    assert 0.09 <= d["thread_cpu_s_per_s"] * (time.monotonic() - t0) < 0.4
    assert d["unaccounted_cpu_s_per_s"] < d["charged_cpu_s_per_s"]
    assert sum(k.endswith("<lambda>") for k in loop.cpu_report()["callbacks"]) >= 1
    loop.account_cpu(False)
    assert loop.cpu is None and loop.charge(lambda: 8) == 8
    assert loop.cpu_report()["callbacks"] == {}
