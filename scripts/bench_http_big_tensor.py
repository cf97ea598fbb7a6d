#!/usr/bin/env python
"""HTTP with image-sized tensors on CPU: where the server's front end saturates.

On the H200 the mix6 models' 600 KB requests (3x224x224 float32) kept about 1% of the in-process
goodput over HTTP (``docs/results/serve/e2e_h200_*.json``). This reproduces the front end's part on
CPU: ``gpuloom serve`` with one trivial model (mean pool + ``nn.Linear(3, 10)``) that takes a
3x224x224 input, driven by ``gpuloom load`` at fixed rates; the server source tree can be chosen, so
two versions run side by side in one invocation.

    .venv/bin/python scripts/bench_http_big_tensor.py --rates 400,800 --out docs/results/serve/http_big_tensor_cpu.json \
        [--tree before=/tmp/old --tree after=.]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_protocol import free_port  # noqa: E402

NETS = """import torch
class Pool(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(3, 10)
    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))
def pool():
    return Pool()
"""
MODEL = """name: big
source: bignets.py:pool
inputs:
  - {name: input, shape: [3, 224, 224], dtype: float32}
outputs:
  - {name: output0, shape: [10], dtype: float32}
max_batch: 16
slo_ms: 100
rate_hint: 400
"""


def _wait_ready(port: int, timeout_s: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s")


def _cpu_ms(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, ms (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    p = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


def measure(tree: Path, repo: Path, rates: list[float], duration: float, policy: str, workers: int = 0) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    extra = ["--http-workers", str(workers)] if workers else []
    srv = subprocess.Popen([sys.executable, "-m", "gpuloom.cli", "serve", str(repo), "--http-port", str(port),
                            "--no-grpc", "--policy", policy, *extra], env=env, cwd=str(tree),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port)
        out = []
        for r in rates:
            cpu0 = _cpu_ms(srv.pid)
            kids = _children(srv.pid)  # front-end workers, if any
            kid0 = sum(_cpu_ms(k) for k in kids)
            p = subprocess.run([sys.executable, "-m", "gpuloom.cli", "load", f"127.0.0.1:{port}", "--model", "big",
                                "--rate", str(r), "--duration", str(duration), "--json"],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res.pop("latencies_ms", None)
            # the server's CPU per answered request: its cost, whatever the client machine does
            res["server_cpu_ms_per_request"] = (_cpu_ms(srv.pid) - cpu0) / max(1, res["ok"])  # the runtime's process
            res["worker_cpu_ms_per_request"] = (sum(_cpu_ms(k) for k in kids) - kid0) / max(1, res["ok"])
            out.append(res)
            print(f"  {tree}: {r:g} req/s -> {res['throughput']:.0f} req/s, SLO {res['slo_attainment']:.3f}, "
                  f"p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms, errors {res['errors']}, "
                  f"CPU ms/request: runtime process {res['server_cpu_ms_per_request']:.3f}, "
                  f"workers {res['worker_cpu_ms_per_request']:.3f}", flush=True)
        return out
    finally:
        srv.terminate()
        srv.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="400,800", help="offered req/s, comma-separated")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--policy", default="dstack")
    ap.add_argument("--tree", action="append", default=None, metavar="LABEL=DIR",
                    help="a gpuloom source tree to serve from (default: this one, labelled 'current')")
    ap.add_argument("--http-workers", default="0", help="comma-separated --http-workers settings to compare (default 0)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    trees = [t.split("=", 1) for t in (args.tree or [f"current={ROOT}"])]
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d)
        (repo / "bignets.py").write_text(NETS)
        (repo / "big.yaml").write_text(MODEL)
        results = {}
        for label, path in trees:
            for w in (int(x) for x in args.http_workers.split(",")):
                key = label if w == 0 and args.http_workers == "0" else f"{label}, {w} http workers"
                results[key] = measure(Path(path).resolve(), repo, rates, args.duration, args.policy, w)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "model": "mean pool + nn.Linear(3, 10), input 3x224x224 float32 (602 KB binary request body)",
           "policy": args.policy, "duration_s": args.duration, "client": "gpuloom load (open loop, Poisson)",
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
