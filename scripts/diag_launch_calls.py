"""Host time of each call in a batch-1 launch, on the GPU: where issue 5's dispatch overhead goes.

Why: at batch 1 on mix6 the runtime's thread spends about 0.075 ms of host time per batch (run 75:
inputs 0.024 ms, replay 0.024, outputs 0.011, and the rest in Python around them), 5-8% of the GPU's
busy time against issue 5's < 5%. This times each piece alone, many times, so a change can aim at
the piece that costs:

* the raw driver calls of a launch (``gpu/launch.py``): a ctypes call that does nothing
  (``cuCtxGetCurrent``), ``cuEventRecord``, the input row's ``cuMemcpyHtoDAsync``, ``cuGraphLaunch``
  of the model's batch-1 graph, the output's ``cuMemcpyDtoHAsync``, ``cuEventQuery``;
* a whole :class:`~gpuloom.gpu.launch.LaunchPlan` launch (inputs, replay, outputs), on a busy stream
  and after sleeping on the previous launch's blocking-sync event (as the runtime's thread does);
* the device layer's :meth:`CudaDeviceLayer.launch` on a staged row (what the runtime calls), with
  its phases (``launch_ms``).

Each figure is the median over ``--reps`` timed calls (``perf_counter_ns`` around one call); the
stream is synchronized every ``--every`` calls, outside the timing, so no call waits for a full
launch queue. Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_launch_calls.py --models resnet50,mobilenet_v2 --out /tmp/calls.json

To time another version of the device layer, copy this script into an export of that version
(``git archive REV gpuloom | tar -x -C old``; ``cp scripts/diag_launch_calls.py old/scripts/``): it
imports the ``gpuloom`` beside its own folder.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom, not an installed one


def timed(fn, reps: int, every: int, sync) -> dict:
    """Median, p10 and p90 of ``fn()``'s host time in us over ``reps`` calls."""
    clock = time.perf_counter_ns
    us = []
    for i in range(reps):
        if i % every == 0:
            sync()
        t = clock()
        fn()
        us.append((clock() - t) / 1e3)
    sync()
    us.sort()
    return {"median_us": round(statistics.median(us), 3), "p10_us": round(us[len(us) // 10], 3),
            "p90_us": round(us[len(us) * 9 // 10], 3)}


def profile(fn, sync, reps: int, top: int = 25) -> list[dict]:
    """cProfile over ``reps`` calls of ``fn`` (``sync`` after each, not profiled): the top entries by
    own time, us per call of ``fn``. The profiler's own cost inflates small calls: read it for the split."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(reps):
        prof.enable()
        fn()
        prof.disable()
        sync()
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        rows.append({"function": f"{Path(file).name}:{line}:{func}", "calls_per_launch": round(nc / reps, 2),
                     "own_us": round(tt * 1e6 / reps, 3), "cumulative_us": round(ct * 1e6 / reps, 3)})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def wait_variants(plan_launch, stream, drv, done_event: int, sleep_sync, reps: int) -> dict:
    """The same launch after four kinds of wait, to tell a cold host from an idle GPU:

    * ``gpu_idle_host_spun``: the stream drained while this thread spun (``cuEventQuery``), then 200 us
      more of spinning: the core stays hot, the GPU goes idle;
    * ``gpu_idle_host_slept``: the thread slept on a blocking-sync event (as the runtime's does);
    * ``gpu_busy_host_slept``: a 2 ms GPU spin queued first, then the thread sleeps 1 ms
      (``time.sleep``): the launch meets a busy stream after the host slept;
    * ``gpu_idle_host_slept_dma_latency0``: as the second, while this process holds
      ``/dev/cpu_dma_latency`` at 0 (the kernel keeps cores out of deep idle states); skipped with
      the reason where the file cannot be opened.
    """
    import struct

    import torch

    def spin_sync() -> None:
        while not drv.done(done_event):
            pass
        t = time.perf_counter() + 200e-6
        while time.perf_counter() < t:
            pass

    def busy_then_sleep() -> None:
        stream.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(4_000_000)  # about 2 ms at the H200's 1.98 GHz
        time.sleep(0.001)

    def launch_and_record() -> None:
        plan_launch()  # plan_launch records done_event last

    out = {"gpu_idle_host_spun": timed(launch_and_record, reps, 1, spin_sync),
           "gpu_idle_host_slept": timed(launch_and_record, reps, 1, sleep_sync),
           "gpu_busy_host_slept": timed(launch_and_record, reps, 1, busy_then_sleep)}
    try:
        with open("/dev/cpu_dma_latency", "wb", buffering=0) as f:
            f.write(struct.pack("i", 0))
            out["gpu_idle_host_slept_dma_latency0"] = timed(launch_and_record, reps, 1, sleep_sync)
    except OSError as e:
        out["gpu_idle_host_slept_dma_latency0"] = {"skipped": f"{type(e).__name__}: {e}"}
    stream.synchronize()
    return out


def launch_graph_variants(drv, entry, plan, raw, out_ptrs, rows_in, reps, every, sync, sleep_sync, plan_launch) -> dict:
    """``cuGraphLaunch``'s host time for launch graphs around the captured graph (``Driver.wrap_graph``)
    with some of its nodes: which node makes a launch graph cost more to launch than the captured
    graph (run 95: 36-43 us for the launch phase against 25-30 us for three separate calls), around a
    child graph node or ``flat`` (added to a clone of the captured graph). Also the whole launch
    (input copy + launch graph) after a sleep, beside the separate calls' (``plan_launch``)."""
    child = int(entry.graph.raw_cuda_graph())
    copies = [(dst, src, row) for (src, row), dst in zip(plan.outputs, out_ptrs)]
    t0, t1, done = raw[1], raw[2], raw[3]
    shapes = {"child_only": (None, None, [], None), "copies": (None, None, copies, None),
              "done_event": (None, None, [], done), "three_events": (t0, t1, [], done),
              "copies_done": (None, None, copies, done), "full": (t0, t1, copies, done)}
    res = {"captured": timed(lambda: drv.launch_graph(plan.graph_exec, plan.stream), reps, every, sync)}
    made = []
    try:
        for flat in (False, True):
            for k, (a, b, c, d) in shapes.items():
                g, e = drv.wrap_graph(child, a, b, c, d, plan.stream, flat=flat)
                made.append((g, e))
                res[("flat_" if flat else "") + k] = timed(lambda e=e: drv.launch_graph(e, plan.stream), reps, every,
                                                           sync)
        full = made[len(shapes) - 1][1]
        flat_full = made[-1][1]

        def graph_launch() -> None:
            plan.copy_inputs(drv, 1, None, rows_in=rows_in)
            drv.launch_graph(full, plan.stream)

        res["full_launch_after_sleep"] = timed(graph_launch, reps, 1, sleep_sync)

        def flat_launch() -> None:
            plan.copy_inputs(drv, 1, None, rows_in=rows_in)
            drv.launch_graph(flat_full, plan.stream)

        res["flat_full_launch_after_sleep"] = timed(flat_launch, reps, 1, sleep_sync)
        res["plan_launch_after_sleep"] = timed(plan_launch, reps, 1, sleep_sync)  # the same process, just after
    finally:
        sync()
        for g, e in made:
            drv.destroy_graph(g, e)
    return res


def measure_model(name: str, reps: int, every: int, waits: bool = False, launch_graphs: bool = False) -> dict:
    import numpy as np
    import torch

    import gpuloom
    from gpuloom.gpu.launch import Driver, LaunchPlan, row_bytes
    from gpuloom.policy.types import Layout, Partition
    from gpuloom.profile.profiler import load_model
    from gpuloom.runtime.cuda_device import CudaDeviceLayer

    ms = load_model(name, device="cuda")
    ex = tuple(torch.randn((1, *s), device="cuda").to(dt) for s, dt in zip(ms.input_shapes, ms.input_dtypes))
    cm = gpuloom.compile(ms.module, ex, max_batch=1, device="cuda", channels_last=False, streams=1)
    stream = torch.cuda.Stream()
    gs = cm.capture(stream_factory=lambda: stream, buckets=[1], streams=1, warmup=2, keep_graph=launch_graphs)
    entry = gs.buckets[1]
    gs.replay(1)
    torch.cuda.synchronize()
    from gpuloom.engine.dag import flat_tensors

    outs = flat_tensors(entry.outputs)
    drv = Driver(0)
    drv.ensure_context()
    st = int(stream.cuda_stream)
    plan = LaunchPlan(stream=st, graph_exec=int(entry.graph.raw_cuda_graph_exec()),
                      inputs=tuple((t.data_ptr(), row_bytes(t.shape, t.element_size())) for t in entry.inputs),
                      outputs=tuple((t.data_ptr(), row_bytes(t.shape, t.element_size())) for t in outs))
    pin_in = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in entry.inputs]
    pin_out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outs]
    in_ptrs = [t.data_ptr() for t in pin_in]
    out_ptrs = [t.data_ptr() for t in pin_out]
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for e in evs:
        e.record(stream)
    raw = [e.cuda_event for e in evs]
    sync = stream.synchronize
    cur = ctypes.c_void_p()
    (dst, row), src = plan.inputs[0], in_ptrs[0]
    (osrc, orow), odst = plan.outputs[0], out_ptrs[0]
    rows_in = [[(p, t.nbytes) for p, t in zip(in_ptrs, pin_in)]]
    res = {
        "input_bytes": [r for _, r in plan.inputs], "output_bytes": [r for _, r in plan.outputs],
        "ctypes_noop": timed(lambda: drv._ctx_get(ctypes.byref(cur)), reps, every, sync),
        "event_record": timed(lambda: drv.record(raw[0], st), reps, every, sync),
        "event_query": timed(lambda: drv.done(raw[0]), reps, every, sync),
        "copy_in": timed(lambda: drv.copy_in(dst, src, row, st), reps, every, sync),
        "graph_launch": timed(lambda: drv.launch_graph(plan.graph_exec, st), reps, every, sync),
        "copy_out": timed(lambda: drv.copy_out(odst, osrc, orow, st), reps, every, sync),
    }

    def plan_launch() -> None:
        plan.copy_inputs(drv, 1, raw[0], rows_in=rows_in)
        plan.replay(drv, raw[1], raw[2])
        plan.copy_outputs(drv, 1, out_ptrs, raw[3])

    res["plan_launch"] = timed(plan_launch, reps, every, sync)
    # as the runtime meets it: each launch after the thread slept on the previous batch's
    # blocking-sync event (the stream idle, the core maybe cold), as the layer's figure below
    blocking = torch.cuda.Event(blocking=True)

    def sleep_sync() -> None:
        blocking.record(stream)
        blocking.synchronize()

    res["plan_launch_after_sleep"] = timed(plan_launch, reps, 1, sleep_sync)
    if launch_graphs:
        res["launch_graphs"] = launch_graph_variants(drv, entry, plan, raw, out_ptrs, rows_in, reps, every, sync,
                                                     sleep_sync, plan_launch)
    if waits:
        res["waits"] = wait_variants(plan_launch, stream, drv, raw[3], sleep_sync, max(200, reps // 4))
    parts = ("event_record", "copy_in", "graph_launch", "copy_out")
    res["plan_calls_sum_us"] = round(3 * res["event_record"]["median_us"]
                                     + sum(res[k]["median_us"] for k in parts), 3)
    del gs

    # the device layer, as the runtime calls it: stage() on the submitting side, launch() timed
    layer = CudaDeviceLayer(0)
    layer.add_model(name, cm)
    lanes = layer.build(Layout((Partition(0, 0, layer.gpu_sms, shared=True),), layer.gpu_sms))
    rows = [layer.stage([np.random.rand(*s).astype(str(dt).removeprefix("torch."))
                         for s, dt in zip(ms.input_shapes, ms.input_dtypes)])]
    tickets = []

    def layer_launch() -> None:
        tickets.append(layer.launch(lanes, 0, name, rows))

    def layer_sync() -> None:
        while tickets:
            layer.finish(tickets.pop(0))

    for _ in range(20):  # warm: events, pinned output slots, the raw plan
        layer_launch()
        layer_sync()
    before = dict(layer.launch_ms)
    res["layer_launch"] = timed(layer_launch, reps, 1, layer_sync)  # a slot is reused only after finish
    n = layer.launch_ms["launches"] - before["launches"]
    res["layer_phases_us"] = {k: round((layer.launch_ms[k] - before[k]) * 1e3 / n, 3)
                              for k in ("inputs", "replay", "outputs")}
    res["layer_profile"] = profile(layer_launch, layer_sync, reps)
    layer.release(lanes)
    layer.close()
    drv.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2", help="comma list of zoo names")
    ap.add_argument("--reps", type=int, default=2000, help="timed calls per figure")
    ap.add_argument("--every", type=int, default=16, help="synchronize the stream every this many calls")
    ap.add_argument("--waits", action="store_true",
                    help="also time the raw launch after four kinds of wait (a cold host or an idle GPU?)")
    ap.add_argument("--launch-graphs", action="store_true",
                    help="also time launch graphs around the captured graph, node kind by node kind")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    import torch

    from gpuloom.bench.e2e import save_json

    if not torch.cuda.is_available():
        print("diag_launch_calls needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "reps": a.reps, "models": {}}
    for name in a.models.split(","):
        r = out["models"][name] = measure_model(name, a.reps, a.every, a.waits, a.launch_graphs)
        print(name, json.dumps({k: (v["median_us"] if isinstance(v, dict) and "median_us" in v else v)
                                for k, v in r.items() if k not in ("layer_profile", "launch_graphs")}), flush=True)
        if "launch_graphs" in r:
            print(name, "launch graphs", json.dumps({k: v["median_us"] for k, v in r["launch_graphs"].items()}),
                  flush=True)
    if a.out:
        save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
