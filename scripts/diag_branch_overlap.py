#!/usr/bin/env python
"""Does compile's split-GEMM default cost the multi-stream overlap of independent branches? (GPU)

``tests/test_engine_gpu.py::test_independent_branches_overlap`` asks four equal branches of 16 linear
layers (512 wide, batch 1) to replay multi-stream within 1.5x one branch's time. It passed at 1.45x
(0.129 / 0.089 ms, engine report) and failed at 1.57x in run 146 (0.1515 / 0.0967 ms), after
``split_gemms`` became compile's default on CUDA (thirty-ninth session). This times both, in one
process, each way, alternating: one branch, four branches multi-stream and single-stream.

    PYTHONPATH=. python3 scripts/diag_branch_overlap.py --rounds 3

``--branches 1,2,4,8`` (fifty-sixth session) times instead each number of branches multi-stream,
with the stream kept busy ahead (the device's time alone): on the H100 four branches took 1.53-1.61x
one on the device itself (runs 183 and 185), where the H200 met the test's 1.5x. If the graph's node
launch rate is the limit, the time grows with the nodes (branches x 16 layers): 8 branches about
twice 4's, 2 within 1.1x one. Refuted by run 188 (1 / 1.29 / 1.56 / 2.30x), and run 189 refuted the
chain of adds after the branches (``--reduce stack``, one kernel summing them: 1 / 1.27 / 1.50 / 2.11x).
``--width`` (fifty-seventh session) asks whether the kernels' own size is the cost: narrower layers
launch fewer blocks each, so four branches find free SMs and memory bandwidth. It is (run 194, H100,
``--reduce stack``): 1 / 2 / 4 / 8 branches 1 / 1.14 / 1.23 / 1.34x at width 128, 1 / 1.29 / 1.52 /
2.15x at 512, 1 / 1.34 / 2.35 / 4.38x at 2048.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    import torch

    import gpuloom
    from engine_models import Branches
    from test_engine_gpu import _replay_ms

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--branches", default=None, metavar="K,K,...",
                    help="time these numbers of branches multi-stream (busy ahead and by events) instead")
    ap.add_argument("--reduce", choices=("chain", "stack"), default="chain",
                    help="with --branches: sum the branches by a chain of adds (the test's model) or by one kernel")
    ap.add_argument("--width", type=int, default=512,
                    help="the layers' width (default 512, the test's): smaller kernels use fewer SMs each")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    x = torch.randn(1, a.width, device="cuda")
    if a.branches:
        return by_branches([int(k) for k in a.branches.split(",")], a.rounds, x, a.out, a.reduce)
    built = {}
    for split in (None, False):
        one = gpuloom.compile(Branches(k=1, width=a.width, depth=16).eval().cuda(), (x,), max_batch=1, streams=1,
                              split_gemms=split)
        model = Branches(k=4, width=a.width, depth=16).eval().cuda()
        built[split] = (one, gpuloom.compile(model, (x,), max_batch=1, streams="max", split_gemms=split),
                        gpuloom.compile(model, (x,), max_batch=1, streams=1, split_gemms=split))
    rows = []
    for r in range(a.rounds):
        for split in ((None, False) if r % 2 == 0 else (False, None)):
            one, multi, single = built[split]
            t1, tm, ts = _replay_ms(one, x), _replay_ms(multi, x), _replay_ms(single, x)
            # the same with the stream kept busy ahead of each replay: the device's time alone, without
            # the graph launch's host latency (the test's events hold it: is that the suite's 0.06 ms?)
            d1, dm = _replay_ms(one, x, busy_ahead=True), _replay_ms(multi, x, busy_ahead=True)
            row = {"round": r, "split_gemms": "default" if split is None else "off", "one_ms": round(t1, 4),
                   "multi_ms": round(tm, 4), "single_ms": round(ts, 4), "multi_over_one": round(tm / t1, 3),
                   "busy_one_ms": round(d1, 4), "busy_multi_ms": round(dm, 4),
                   "busy_multi_over_one": round(dm / d1, 3), "rewrites_multi": multi.rewrites}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return report(rows, a.out)


def report(rows: list[dict], out: str | None) -> int:
    """Say the device and its workqueues, and write ``rows`` with them to ``out`` (where given)."""
    import torch

    # the hardware workqueues this process's context got (read when CUDA started): a multi-stream
    # graph's branches may queue behind each other with the driver's default 8 (gpu/connections.py)
    env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={env or 'unset (8)'}; {torch.cuda.get_device_name()}")
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "cuda_device_max_connections": env,
                                         "device": torch.cuda.get_device_name()}, indent=1) + "\n")
    return 0


def by_branches(ks: list[int], rounds: int, x, out: str | None, reduce: str = "chain") -> int:
    """Each of ``ks`` branches compiled multi-stream (compile's defaults), timed in turn per round;
    ``reduce``: how the model sums them (``Branches``: a chain of adds, or one kernel)."""
    import gpuloom
    from engine_models import Branches
    from test_engine_gpu import _replay_ms

    width = x.shape[1]
    built = {k: gpuloom.compile(Branches(k=k, width=width, depth=16, reduce=reduce).eval().cuda(), (x,), max_batch=1,
                                streams="max" if k > 1 else 1) for k in ks}
    rows = []
    for r in range(rounds):
        got = []
        for k in (ks if r % 2 == 0 else ks[::-1]):  # (alternating the order between rounds)
            cm = built[k]
            t, d = _replay_ms(cm, x), _replay_ms(cm, x, busy_ahead=True)
            got.append({"round": r, "branches": k, "reduce": reduce, "width": width, "streams": cm.plan.num_streams, "ms": round(t, 4),
                        "busy_ms": round(d, 4)})
        fewest = min(got, key=lambda row: row["branches"])["busy_ms"]
        for row in sorted(got, key=lambda row: row["branches"]):
            row["busy_over_fewest"] = round(row["busy_ms"] / fewest, 3)
            print(json.dumps(row), flush=True)
        rows += got
    return report(rows, out)


if __name__ == "__main__":
    sys.exit(main())
