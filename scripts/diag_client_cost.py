#!/usr/bin/env python
"""CPU the load generator's client spends per request of a 600 KB image tensor: aiohttp against the lean one.

Why: on the H200 host the e2e benchmark's client processes share 16 CPUs with the server they measure
(six clients, eight front-end workers, the runtime), and at mix6 x0.75-x1 each client ran at 0.6-0.9
CPU-s/s and fell behind its schedule (run 84). A cheaper client leaves that CPU to the server. This
drives a stand-in KServe v2 server (another process: it answers metadata, and every infer with a
1,000-float binary output, reading the whole body) open loop at ``--rate`` with ``loadgen``'s engine,
the clients taking turns (A B B A ...), and reports each leg's CPU seconds per request in this
process (``time.process_time`` around the leg; imports done before).

    .venv/bin/python scripts/diag_client_cost.py --rate 200 --duration 5 --rounds 2 --out /tmp/client_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_protocol import free_port, server_process  # noqa: E402

SHAPE = [-1, 3, 224, 224]


def stand_in_server(port: int) -> None:
    """A KServe v2 server that costs nothing but reading the body (runs in its own process)."""
    import numpy as np
    from aiohttp import web

    head = json.dumps({"model_name": "m", "outputs": [{"name": "out", "datatype": "FP32", "shape": [1, 1000],
                                                        "parameters": {"binary_data_size": 4000}}]}).encode()
    reply = head + np.zeros(1000, np.float32).tobytes()

    async def metadata(_):
        return web.json_response({"name": "m", "inputs": [{"name": "input0", "datatype": "FP32", "shape": SHAPE}],
                                  "outputs": [{"name": "out", "datatype": "FP32", "shape": [-1, 1000]}]})

    async def ready(_):
        return web.Response()

    async def infer(request):
        await request.read()
        return web.Response(body=reply, headers={"Inference-Header-Content-Length": str(len(head)),
                                                 "Content-Type": "application/octet-stream"})

    app = web.Application(client_max_size=1 << 24)
    app.router.add_get("/v2/models/m", metadata)
    app.router.add_get("/v2/models/m/ready", ready)  # what server_process waits for
    app.router.add_post("/v2/models/m/infer", infer)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, open loop (default 200)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals per leg (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both clients, in A B B A order (default 2)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the stand-in server's process
    ap.add_argument("--out", default=None, metavar="FILE", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if a.serve is not None:
        stand_in_server(a.serve)
        return 0
    if not (a.rate > 0 and a.duration > 0 and a.rounds >= 1):
        ap.error("--rate and --duration must be positive, --rounds >= 1")
    import aiohttp  # noqa: F401 - imported before any leg, so no leg pays for it

    from gpuloom.serve import httpconn  # noqa: F401
    from gpuloom.serve.loadgen import CLIENTS, _run, arrival_times

    port = free_port()
    with server_process([sys.executable, __file__, "--serve", str(port)], port, "m", env=dict(os.environ)):
        times = arrival_times(a.rate, a.duration, poisson=True, seed=0)
        legs = []
        for rnd in range(a.rounds):
            for client in (CLIENTS if rnd % 2 == 0 else CLIENTS[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                res = asyncio.run(_run(f"127.0.0.1:{port}", "m", times, batch=1, binary=True, slo_ms=100.0,
                                       timeout_s=30.0, seed=0, client=client))
                cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                leg = {"client": client, "round": rnd, "sent": res.sent, "ok": res.ok, "errors": res.errors,
                       "cpu_us_per_request": cpu / max(1, res.sent) * 1e6, "cpu_s_per_s": cpu / wall,
                       "p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "send_lag_max_ms": res.send_lag_max_ms}
                legs.append(leg)
                print(f"round {rnd + 1} {client:>7}: {leg['cpu_us_per_request']:.0f} us of CPU per request, "
                      f"ok {res.ok}/{res.sent}, p50 {res.p50_ms:.2f} ms, p99 {res.p99_ms:.2f} ms, "
                      f"send lag max {res.send_lag_max_ms:.1f} ms", flush=True)
    by = {c: [x["cpu_us_per_request"] for x in legs if x["client"] == c] for c in CLIENTS}
    ratio = [lean / aio for lean, aio in zip(by["lean"], by["aiohttp"])]
    print("lean / aiohttp CPU per request, per round: " + " ".join(f"{r:.2f}" for r in ratio))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"rate": a.rate, "duration_s": a.duration, "tensor_shape": [1, *SHAPE[1:]],
                                           "legs": legs, "lean_over_aiohttp": ratio,
                                           "date": time.strftime("%Y-%m-%d")}, indent=1))
    ok = all(x["ok"] == x["sent"] for x in legs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
