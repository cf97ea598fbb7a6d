"""scripts/bench_engine.py's CPU-side plumbing: children run in parallel, each answered in order."""

from __future__ import annotations

import sys
import time

from script_loader import load_script


def test_prewarm_children_run_in_parallel_in_order_and_a_hung_one_is_killed():
    eng = load_script("bench_engine")
    sleep = [sys.executable, "-c", "import time; time.sleep(0.6); print('done')"]
    fail = [sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"]
    hang = [sys.executable, "-c", "import time; time.sleep(30)"]
    t0 = time.perf_counter()
    res = eng.run_parallel([sleep, sleep, fail, sleep, hang], jobs=3, timeout_s=2.0)
    wall = time.perf_counter() - t0
    assert [r["rc"] for r in res] == [0, 0, 3, 0, None]  # in the order given; None: killed at the timeout
    assert "done" in res[0]["tail"] and "bad" in res[2]["tail"]
    # three at a time: the hang starts as soon as the failing child ends (about 2.2 s in all), where one
    # after another would take 1.8 s of sleeps plus the hang's 2 s
    assert wall < 3.3
    assert 1.9 <= res[4]["seconds"] < 4.0
