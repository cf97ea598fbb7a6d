#!/usr/bin/env python
"""Protocol overhead on CPU: gpuloom serve vs the KServe Python model server, one linear layer.

Both servers serve the same ``nn.Linear(16, 4)`` (same weights; KServe's side computes it with numpy,
gpuloom's through its runtime) on this machine; the same open-loop client (``gpuloom.serve.loadgen``,
the engine of ``gpuloom load``) drives each in turn:

- **saturation**: closed loop (perf_analyzer's concurrency mode) with ``--concurrency`` clients -> req/s;
- **fixed rate**: ``--rate`` req/s for ``--duration`` s -> p50 / p99 latency.

KServe runs from its own virtual environment (``--kserve-python``, default ``/tmp/ksv/bin/python``:
``python -m venv /tmp/ksv && /tmp/ksv/bin/pip install kserve``). Without it only gpuloom is measured
and the script says so. Writes JSON to ``--out``.

    .venv/bin/python scripts/bench_protocol.py --duration 5 --out docs/results/serve/protocol_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(ROOT))

KSERVE_SERVER = r'''
import logging, os, sys, numpy as np
if len(sys.argv) > 4:  # a CPU list: run on those CPUs only, as gpuloom serve --cpus does
    os.sched_setaffinity(0, {int(c) for c in sys.argv[4].split(",")})
import kserve.logging, kserve.model_server
kserve.logging.configure_logging = kserve.model_server.configure_logging = lambda *a, **k: None
logging.disable(logging.WARNING)  # no per-request access/latency logs (gpuloom logs none either)
from kserve import Model, ModelServer, InferRequest, InferResponse, InferOutput
W = np.load(sys.argv[2]); B = np.load(sys.argv[3])
class Linear(Model):
    def __init__(self):
        super().__init__("linear"); self.ready = True
    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        x = payload.inputs[0].as_numpy()
        y = (x @ W.T + B).astype(np.float32)
        out = InferOutput(name="y", shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=payload.use_binary_outputs if hasattr(payload, "use_binary_outputs") else False)
        return InferResponse(model_name=self.name, infer_outputs=[out], response_id=payload.id or "")
ModelServer(http_port=int(sys.argv[1]), grpc_port=int(sys.argv[1]) + 1, workers=1, enable_grpc=False,
            enable_docs_url=False, enable_latency_logging=False).start([Linear()])
'''

GPULOOM_SERVER = (
    "import argparse, sys; from gpuloom.commands import serve\n"
    "p = argparse.ArgumentParser(); serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))\n"
)


def free_port() -> int:
    """A loopback port free right now (the benchmark scripts' one helper for it; others import it)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_ready(port: int, model: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    t_end = time.time() + timeout_s
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s")


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, model: str, *, env: dict, cwd=None, timeout_s: float = 120.0):
    """A server started from ``cmd``, ready (``model`` answers ready on ``port``) inside the block,
    stopped (SIGTERM, then SIGKILL after 30 s) when it ends."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        _wait_ready(port, model, proc, timeout_s=timeout_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pinned(cpus: str | None, fn, *args):
    """``fn(*args)`` with this process on ``cpus`` (a list like ``0`` or ``0,2``), then back as it was."""
    if not cpus:
        return fn(*args)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    try:
        return fn(*args)
    finally:
        os.sched_setaffinity(0, before)


def measure(port: int, args) -> dict:
    from gpuloom.serve.loadgen import run_closed, run_load

    url = f"127.0.0.1:{port}"
    kw = dict(binary=args.binary, slo_ms=100.0, inputs=[{"name": "x", "shape": [-1, 16], "datatype": "FP32"}], timeout_s=60.0)
    run_load(url, "linear", rate=50, duration_s=1.0, **kw)  # warm up
    fixed = run_load(url, "linear", rate=args.rate, duration_s=args.rate_duration or args.duration, seed=2, **kw)
    out = {"fixed_rate": fixed.as_dict(), "_fixed_latencies_ms": list(fixed.latencies_ms)}  # not written out
    for c in args.concurrency:
        out[f"closed_c{c}"] = run_closed(url, "linear", concurrency=c, duration_s=args.duration, seed=3, **kw).as_dict()
    if args.sat_rate:
        out["open_overload"] = run_load(url, "linear", rate=args.sat_rate, duration_s=args.duration, seed=1, **kw).as_dict()
    return out


def _compare_tails(run: dict, rate: float) -> None:
    """Each gpuloom server's p99 at the fixed rate against KServe's in this run, with a bootstrap
    interval of the difference (gpuloom.bench.compare): whether the lower p99 is beyond what
    resampling each server's own requests could explain. Written as ``run[name]["p99_vs_kserve"]``."""
    from gpuloom.bench.compare import quantile_difference

    ref = run.get("kserve", {}).pop("_fixed_latencies_ms", None)
    for name, r in run.items():
        lat = r.pop("_fixed_latencies_ms", None)
        if ref is None or lat is None or len(lat) < 2 or len(ref) < 2:
            continue
        d = quantile_difference(lat, ref, q=0.99)
        r["p99_vs_kserve"] = {k: d[k] for k in ("diff", "lo", "hi", "level", "n_a", "n_b", "a_lower")}
        verdict = {True: "lower", False: "higher", None: "not distinguishable"}[d["a_lower"]]
        print(f"  {name}: p99 at {rate:g} req/s {d['a']:.2f} ms against KServe's {d['b']:.2f}: {d['diff']:+.2f} ms "
              f"(95% bootstrap {d['lo']:+.2f} to {d['hi']:+.2f}; {verdict})", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement (default 5)")
    ap.add_argument("--rate", type=float, default=100.0, help="fixed rate for the latency point, req/s (default 100)")
    ap.add_argument("--rate-duration", type=float, default=None,
                    help="seconds of the fixed-rate point (default --duration): its p99 is the 1%% tail, so "
                         "at 100 req/s 5 s give it 5 requests and 20 s 20")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                    help="closed-loop client counts for the saturation points (default 1 8 32)")
    ap.add_argument("--sat-rate", type=float, default=0.0, help="also offer this open-loop overload rate, req/s (default off)")
    ap.add_argument("--json-tensors", dest="binary", action="store_false", help="JSON tensors instead of binary data")
    ap.add_argument("--kserve-python", default=os.environ.get("KSERVE_PYTHON", "/tmp/ksv/bin/python"))
    ap.add_argument("--policy", default="dstack")
    ap.add_argument("--gpuloom-variant", action="append", default=[], metavar='LABEL="ARGS"',
                    help='also measure gpuloom serve with these extra arguments, e.g. early="--early-answer"; '
                         'an argument PYTHONPATH=DIR runs that server from the checkout at DIR instead (e.g. '
                         'the code before a change: git archive BASE | tar -x -C DIR)')
    ap.add_argument("--kserve-cpus", default=None, metavar="LIST",
                    help="also measure KServe run on these CPUs only (e.g. 1), beside the unpinned one: the fair "
                         "match for a gpuloom variant with --cpus")
    ap.add_argument("--client-cpus", default=None, metavar="LIST",
                    help="run the load client on these CPUs only (e.g. 0) while it measures; with the servers on "
                         "the others (--kserve-cpus 1, a gpuloom variant with --cpus 1) the two stop competing for "
                         "one core (the servers are started before the client is pinned, so they do not inherit it)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure every server this many times, in turn (A, B, KServe, A, B, KServe, ...), and "
                         "print each figure's range (default 1; the JSON keeps every run under 'runs')")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "repository"))
    import nets

    lin = nets.linear()
    tmp = Path(tempfile.mkdtemp(prefix="gpuloom-bench-"))
    w, b = tmp / "w.npy", tmp / "b.npy"
    np.save(w, lin.weight.detach().numpy())
    np.save(b, lin.bias.detach().numpy())
    (tmp / "linear.yaml").write_text(
        f"name: linear\nsource: '{ROOT / 'examples' / 'repository' / 'nets.py'}:linear'\n"
        "inputs: [{name: x, shape: [16], dtype: float32}]\noutputs: [{name: y, shape: [4], dtype: float32}]\n"
        "max_batch: 32\nslo_ms: 100\nrate_hint: 200\n"
    )
    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                                 "torch": torch.__version__},
                     "model": "nn.Linear(16, 4), batch 1 per request", "duration_s": args.duration,
                     "rate_duration_s": args.rate_duration or args.duration,
                     "binary_tensors": args.binary, "client_cpus": args.client_cpus, "servers": {}}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-c", GPULOOM_SERVER, str(tmp / "linear.yaml"), "--no-grpc", "--policy", args.policy,
            "--http-port", "{port}", "--device", "cpu"]
    servers = [("gpuloom", base)]
    envs: dict[str, dict] = {}
    for v in args.gpuloom_variant:  # e.g. early="--early-answer": the same server with more options
        label, _, extra = v.partition("=")
        words = extra.split()
        paths = [w.partition("=")[2] for w in words if w.startswith("PYTHONPATH=")]
        if paths:  # another checkout's server (same options otherwise)
            envs[f"gpuloom:{label}"] = dict(env, PYTHONPATH=str(Path(paths[-1]).resolve()))
        servers.append((f"gpuloom:{label}", base + [w for w in words if not w.startswith("PYTHONPATH=")]))
    if Path(args.kserve_python).exists():
        version = subprocess.run([args.kserve_python, "-c", "import importlib.metadata as m; print(m.version('kserve'))"],
                                 capture_output=True, text=True)
        results["machine"]["kserve"] = version.stdout.strip() or None
        servers.append(("kserve", [args.kserve_python, "-c", KSERVE_SERVER, "{port}", str(w), str(b)]))
        if args.kserve_cpus:
            servers.append((f"kserve:cpus{args.kserve_cpus}",
                            [args.kserve_python, "-c", KSERVE_SERVER, "{port}", str(w), str(b), args.kserve_cpus]))
    else:
        print(f"kserve not found at {args.kserve_python}: measuring gpuloom only", file=sys.stderr)
        results["kserve"] = "not installed"
    runs: list[dict] = []
    for rep in range(max(1, args.repeat)):
        run: dict = {}
        for name, cmd in servers:
            port = free_port()
            cmd = [c.replace("{port}", str(port)) for c in cmd]
            with server_process(cmd, port, "linear", env=envs.get(name, env), cwd=tmp):
                print(f"[{rep}] measuring {name} on port {port} ...", file=sys.stderr, flush=True)
                run[name] = _pinned(args.client_cpus, measure, port, args)
        runs.append(run)
        _compare_tails(run, args.rate)
    results["servers"] = runs[0]
    if args.repeat > 1:
        results["runs"] = runs
        results["servers_in_turn"] = [name for name, _ in servers]
    results["server_code"] = {name: envs[name]["PYTHONPATH"] for name in envs}
    w = max(10, *(len(n) + 2 for n, _ in servers))
    cols = "".join(f"{'req/s c' + str(c):>14}" for c in args.concurrency)
    print(f"{'server':<{w}}{cols} {'p50 ms':>12} {'p99 ms':>12}  (p50/p99 at a fixed {args.rate:g} req/s; "
          f"{'min-max of ' + str(len(runs)) + ' runs' if len(runs) > 1 else 'one run'})")

    def span(vals: list[float | None], fmt: str) -> str:
        vals = [v for v in vals if v is not None]  # (None: a run in which no request succeeded)
        if not vals:
            return "-"
        lo, hi = min(vals), max(vals)
        return format(lo, fmt) if len(vals) == 1 else f"{lo:{fmt}}-{hi:{fmt}}"

    for name, _ in servers:
        rs = [r[name] for r in runs if name in r]
        vals = "".join(f"{span([r[f'closed_c{c}']['throughput'] for r in rs], '.0f'):>14}" for c in args.concurrency)
        print(f"{name:<{w}}{vals} {span([r['fixed_rate']['p50_ms'] for r in rs], '.2f'):>12} "
              f"{span([r['fixed_rate']['p99_ms'] for r in rs], '.2f'):>12}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
