#!/usr/bin/env python
"""Does compile's split-GEMM default cost the multi-stream overlap of independent branches? (GPU)

``tests/test_engine_gpu.py::test_independent_branches_overlap`` asks four equal branches of 16 linear
layers (512 wide, batch 1) to replay multi-stream within 1.5x one branch's time. It passed at 1.45x
(0.129 / 0.089 ms, engine report) and failed at 1.57x in run 146 (0.1515 / 0.0967 ms), after
``split_gemms`` became compile's default on CUDA (thirty-ninth session). This times both, in one
process, each way, alternating: one branch, four branches multi-stream and single-stream.

    PYTHONPATH=. python3 scripts/diag_branch_overlap.py --rounds 3
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
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    x = torch.randn(1, 512, device="cuda")
    built = {}
    for split in (None, False):
        one = gpuloom.compile(Branches(k=1, width=512, depth=16).eval().cuda(), (x,), max_batch=1, streams=1,
                              split_gemms=split)
        model = Branches(k=4, width=512, depth=16).eval().cuda()
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
    # the hardware workqueues this process's context got (read when CUDA started): a multi-stream
    # graph's branches may queue behind each other with the driver's default 8 (gpu/connections.py)
    env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={env or 'unset (8)'}; {torch.cuda.get_device_name()}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "cuda_device_max_connections": env,
                                           "device": torch.cuda.get_device_name()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
