"""Does freeing a page-locked buffer abort the process once the green context its copy ran on is gone?

Run 62: ``test_output_views_stay_each_requests_own_while_later_batches_run[False]`` (outputs="views"
with torch launches) aborted the test process; the raw-launch case passed. The suspect: torch's
``copy_(..., non_blocking=True)`` into a buffer from its caching host allocator records the copy's
stream on the buffer, and freeing the buffer records an event on that stream; the test held its
views past ``svc.close()``, which destroys the partitions' streams. Raw copies tell torch nothing.

Each case runs in a child process (an abort kills only the child) and reports its exit status:
- ``torch_copy_free_after_close``: the suspect; expected to abort if the suspicion is right;
- ``torch_copy_free_before_close``: the buffer is freed while the stream exists; expected fine;
- ``no_torch_copy_free_after_close``: the buffer never passed through a torch copy; expected fine.

    PYTHONPATH=. python3 scripts/diag_pinned_after_partition.py --out $OUT/diag/pinned_after_partition.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("torch_copy_free_after_close", "torch_copy_free_before_close", "no_torch_copy_free_after_close")


def child(case: str) -> None:
    import torch

    from gpuloom.gpu.partition import Partitioner

    parts = Partitioner([64, 68], mode="green")  # multiples of 8, the 4 left over on the last (H200: 132 SMs)
    stream = parts[0].stream
    buf = torch.empty(1 << 20, pin_memory=True)
    src = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    if case != "no_torch_copy_free_after_close":
        with torch.cuda.stream(stream):
            buf.copy_(src, non_blocking=True)
        stream.synchronize()
    if case == "torch_copy_free_before_close":
        del buf
        parts.close()
    else:
        parts.close()
        del buf
    torch.cuda.synchronize()
    print("freed without error", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.case:
        child(args.case)
        return 0
    results = {}
    for case in CASES:
        r = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True, timeout=120)
        results[case] = {"returncode": r.returncode, "stdout": r.stdout[-500:], "stderr": r.stderr[-1500:]}
        print(f"{case}: exit {r.returncode}\n{r.stderr[-600:]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
