"""Where a compiled model's batch-1 time goes: kernel time per operator kind, and the graph's gaps.

Why: issue 2 wants efficientnet_b0 at 9x eager float32 batch 1 (8.07x in runs 128-129, with gpuloom
about 8% above its kernels' critical path), so what is left is in the kernels themselves. This
compiles each model with ``gpuloom.compile``'s defaults (one stream, so the critical path is the
kernel sum), then:

* times every DAG op's kernels in one profiled run (``engine.critical.op_kernel_ms``) and sums them
  by ATen operator (count, total, share), so a kind worth fusing stands out;
* profiles ``--replays`` replays of the captured CUDA graph as a user calls it (``cm(x, zero_copy=
  True)``): per replay the span from its first kernel's start to its last kernel's end, the kernel
  time inside it (so the gaps between kernels), and the kernel names that take longest;
* times the replay and eager with CUDA events, taking turns (``gpu.timing.median_ms_interleaved``).

Needs a GPU; one JSON document (``--out``)::

    PYTHONPATH=. python3 scripts/diag_op_breakdown.py --models efficientnet_b0,mobilenet_v2 --out /tmp/ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom, not an installed one


def op_kinds(cm, durations: list[float]) -> list[dict]:
    """Kernel ms summed by ATen operator, longest first."""
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for node, ms in zip(cm.graph.ops, durations):
        kinds[str(node.target)].append(ms)
    total = sum(durations) or 1.0
    rows = [{"op": k, "count": len(v), "ms": round(sum(v), 4), "share": round(sum(v) / total, 4),
             "mean_us": round(1000 * sum(v) / len(v), 2)} for k, v in kinds.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def replay_trace(fn, replays: int) -> dict:
    """Kernels of ``replays`` calls of ``fn`` under the profiler: span, kernel time and gaps per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
            torch.cuda.synchronize()  # calls apart, so each one's kernels are a group of their own
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                     key=lambda k: k[0])
    if not kernels:
        return {"kernels_seen": 0}
    # split into calls at the largest gaps (the host's synchronize between two calls)
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i][0] - kernels[i - 1][1], reverse=True)
    cuts = sorted(gaps[:replays - 1])
    groups, start = [], 0
    for c in cuts + [len(kernels)]:
        groups.append(kernels[start:c])
        start = c
    spans = [(g[-1][1] - g[0][0]) / 1000.0 for g in groups if g]
    busy = [sum(k[1] - k[0] for k in g) / 1000.0 for g in groups if g]
    names: dict[str, float] = collections.defaultdict(float)
    for g in groups[1:] or groups:  # skip the first call
        for s, e, n in g:
            names[n] += (e - s) / 1000.0 / max(1, len(groups) - 1)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    return {"kernels_per_call": statistics.median(len(g) for g in groups),
            "span_ms": round(statistics.median(spans), 4), "kernel_ms": round(statistics.median(busy), 4),
            "gap_ms": round(statistics.median(s - b for s, b in zip(spans, busy)), 4),
            "top_kernels_ms": [(n[:120], round(ms, 4)) for n, ms in top]}


def measure(name: str, batch: int, dtype: str, replays: int, rounds: int, calls: int) -> dict:
    import torch

    import gpuloom
    from gpuloom.engine.critical import op_kernel_ms
    from gpuloom.gpu.timing import median_ms_interleaved
    from gpuloom.profile.profiler import load_model

    dt = getattr(torch, dtype)
    ms = load_model(name, device="cuda")
    model = ms.module.to(dt)
    ex = torch.randn((1, *ms.input_shapes[0]), device="cuda", dtype=dt)
    t = time.perf_counter()
    cm = gpuloom.compile(model, ex, max_batch=batch)
    compile_s = time.perf_counter() - t
    x = torch.randn((batch, *ms.input_shapes[0]), device="cuda", dtype=dt)
    with torch.inference_mode():
        want = model(x)
    got = cm(x)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    with torch.no_grad():
        durations = op_kernel_ms(cm, batch)
    trace = replay_trace(lambda: cm(x, zero_copy=True), replays)

    def eager():
        with torch.inference_mode():
            model(x)

    fns = {"gpuloom": lambda: cm(x, zero_copy=True), "eager": eager}
    med = {k: round(v, 4) for k, v in median_ms_interleaved(fns, warmup=20, iters=rounds * calls, rounds=rounds,
                                                              cuda=True).items()}
    row = {"model": name, "batch": batch, "dtype": dtype, "compile_s": round(compile_s, 1),
           "kept": {str(b): k for b, k in cm.stream_choice.items()}, "dag_ops": len(cm.graph.ops), "rel_err": err,
           "ms": med, "over_eager": round(med["eager"] / med["gpuloom"], 3),
           "kernel_sum_ms_single_dag": round(sum(durations), 4), "replay": trace,
           "op_kinds": op_kinds(cm, durations)}
    print(f"{name} b{batch} {dtype}: gpuloom {med['gpuloom']:.3f} ms, eager {med['eager']:.3f} ms "
          f"({row['over_eager']:.2f}x); NCHW DAG kernels {sum(durations):.3f} ms over {len(durations)} ops; "
          f"replay span {trace.get('span_ms')} ms = kernels {trace.get('kernel_ms')} + gaps {trace.get('gap_ms')} "
          f"({trace.get('kernels_per_call')} kernels; kept {row['kept']})", flush=True)
    for r in row["op_kinds"][:12]:
        print(f"   {r['op']:50s} x{r['count']:3d} {r['ms']:.4f} ms ({r['share']:.0%}, {r['mean_us']:.1f} us each)")
    for n, k in trace.get("top_kernels_ms", [])[:12]:
        print(f"   replay kernel {k:.4f} ms  {n}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="efficientnet_b0,mobilenet_v2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--replays", type=int, default=6, help="graph replays profiled (the first is skipped in names)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(measure(name, args.batch, args.dtype, args.replays, args.rounds, args.calls))
        except Exception as e:  # noqa: BLE001 - reported, the next model still runs
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"{name}: {rows[-1]['error']}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
