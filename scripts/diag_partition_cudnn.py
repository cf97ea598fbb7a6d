"""Which green-context partitions can run cuDNN convolutions? (H200 diagnosis for issue 5)

The mix6 x0.5 dstack layout (48, 24, 24, 16, 8, 8) fails to capture mobilenet_v2, efficientnet_b0
and inception_v3 on its first 8-SM partition with CUDNN_STATUS_EXECUTION_FAILED_CUDART, while the
profiler ran the same models on an 8-SM partition split straight off the device. This carves a few
layouts the way ``Partitioner`` does (split, green context from the remainder, split again), with
the driver's split flags 0, IGNORE_SM_COSCHEDULING and MAX_POTENTIAL_CLUSTER_SIZE, and runs each
model eagerly (batch 1, cuDNN benchmark off, then on) on every partition. Each case runs in its own
process so that a sticky CUDA error cannot spoil the next.

    PYTHONPATH=. python3 scripts/diag_partition_cudnn.py --out $OUT/diag_partition.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYOUTS = [
    [8],
    [48, 24, 24, 16, 8, 8],
    [48, 24, 24, 16, 16],
    [120, 8],
    [16, 8, 8],
    [32, 24, 24, 16, 16, 20],
]
FLAGS = {"none": 0, "ignore_cosched": 1, "max_cluster": 2}
MODELS = ["mobilenet_v2", "efficientnet_b0", "resnet50"]


def carve(drv, sizes, flags):
    """Green contexts for ``sizes`` carved like Partitioner._carve, with split ``flags``."""
    res = drv.device_resource()
    ctxs, holders = [], []
    i = 0
    while i < len(sizes):
        s = sizes[i]
        avail = int(res.sm.smCount)
        if s == avail:
            ctxs.append(drv.create(res))
            i += 1
            continue
        k = 1
        while i + k < len(sizes) and sizes[i + k] == s:
            k += 1
        groups, rem = drv.split(res, k, s, flags)
        if not groups:
            raise RuntimeError(f"could not split {s} off {avail}")
        for g in groups:
            ctxs.append(drv.create(g))
        i += len(groups)
        if i < len(sizes):
            h = drv.create(rem)
            holders.append(h)
            res = drv.resource_of(h)
    return ctxs, holders


def one_case(sizes, flags) -> dict:
    import torch

    from gpuloom.gpu.green import GreenDriver
    from gpuloom.profile.profiler import load_model

    torch.cuda.init()
    torch.cuda.current_stream(0)
    drv = GreenDriver(0)
    specs = {m: load_model(m) for m in MODELS}
    xs = {m: specs[m].make_inputs(1, "cuda")[0] for m in MODELS}
    out = {"layout": sizes, "flags": flags, "partitions": []}
    ctxs, _ = carve(drv, sizes, flags)
    for i, ctx in enumerate(ctxs):
        row = {"index": i, "requested": sizes[i], "sms": drv.sm_count_of(ctx), "runs": {}}
        raw = drv.stream(ctx)
        s = torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", 0))
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for m in MODELS:
                key = f"{m}/benchmark={bench}"
                try:
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s), torch.no_grad():
                        specs[m].module(xs[m])
                    s.synchronize()
                    row["runs"][key] = "ok"
                except Exception as e:  # noqa: BLE001 - the error is the finding
                    row["runs"][key] = f"{type(e).__name__}: {str(e)[:200]}"
        out["partitions"].append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        sizes, flags = json.loads(args.case)
        try:
            print("RESULT " + json.dumps(one_case(sizes, flags)))
        except Exception as e:  # noqa: BLE001
            print("RESULT " + json.dumps({"layout": sizes, "flags": flags, "error": f"{type(e).__name__}: {e}",
                                          "trace": traceback.format_exc()[-1500:]}))
        return 0
    results = []
    for sizes in LAYOUTS:
        for fname, flags in FLAGS.items():
            if fname != "none" and sizes not in ([48, 24, 24, 16, 8, 8], [16, 8, 8]):
                continue
            p = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", json.dumps([sizes, flags])],
                               capture_output=True, text=True, timeout=120)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"layout": sizes, "flags": flags, "error": p.stderr[-1500:]}
            r["flag_name"] = fname
            results.append(r)
            bad = [(q["index"], q["sms"], k) for q in r.get("partitions", []) for k, v in q["runs"].items() if v != "ok"]
            print(sizes, fname, r.get("error", ""), "failures:", bad[:6], flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
