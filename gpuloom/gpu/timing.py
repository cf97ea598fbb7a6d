"""Median latency of a callable, timed the way every gpuloom benchmark times (DESIGN.md).

GPU: CUDA events around each call on the current stream, after a warm-up, median in ms. CPU: the
host clock. Each call is synchronized before the next starts, so this is latency, not throughput.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], *, warmup: int, iters: int, cuda: bool) -> float:
    """Median ms of ``iters`` calls of ``fn()`` after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def wall_ms_across(fn: Callable[[], object], streams, *, reps: int = 5) -> float:
    """Median wall ms of ``fn()``, which enqueues work on several ``streams`` (e.g. one per partition).

    Every stream is synchronized before and after each call, so the time covers all of them: the
    way to see whether work on two partitions ran side by side. The first call is a warm-up.
    """
    out = []
    for i in range(reps + 1):
        for s in streams:
            s.synchronize()
        t = time.perf_counter()
        fn()
        for s in streams:
            s.synchronize()
        if i:
            out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


def replay_alone_and_together(graph_a, stream_a, graph_b, stream_b, *, reps: int = 5) -> tuple[float, float, float]:
    """(a alone, b alone, a and b at once) in wall ms: graph ``a`` replayed on ``stream_a``, ``b`` on
    ``stream_b``. On disjoint partitions "together" takes about as long as the slower one alone;
    on overlapping ones (or one shared GPU) it takes up to their sum."""
    import torch

    def replay(graph, stream):
        with torch.cuda.stream(stream):
            graph.replay()

    def both():
        replay(graph_a, stream_a)
        replay(graph_b, stream_b)

    alone_a = wall_ms_across(lambda: replay(graph_a, stream_a), [stream_a], reps=reps)
    alone_b = wall_ms_across(lambda: replay(graph_b, stream_b), [stream_b], reps=reps)
    return alone_a, alone_b, wall_ms_across(both, [stream_a, stream_b], reps=reps)
