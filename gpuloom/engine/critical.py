"""The latency lower bound of a compiled model: the critical path of its ops' kernel times.

Each op's kernels are timed in a profiled single-stream run (so no two kernels overlap); the longest
dependency path through the DAG weighted by those times is what an infinitely wide GPU with free
synchronization would take. Measured latency / critical path says how much room is left.
"""

from __future__ import annotations

import torch

from .capture import example_batch
from .streams import critical_path


def op_kernel_ms(cm, batch: int, *, warmup: int = 3) -> list[float]:
    """Kernel time in ms of each DAG op of ``cm`` at ``batch`` (sum of the kernels it launched)."""
    from torch.profiler import ProfilerActivity, profile

    if cm.device.type != "cuda":
        raise RuntimeError("kernel timing needs a CUDA device")
    ex = cm._executors["single"]
    inputs = example_batch(cm._examples, batch)
    stream = torch.cuda.current_stream(cm.device)
    with torch.no_grad():
        for _ in range(warmup):
            ex.run(inputs, [stream])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ex.run(inputs, [stream], annotate=True)
            torch.cuda.synchronize()
    durations = [0.0] * len(cm.graph.ops)
    for evt in prof.events():
        # the CPU-side range sums the kernels its ops launched; the GPU-side annotation of the same
        # name spans launch gaps too, so it is skipped
        if evt.name.startswith("gpuloom_op_") and evt.device_type == torch.autograd.DeviceType.CPU:
            durations[int(evt.name.rsplit("_", 1)[1])] += evt.device_time_total / 1000.0
    return durations


def lower_bound_ms(cm, batch: int) -> tuple[float, float]:
    """(critical path ms, sum of all kernel ms) at ``batch``."""
    durations = op_kernel_ms(cm, batch)
    length, _ = critical_path(len(durations), cm.graph.edges, durations)
    return length, sum(durations)
