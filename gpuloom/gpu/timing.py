"""Median latency of a callable, timed the way every gpuloom benchmark times (DESIGN.md).

GPU: CUDA events around each call on the current stream, after a warm-up, median in ms. CPU: the
host clock. Each call is synchronized before the next starts, so this is latency, not throughput.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping


def _time_call_ms(fn: Callable[[], object], cuda: bool) -> float:
    """One call of ``fn()`` in ms: CUDA events on the current stream (synchronized), else the host clock."""
    if cuda:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def median_ms(fn: Callable[[], object], *, warmup: int, iters: int, cuda: bool) -> float:
    """Median ms of ``iters`` calls of ``fn()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if cuda:
        import torch

        torch.cuda.synchronize()
    return statistics.median(_time_call_ms(fn, cuda) for _ in range(iters))


def median_ms_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    iters: int,
    rounds: int = 10,
    cuda: bool,
    settle: int = 1,
) -> dict[str, float]:
    """Median ms per variant, the variants timed in turns so that they see the same machine.

    Timing variants one after another (``median_ms`` each) lets a slow drift of the host or the GPU
    (clocks, other tenants, thermal state) land on one variant only: on a shared host the eager
    baseline was seen to move 2x between runs. Here every variant is warmed up (``warmup`` untimed
    calls each), then ``rounds`` rounds follow; in each, every variant in turn makes ``settle``
    untimed calls (the switch from another variant's buffers and graphs) and then its share of
    ``iters`` timed calls (``iters // rounds``, the remainder spread over the first rounds, so each
    variant gets exactly ``iters``). The order of the variants rotates from round to round, so none
    is always the first after a switch. Each call is timed alone, as :func:`median_ms` does (CUDA
    events on the current stream when ``cuda``, else the host clock): latency, not throughput.

    Returns ``{name: median ms}`` in the order of ``fns``.
    """
    names = list(fns)
    if not names:
        raise ValueError("median_ms_interleaved needs at least one callable, got none")
    if rounds < 1 or iters < rounds:
        raise ValueError(f"need 1 <= rounds <= iters (each round times every variant at least once), "
                         f"got rounds={rounds}, iters={iters}")
    if warmup < 0 or settle < 0:
        raise ValueError(f"warmup and settle must be >= 0, got warmup={warmup}, settle={settle}")
    for name in names:
        fn = fns[name]
        for _ in range(warmup):
            fn()
    if cuda:
        import torch

        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    per, extra = divmod(iters, rounds)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            for _ in range(settle):
                fn()
            times[name].extend(_time_call_ms(fn, cuda) for _ in range(per + (r < extra)))
    return {name: statistics.median(times[name]) for name in names}


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
