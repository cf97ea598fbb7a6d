"""Does ``compile(..., fuse_convolutions=True)`` make a model's CUDA graph faster, and still right?

Why: PyTorch's cuDNN path adds a convolution's bias with a kernel of its own, and BatchNorm folding
gives every convolution a bias, so resnet50 runs 53 bias kernels and 49 ReLU kernels beside its 53
convolutions at batch 1 (issue 2 wants 4.3x over eager there, 10x for mobilenet_v2). cuDNN's fused
convolution + bias (+ add) + ReLU does them in one call (``engine/fold.py``, ``fuse_convolutions``).

For each model: compile twice (one stream, NCHW unless ``--channels-last``, ``--dtype``; only the
fusion differs between the two), check both against
eager on fresh random inputs at each batch (max |y - eager| / max |eager|), then time ``cm(x,
zero_copy=True)`` and the eager model with CUDA events, taking turns for ``--rounds`` rounds of
``--calls`` calls after a warm-up (the output is not copied, unlike ``bench_engine.py``'s rows: its
table stays the issue's figure). Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_fused_convs.py --models resnet50,mobilenet_v2,googlenet --out /tmp/fused.json
    PYTHONPATH=. python3 scripts/diag_fused_convs.py --models resnet50 --dtype float16 --channels-last --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom, not an installed one


def rel_err(y, ref) -> float:
    y = y[0] if isinstance(y, (tuple, list)) else y
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


def time_calls(fn, calls: int) -> float:
    """Median ms of ``calls`` calls of ``fn()``, each between two CUDA events."""
    import torch

    ms = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def smoke() -> dict:
    """Each fused op once on small float32 tensors against its unfused ops: "ok" with the relative
    error, or the error (an engine cuDNN cannot find shows here, before any model compiles)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, 8, 16, 16, device="cuda")
    w, b, z = torch.randn(8, 8, 3, 3, device="cuda"), torch.randn(8, device="cuda"), torch.randn(2, 8, 16, 16, device="cuda")
    ref = F.conv2d(x, w, b, 1, 1)
    got = {}
    for name, fn, want in (
            ("conv_relu", lambda: torch.ops.aten.cudnn_convolution_relu(x, w, b, [1, 1], [1, 1], [1, 1], 1), ref.relu()),
            ("conv_add_relu", lambda: torch.ops.aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, [1, 1], [1, 1], [1, 1], 1),
             (ref + z).relu())):
        try:
            got[name] = {"ok": True, "rel_err": rel_err(fn(), want)}
        except Exception as e:  # noqa: BLE001 - reported
            got[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000]}
    return got


def measure_model(name: str, batches: list[int], rounds: int, calls: int, dtype: str = "float32",
                  channels_last: bool = False) -> dict:
    """One model: both compiles, their errors against eager and their times beside eager's, per batch."""
    import torch

    import gpuloom
    from gpuloom.profile.profiler import load_model

    dt = getattr(torch, dtype)
    ms = load_model(name, device="cuda")
    model = ms.module.to(dt)
    ex = torch.randn((1, *ms.input_shapes[0]), device="cuda", dtype=dt)
    cms = {}
    for fuse in (False, True):
        t = time.perf_counter()
        cms[fuse] = gpuloom.compile(model, ex, max_batch=max(batches), streams=1, channels_last=channels_last,
                                    fuse_convolutions=fuse)
        print(f"{name} fuse={fuse}: compiled in {time.perf_counter() - t:.1f} s", flush=True)
    row = {"fused_convolutions": cms[True].graph.fused_convolutions,
           "dag_ops": {str(f): len(cms[f].graph.ops) for f in cms}, "batches": {}}
    for b in batches:
        x = torch.randn((b, *ms.input_shapes[0]), device="cuda", dtype=dt)
        with torch.inference_mode():
            ref = model(x)
        errs = {str(f): rel_err(cms[f](x), ref) for f in cms}
        fns = {str(f): (lambda cm=cms[f]: cm(x, zero_copy=True)) for f in cms}

        def eager():
            with torch.inference_mode():
                model(x)

        fns["eager"] = eager
        for fn in fns.values():  # warm-up
            time_calls(fn, 20)
        times = {k: [] for k in fns}
        for r in range(rounds):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[k].append(time_calls(fns[k], calls))
        med = {k: statistics.median(v) for k, v in times.items()}
        row["batches"][str(b)] = {"rel_err": errs, "ms_rounds": times, "ms": med,
                                  "speedup_fused": med["False"] / med["True"],
                                  "over_eager": {k: med["eager"] / med[k] for k in ("False", "True")}}
        print(name, b, json.dumps(med), "fused/unfused speedup", round(med["False"] / med["True"], 3),
              "over eager", {k: round(v, 2) for k, v in row["batches"][str(b)]["over_eager"].items()},
              "rel_err", errs, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2,googlenet")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--channels-last", action="store_true", help="compile both with channels_last=True")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("diag_fused_convs needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpuloom.bench.e2e import save_json

    torch.backends.cudnn.benchmark = True
    batches = [int(b) for b in a.batches.split(",")]
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(0),
           "dtype": a.dtype, "channels_last": a.channels_last, "smoke": smoke(), "models": {}}
    print("smoke", json.dumps(out["smoke"]), flush=True)
    for name in a.models.split(","):
        try:
            out["models"][name] = measure_model(name, batches, a.rounds, a.calls, a.dtype, a.channels_last)
        except Exception as e:  # noqa: BLE001 - one model's failure is a finding; the others still run
            out["models"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(name, "failed:", out["models"][name]["error"][:300], flush=True)
        torch.cuda.empty_cache()
        if a.out:
            save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
