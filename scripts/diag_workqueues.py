"""Do SM partitions wait on each other through shared hardware workqueues? (issue 5, tenth session)

On the H200, dstack's partitions held each batch 0.8-1.5 ms beyond its device time, more as the
load grew, and inception_v3's multi-stream batch-1 graph ran 2-6x its profile beside busy
partitions. The driver's documentation says green contexts with disjoint SMs may still wait on each
other through the hardware workqueues they share (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default),
unless each is created with a "balanced" workqueue configuration (CUDA 13.1+ drivers).

Each partition replays a CUDA graph of a chain of small kernels (``--branches B``: B chains forked
off one stream, as in inception_v3's graphs), timed with CUDA events: alone (the others idle), then
all partitions together (every one replaying back to back, all queued behind one gate so they
start at once), then alone again. Independent partitions keep their time per replay together
(ratio ~1.0); partitions queued behind each other's kernels do not.

Connections are read when CUDA starts, so the parent runs one child process per configuration:
``CUDA_DEVICE_MAX_CONNECTIONS`` unset / 32, workqueues shared / balanced:

    python3 scripts/diag_workqueues.py --out $OUT/diag/workqueues.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.e2e import save_json  # noqa: E402

CONFIGS = [  # (name, extra environment, workqueues)
    ("default", {}, "shared"),
    ("connections32", {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, "shared"),
    ("balanced", {}, "balanced"),
    ("connections32_balanced", {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, "balanced"),
]


def child(sizes: list[int], workqueues: str, branches: list[int], kernels: int, dim: int, rounds: int) -> dict:
    """One configuration, in this process: per partition and branch count, ms per replay alone and together."""
    import torch

    from gpuloom.gpu import Partitioner

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"sizes": sizes, "kernels": kernels, "dim": dim, "rounds": rounds, "runs": [],
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    with Partitioner(sizes, mode="green", workqueues=workqueues) as parts:
        out["workqueues"], out["workqueue_error"] = parts.workqueues, parts.workqueue_error
        for b in branches:
            graphs, keep = [], []
            for p in parts:
                factory = p.stream_factory()
                main = factory()
                side = [factory() for _ in range(b)] if b > 1 else [main]
                ws = [torch.randn(dim, dim, device="cuda") / dim ** 0.5 for _ in side]
                xs = [torch.randn(dim, dim, device="cuda") for _ in side]

                def work(main=main, side=side, ws=ws, xs=xs):
                    for s, w, x in zip(side, ws, xs):
                        s.wait_stream(main)
                        with torch.cuda.stream(s):
                            y = x
                            for _ in range(kernels // len(side)):
                                y = torch.tanh(y @ w)
                            x.copy_(y)
                    for s in side:
                        main.wait_stream(s)

                graphs.append(p.capture_graph(work))
                keep.append((ws, xs))
            torch.cuda.synchronize()
            streams = [p.stream for p in parts]

            gate_stream = torch.cuda.Stream()

            def timed(which: list[int]) -> list[list[float]]:
                """Replay the graphs of partitions ``which`` ``rounds`` times, round-robin; ms per replay.
                Every replay is queued behind a 50 ms gate first, so the partitions start together
                whatever the host's launch rate."""
                ev = {i: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(rounds)] for i in which}
                with torch.cuda.stream(gate_stream):
                    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles
                gate = torch.cuda.Event()
                gate.record(gate_stream)
                for i in which:
                    streams[i].wait_event(gate)
                for r in range(rounds):
                    for i in which:
                        with torch.cuda.stream(streams[i]):
                            ev[i][r][0].record()
                            graphs[i].replay()
                            ev[i][r][1].record()
                torch.cuda.synchronize()
                return [[a.elapsed_time(z) for a, z in ev[i]] for i in which]

            for i in range(len(graphs)):  # warm
                timed([i])
            half = max(1, rounds // 2)  # together: the first half, while the slower partitions still run

            def alone() -> list[float]:
                return [statistics.median(timed([i])[0]) for i in range(len(graphs))]

            before = alone()
            together = [statistics.median(t[:half]) for t in timed(list(range(len(graphs))))]
            after = alone()  # alone, together, alone: drift of the clocks shows as before != after
            rows = []
            for i, p in enumerate(parts):
                a, t = (before[i] + after[i]) / 2, together[i]
                rows.append({"sms": p.sms, "alone_ms": round(a, 4), "together_ms": round(t, 4),
                             "ratio": round(t / a, 3), "alone_before_after_ms": [round(before[i], 4), round(after[i], 4)]})
            out["runs"].append({"branches": b, "partitions": rows,
                                "mean_ratio": round(statistics.mean(r["ratio"] for r in rows), 3),
                                "max_ratio": round(max(r["ratio"] for r in rows), 3)})
            graphs.clear()  # destroyed before their partitions close
            keep.clear()
            torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,24,24,24,28", help="partition SMs (default: dstack's mix6 x0.75 layout)")
    ap.add_argument("--branches", default="1,4", help="chains forked per graph, one run each (default 1,4)")
    ap.add_argument("--kernels", type=int, default=96, help="matmul+tanh steps per graph (default 96)")
    ap.add_argument("--dim", type=int, default=256, help="square matrix size (default 256)")
    ap.add_argument("--rounds", type=int, default=40, help="replays per partition and timing (default 40)")
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS),
                    help=f"configurations to run (default all: {', '.join(c[0] for c in CONFIGS)})")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration's child")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: workqueues of this child
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    branches = [int(b) for b in a.branches.split(",")]
    if a.child:
        print(json.dumps(child(sizes, a.child, branches, a.kernels, a.dim, a.rounds)))
        return 0
    known = {c[0]: c for c in CONFIGS}
    wanted = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in wanted if c not in known]
    if bad:
        ap.error(f"unknown configurations {bad}; known: {list(known)}")
    report = {"method": __doc__.split("\n\n")[1].replace("\n", " "), "argv": sys.argv[1:], "configs": {}}
    for name in wanted:
        _, env, wq = known[name]
        t0 = time.monotonic()
        cmd = [sys.executable, __file__, "--child", wq, "--sizes", a.sizes, "--branches", a.branches,
               "--kernels", str(a.kernels), "--dim", str(a.dim), "--rounds", str(a.rounds)]
        child_env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}  # as named
        try:
            p = subprocess.run(cmd, env={**child_env, **env}, capture_output=True, text=True, timeout=a.timeout)
            res = {"error": f"exit {p.returncode}: {p.stderr[-1500:]}"}
            if p.returncode == 0:
                try:
                    res = json.loads(p.stdout.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    res = {"error": f"no report on the child's last line: {p.stdout[-500:]!r} {p.stderr[-1000:]}"}
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {a.timeout:g} s"}
        res.update(env=env, seconds=round(time.monotonic() - t0, 1))
        report["configs"][name] = res
        for run in res.get("runs", []):
            print(f"{name:24s} workqueues {res['workqueues']:8s} branches {run['branches']}: together/alone "
                  f"mean {run['mean_ratio']:.3f} max {run['max_ratio']:.3f}  "
                  + " ".join(f"{r['sms']}:{r['alone_ms']:.3f}->{r['together_ms']:.3f}" for r in run["partitions"]))
        if "error" in res:
            print(f"{name}: {res['error']}")
        elif res.get("workqueue_error"):
            print(f"{name}: balanced workqueues refused: {res['workqueue_error']}")
        if a.out:  # after every configuration, whole or not at all
            save_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
