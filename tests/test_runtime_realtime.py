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
    t0 = time.monotonic()
    loop, seen = RealtimeLoop(), []
    loop.schedule(30.0, ARRIVAL, lambda: seen.append(("timer", loop.now)))
    loop.expect()
    threading.Timer(0.005, lambda: loop.post(COMPLETION, lambda: seen.append(("posted", loop.now)))).start()
    while loop.step():
        pass
    assert [k for k, _ in seen] == ["posted", "timer"]
    assert seen[1][1] >= 30.0 and time.monotonic() - t0 >= 0.029
    assert 4.0 <= seen[0][1] < 30.0


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
    loop = RealtimeLoop()
    loop.open()
    t0 = time.monotonic()
    ran = []

    def stall():
        time.sleep(0.08)  # a long handler (or a garbage-collector pause) holds the loop's thread

    loop.post(0, stall)
    # arrives while the loop stalls; waits ~75 ms, over 20 ms even if a loaded host starts the timer 50 ms late
    threading.Timer(0.005, lambda: loop.post(0, ran.append, 1)).start()
    threading.Timer(0.15, loop.shut).start()
    while loop.step():
        pass
    lag = loop.lag_since(t0)
    assert ran == [1]
    assert lag["over_20ms"] == 1 and 20 <= lag["max_ms"] < 200
    assert loop.lag_since(time.monotonic())["over_1ms"] == 0
