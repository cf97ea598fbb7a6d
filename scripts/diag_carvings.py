"""Why do some SM partitions run their models 1.5x slower *alone* than their profiles? (issue 5)

The runtime's carving check (``CudaDeviceLayer._carving_check``, run 40) found, with nothing else on
the GPU: in (48, 16, 16, 16, 16, 20) carved as given the four 16-SM partitions run 1.46-1.63x their
profiles, and in (32, 24, 24, 16, 16, 20) and (32, 32, 16, 16, 16, 20) the last 20-SM partition
(vgg16) runs 1.47x, carved as given or smallest first. The driver says each has the SMs asked for.

This carves layouts with ``gpuloom.gpu.Partitioner`` (the runtime's own carving) and, on every
partition alone, records:

* ``smids``: the SM ids a kernel of many blocks ran on (Triton, ``%smid``), so a partition's SMs
  can be compared across carvings (whether the driver's count is what runs, and which SMs);
* CUDA-event medians of probes: a memory-bound elementwise op, an fp32 matmul (cuBLAS), a 3x3
  convolution (cuDNN), and vgg16 / resnet50 at batch 8 (eager, cuDNN autotuned);

and, as the reference, the same probes on a partition of each size split off the whole device
(``Partitioner([s])``), the way the profiler carves. Each case runs in its own process (a sticky CUDA error
cannot spoil the next).

    PYTHONPATH=. python3 scripts/diag_carvings.py --out $OUT/diag/carvings.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: (sizes, order, remainder_split): the reference carvings first (size s split off the whole device)
CASES = [
    ([16], "given", "cosched"),  # one partition split off the whole device: as the profiler carves
    ([20], "given", "cosched"),
    ([24], "given", "cosched"),
    ([48], "given", "cosched"),
    ([48, 16, 16, 16, 16, 20], "given", "cosched"),
    ([48, 16, 16, 16, 16, 20], "ascending", "cosched"),
    ([32, 24, 24, 16, 16, 20], "given", "cosched"),
    ([32, 32, 16, 16, 16, 20], "given", "cosched"),
    ([48, 24, 16, 16, 16, 8], "given", "cosched"),  # runs 23-24: its 16s ran 1.38-1.40x under load
    # the remainder on the largest partition (planner default since run 42): carved last, it takes the leftovers
    ([52, 16, 16, 16, 16, 16], "given", "cosched"),
    ([36, 24, 24, 16, 16, 16], "given", "cosched"),
]
MODELS = ("vgg16", "resnet50")


def _median_ms(torch, fn, stream, warmup=3, iters=10) -> float:
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        out = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            out.append(a.elapsed_time(b))
    return round(statistics.median(out), 4)


def _smid_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out_ptr, x_ptr):
        pid = tl.program_id(0)
        x = tl.load(x_ptr + pid)
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        # spin a little so that blocks spread over every SM the partition has
        acc = x
        for _ in range(2000):
            acc = acc * 1.0000001 + 1e-7
        tl.store(out_ptr + pid, s + (acc * 0.0).to(tl.int32))

    return smid


def one_case(sizes, order, split) -> dict:
    import torch

    from gpuloom.gpu import Partitioner
    from gpuloom.profile.profiler import load_model

    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda", 0)
    specs = {m: load_model(m) for m in MODELS}
    xs = {m: specs[m].make_inputs(8, "cuda")[0] for m in MODELS}
    big = torch.randn(64 << 20, device=dev)
    a, b = torch.randn(2048, 2048, device=dev), torch.randn(2048, 2048, device=dev)
    conv = torch.nn.Conv2d(128, 128, 3, padding=1).to(dev)
    cx = torch.randn(8, 128, 56, 56, device=dev)
    try:
        kern = _smid_kernel()
        n_blocks = 132 * 32
        ids = torch.empty(n_blocks, dtype=torch.int32, device=dev)
        xin = torch.ones(n_blocks, dtype=torch.float32, device=dev)
    except Exception as e:  # noqa: BLE001
        kern, kern_err = None, f"{type(e).__name__}: {e}"
    probes = {
        "elementwise": lambda: big.mul_(1.0000001),
        "matmul": lambda: torch.mm(a, b),
        "conv3x3": lambda: conv(cx),
    }
    for m in MODELS:
        probes[m] = (lambda m=m: specs[m].module(xs[m]))
    out = {"layout": sizes, "order": order, "split": split, "partitions": []}
    with torch.no_grad(), Partitioner(sizes, mode="green", order=order, remainder_split=split) as parts:
        for p in parts:
            row = {"index": p.index, "requested": p.requested, "sms": p.sms, "ms": {}}
            if kern is not None:
                try:
                    with torch.cuda.stream(p.stream):
                        ids.fill_(-1)
                        kern[(n_blocks,)](ids, xin)
                    p.stream.synchronize()
                    row["smids"] = sorted(set(ids.tolist()))
                except Exception as e:  # noqa: BLE001
                    row["smids_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            else:
                row["smids_error"] = kern_err
            for name, fn in probes.items():
                try:
                    row["ms"][name] = _median_ms(torch, fn, p.stream)
                except Exception as e:  # noqa: BLE001 - the error is a finding
                    row["ms"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            out["partitions"].append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        sizes, order, split = json.loads(args.case)
        try:
            print("RESULT " + json.dumps(one_case(sizes, order, split)))
        except Exception as e:  # noqa: BLE001
            print("RESULT " + json.dumps({"layout": sizes, "order": order, "split": split,
                                          "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = []
    for sizes, order, split in CASES:
        t = time.time()
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", json.dumps([sizes, order, split])],
                           capture_output=True, text=True, timeout=150)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[-1][7:]) if line else {"layout": sizes, "order": order, "split": split,
                                                   "error": p.stderr[-1500:]}
        results.append(r)
        print(sizes, order, split, f"{time.time() - t:.0f}s", r.get("error", ""), flush=True)
        for q in r.get("partitions", []):
            ids = q.get("smids")
            shown = f"{len(ids)} ids {ids[:3]}..{ids[-2:]}" if ids else q.get("smids_error", "")[:80]
            print(f"  p{q['index']} sms={q['sms']} {shown} " +
                  " ".join(f"{k}={v if isinstance(v, str) else round(v, 3)}" for k, v in q["ms"].items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
