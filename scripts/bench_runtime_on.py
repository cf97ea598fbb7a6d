#!/usr/bin/env python
"""``gpuloom serve --runtime-on http`` against the default on a real CPU model, in turn, same client.

Why: with the runtime's loop on the HTTP event loop (``--runtime-on http``) a request needs no thread
hand-off, which lowered the p99 of a one-layer model (``scripts/bench_protocol.py``,
``docs/reports/serving.md``); but while a batch runs the HTTP loop waits, so a model whose forward
takes milliseconds may lose throughput, and every other request (a health check) waits for the batch.
This measures both on ``--model`` from ``--repository`` (default: mobilenet_v3_small at 64x64 from
``examples/repository``): requests/s with ``--concurrency`` closed-loop clients; p50/p99 at a fixed
``--rate``; and, while 8 clients saturate the server, the latency of ``GET /v2/health/ready``.

    PYTHONPATH=. python scripts/bench_runtime_on.py --repeat 2 --out /tmp/runtime_on.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_protocol import GPULOOM_SERVER, free_port, server_process  # noqa: E402


def _health_probe(port: int, stop: threading.Event, out: list[float], period_s: float = 0.02) -> None:
    """GET /v2/health/ready every ``period_s`` until ``stop``; each latency (ms) into ``out``."""
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                r.read()
            out.append((time.perf_counter() - t0) * 1e3)
        except OSError:
            out.append(float("inf"))
        stop.wait(period_s)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(port: int, model: str, args) -> dict:
    from gpuloom.serve.loadgen import run_closed, run_load

    url = f"127.0.0.1:{port}"
    run_load(url, model, rate=20, duration_s=1.0)  # warm up
    out = {"fixed_rate": run_load(url, model, rate=args.rate, duration_s=args.duration, seed=2).as_dict()}
    for c in args.concurrency:
        probes: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=_health_probe, args=(port, stop, probes), daemon=True)
        th.start()
        try:
            out[f"closed_c{c}"] = run_closed(url, model, concurrency=c, duration_s=args.duration, seed=3,
                                             slo_ms=1000.0).as_dict()
        finally:
            stop.set()
            th.join()
        out[f"closed_c{c}"]["health_ms"] = {"n": len(probes), "p50": _pct(probes, 0.5), "p99": _pct(probes, 0.99),
                                            "max": max(probes, default=float("nan")),
                                            "mean": statistics.fmean(probes) if probes else float("nan")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", default=str(ROOT / "examples" / "repository"))
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per point (default 5)")
    ap.add_argument("--rate", type=float, default=20.0, help="fixed rate for the latency point, req/s (default 20)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop clients (default 1 8)")
    ap.add_argument("--repeat", type=int, default=1, help="measure both servers this many times, in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {"default": [], "runtime_on_http": ["--runtime-on", "http"]}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = []
    for rep in range(max(1, args.repeat)):
        run = {}
        for name, extra in variants.items():
            port = free_port()
            cmd = [sys.executable, "-c", GPULOOM_SERVER, args.repository, "--models", args.model, "--no-grpc",
                   "--http-port", str(port), "--device", "cpu", "--http-workers", "0", *extra]
            with server_process(cmd, port, args.model, env=env, timeout_s=300):
                print(f"[{rep}] measuring {name} ...", file=sys.stderr, flush=True)
                run[name] = measure(port, args.model, args)
        runs.append(run)
    print(f"{'run':<4}{'server':<17}" + "".join(f"{'req/s c' + str(c):>11}{'health p99 ms':>15}" for c in args.concurrency)
          + f"{'p50 ms':>9}{'p99 ms':>9}  (at {args.rate:g} req/s)")
    for i, run in enumerate(runs):
        for name, r in run.items():
            cells = "".join(f"{r[f'closed_c{c}']['throughput']:>11.0f}{r[f'closed_c{c}']['health_ms']['p99']:>15.1f}"
                            for c in args.concurrency)
            p50, p99 = (r["fixed_rate"][k] for k in ("p50_ms", "p99_ms"))  # (None: no request succeeded)
            print(f"{i:<4}{name:<17}{cells}{'-' if p50 is None else f'{p50:.2f}':>9}{'-' if p99 is None else f'{p99:.2f}':>9}")
    if args.out:
        result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
                  "model": args.model, "repository": args.repository, "duration_s": args.duration,
                  "rate": args.rate, "variants": {k: " ".join(v) for k, v in variants.items()}, "runs": runs}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
