#!/usr/bin/env python
"""Where the p99 of ``gpuloom serve`` goes at a low fixed rate (CPU): per-request timestamps of every leg.

Serves ``nn.Linear(16, 4)`` as ``scripts/bench_protocol.py`` does, from ``gpuloom serve`` in a
subprocess whose code is instrumented (monkeypatched here, nothing changes in the package): each
request's answer carries its own timestamps, ms from the moment the HTTP handler called
``ServeCore.infer``, in extra ``Server-Timing`` entries:

- ``sub``: ``service.submit`` returned (validation, row copies, the runtime's submit);
- ``arr``: the runtime's loop thread took the arrival (its wake-up after the post);
- ``dis``: the batch was handed to the backend (policy decision);
- ``w0`` / ``f0`` / ``f1`` / ``w1``: the watcher thread started on it / the forward started / ended
  / the watcher posted the completion;
- ``cmp``: the loop thread took the completion;
- ``res``: the service resolved the future (``_on_result``);
- ``aw``: the HTTP coroutine resumed after the await;
- ``out``: the response object was built;
- ``gcms``: garbage-collector pause ms that ended inside the request's window;
- ``rpms``: ms of dstack's re-plan checks (``Replanner.check``, on the runtime's thread) that ended inside it.

An open-loop Poisson client (the same as ``gpuloom.serve.loadgen``'s) records each request's latency
with its entries; the report compares the legs of the slowest 1-2% with the median request's.

    PYTHONPATH=. python scripts/diag_serve_tail.py --rate 100 --duration 8 --out /tmp/tail.json
    PYTHONPATH=. python scripts/diag_serve_tail.py --variant="--launch-on inline"   # side by side with a variant
    PYTHONPATH=. python scripts/diag_serve_tail.py --variant="PYTHONPATH=/tmp/base"  # ... or another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PATCHED_SERVER = r'''
import argparse, sys, threading, time, gc
pc = time.perf_counter
from gpuloom.runtime import core as rcore, exec_backend as eb, host_device as dev, service as svc
from gpuloom.serve import core as score, http_server as hs
EV = {}           # runtime request id -> {event: perf_counter s}
TL = threading.local()
GCS = []          # (end s, ms)
_g0 = [0.0]
def _gc(phase, info):
    if phase == "start":
        _g0[0] = pc()
    else:
        t = pc(); GCS.append((t, (t - _g0[0]) * 1e3))
gc.callbacks.append(_gc)

RPS = []          # (end s, ms) of dstack's re-plan checks (Replanner.check, on the runtime's thread)
from gpuloom.plan import replan as _rp
_check = _rp.Replanner.check
def check(self, now, rates):
    t = pc(); d = _check(self, now, rates); t1 = pc(); RPS.append((t1, (t1 - t) * 1e3)); return d
_rp.Replanner.check = check

def mark(rid, k):
    EV.setdefault(rid, {})[k] = pc()

_rt_submit = rcore.Runtime.submit
def rt_submit(self, model, payloads=(None,), *, timeout_ms):
    reqs = _rt_submit(self, model, payloads, timeout_ms=timeout_ms)
    TL.rids = [r.id for r in reqs]
    return reqs
rcore.Runtime.submit = rt_submit

_arr = rcore.Runtime._on_online_arrivals
def arr(self, reqs):
    t = pc()
    for r in reqs: EV.setdefault(r.id, {})["arr"] = t
    return _arr(self, reqs)
rcore.Runtime._on_online_arrivals = arr

_cmp = rcore.Runtime._on_completion
def cmp_(self, c):
    t = pc()
    for rid in c.decision.request_ids: EV.setdefault(rid, {})["cmp"] = t
    return _cmp(self, c)
rcore.Runtime._on_completion = cmp_

_bsub = eb.ExecBackend.submit
def bsub(self, d, reqs):
    t = pc()
    for r in reqs: EV.setdefault(r.id, {})["dis"] = t
    return _bsub(self, d, reqs)
eb.ExecBackend.submit = bsub

_fin = dev.CpuDeviceLayer.finish
def fin(self, ticket):
    TL.f0 = pc(); out = _fin(self, ticket); TL.f1 = pc(); return out
dev.CpuDeviceLayer.finish = fin

_comp = eb.ExecBackend._complete
def comp(self, watcher, lanes, d, requests, ticket, start):
    t = pc()
    try:
        return _comp(self, watcher, lanes, d, requests, ticket, start)
    finally:
        t1 = pc()
        for r in requests:
            e = EV.setdefault(r.id, {}); e["w0"] = t; e["f0"] = getattr(TL, "f0", t); e["f1"] = getattr(TL, "f1", t); e["w1"] = t1
eb.ExecBackend._complete = comp

_onres = svc.InferenceService._on_result
def onres(self, result, out):
    EV.setdefault(result.request.id, {}).setdefault("res", pc())
    return _onres(self, result, out)
svc.InferenceService._on_result = onres

_infer = score.ServeCore.infer
LAST = {}
async def infer(self, name, version, inputs, deadline_ms):
    t0 = pc()
    fut, _ = self.submit(name, version, inputs, deadline_ms)
    t_sub = pc()
    rids = getattr(TL, "rids", [])
    rows = next(iter(inputs.values())).shape[0]
    import asyncio
    try:
        await asyncio.wrap_future(fut)
    except BaseException:
        pass
    t_aw = pc()
    out = self.outcome(name, fut, t0, rows)
    d = {"sub": t_sub}
    for rid in rids:
        for k, v in EV.pop(rid, {}).items():
            d[k] = v
    d["aw"] = t_aw
    g = sum(ms for end, ms in list(GCS[-50:]) if end > t0)
    LAST.clear(); LAST.update({k: (v - t0) * 1e3 for k, v in d.items()}); LAST["gcms"] = g; LAST["rpms"] = sum(ms for end, ms in list(RPS[-8:]) if end > t0); LAST["_t0"] = t0
    return out
score.ServeCore.infer = infer

_ir = hs.infer_response
def infer_response(name, outputs, req, timing_ms=None):
    timing_ms = dict(timing_ms or {})
    if LAST:
        t0 = LAST.pop("_t0")
        timing_ms.update(LAST); timing_ms["out"] = (pc() - t0) * 1e3
        LAST.clear()
    return _ir(name, outputs, req, timing_ms)
hs.infer_response = infer_response

from gpuloom.commands import serve
p = argparse.ArgumentParser(); serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))
'''

LEGS = [  # (label, from, to): consecutive marks; "in" = 0 (handler called infer)
    ("submit", "in", "sub"), ("to_loop", "sub", "arr"), ("decide", "arr", "dis"), ("to_watcher", "dis", "w0"),
    ("stack", "w0", "f0"), ("forward", "f0", "f1"), ("watcher_rest", "f1", "w1"), ("to_loop2", "w1", "cmp"),
    ("book", "cmp", "res"), ("to_http", "res", "aw"), ("respond", "aw", "out"),
]


async def _drive(url: str, rate: float, duration_s: float, seed: int) -> list[dict]:
    import aiohttp

    from gpuloom.serve.loadgen import _body, arrival_times, fire_open_loop
    from gpuloom.serve.protocol import parse_server_timing

    times = arrival_times(rate, duration_s, seed=seed)
    meta = {"inputs": [{"name": "x", "shape": [-1, 16], "datatype": "FP32"}]}
    rng = np.random.default_rng(seed)
    bodies = [_body(meta, 1, True, rng) for _ in range(8)]
    rows: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        infer_url = f"http://{url}/v2/models/linear/infer"
        for _ in range(50):  # warm up
            body, headers = bodies[0]
            async with s.post(infer_url, data=body, headers=headers) as r:
                await r.read()

        async def one(i: int, t_sched: float):
            body, headers = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            async with s.post(infer_url, data=body, headers=headers) as r:
                await r.read()
                st = parse_server_timing(r.headers.get("Server-Timing"))
                code = r.status
            rows.append({"ms": (time.perf_counter() - t0) * 1e3, "lag_ms": (t0 - t_sched) * 1e3, "code": code, **st})

        await fire_open_loop(times, time.perf_counter(), one)
    return rows


def legs_of(row: dict) -> dict:
    out = {}
    if "out" not in row:
        return out
    marks = dict(row, **{"in": 0.0})
    for label, a, b in LEGS:
        if a in marks and b in marks:
            out[label] = marks[b] - marks[a]
    out["outside"] = row["ms"] - row["out"]  # the client, the network, aiohttp parsing / writing
    out["gc"] = row.get("gcms", 0.0)
    out["replan"] = row.get("rpms", 0.0)
    return out


def summarize(rows: list[dict], frac: float) -> dict:
    ok = [r for r in rows if r["code"] == 200]
    ms = np.array([r["ms"] for r in ok])
    order = np.argsort(ms)
    k = max(1, int(round(len(ok) * frac)))
    slow = [ok[i] for i in order[-k:]]
    mid = [ok[i] for i in order[len(ok) // 2 - k // 2: len(ok) // 2 - k // 2 + max(k, 5)]]

    def mean_legs(rs):
        ls = [legs_of(r) for r in rs]
        keys = [lbl for lbl, *_ in LEGS] + ["outside", "gc", "replan"]
        return {kk: float(np.mean([x[kk] for x in ls if kk in x])) if any(kk in x for x in ls) else None for kk in keys}

    all_legs = [legs_of(r) for r in ok]
    leg_pct = {}
    for kk in [lbl for lbl, *_ in LEGS] + ["outside", "gc", "replan"]:
        v = [x[kk] for x in all_legs if kk in x]
        if v:
            leg_pct[kk] = {q: float(np.percentile(v, q)) for q in (50, 90, 99)}
    return {"leg_percentiles": leg_pct, "n": len(ok), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "slowest_k": k, "slowest_ms": [float(ms[i]) for i in order[-k:]],
            "slowest_legs": mean_legs(slow), "median_legs": mean_legs(mid),
            "slowest_rows": slow, "send_lag_p99_ms": float(np.percentile([r["lag_ms"] for r in ok], 99))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--slow-frac", type=float, default=0.02, help="the slowest fraction to break down (default 0.02)")
    ap.add_argument("--variant", action="append", default=[], metavar='"SERVE ARGS"',
                    help="also measure gpuloom serve with these extra arguments (side by side, alternating)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import bench_protocol as bp  # the same model file and weights as the protocol benchmark


    tmp = Path(tempfile.mkdtemp(prefix="gpuloom-tail-"))
    (tmp / "linear.yaml").write_text(
        f"name: linear\nsource: '{ROOT / 'examples' / 'repository' / 'nets.py'}:linear'\n"
        "inputs: [{name: x, shape: [16], dtype: float32}]\noutputs: [{name: y, shape: [4], dtype: float32}]\n"
        "max_batch: 32\nslo_ms: 100\nrate_hint: 200\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    variants = [("default", [])] + [(v, v.split()) for v in args.variant]
    results: dict = {"rate": args.rate, "duration_s": args.duration, "runs": []}
    for rep in range(args.repeat):
        for label, extra in variants:
            port = bp.free_port()
            paths = [w.partition("=")[2] for w in extra if w.startswith("PYTHONPATH=")]  # another checkout's code
            run_env = dict(env, PYTHONPATH=str(Path(paths[-1]).resolve())) if paths else env
            extra = [w for w in extra if not w.startswith("PYTHONPATH=")]
            cmd = [sys.executable, "-c", PATCHED_SERVER, str(tmp / "linear.yaml"), "--no-grpc", "--http-port", str(port),
                   "--device", "cpu", *extra]
            proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp)
            try:
                bp._wait_ready(port, "linear", proc)
                rows = asyncio.run(_drive(f"127.0.0.1:{port}", args.rate, args.duration, seed=2 + rep))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            s = summarize(rows, args.slow_frac)
            s.update(variant=label, rep=rep)
            results["runs"].append(s)
            print(f"[{rep}] {label:<24} n={s['n']} p50={s['p50_ms']:.2f} p99={s['p99_ms']:.2f} "
                  f"send_lag_p99={s['send_lag_p99_ms']:.2f}", flush=True)
            print("    leg p50/p90/p99  " + " ".join(f"{k}={v[50]:.2f}/{v[90]:.2f}/{v[99]:.2f}" for k, v in s["leg_percentiles"].items()))
            for what in ("median_legs", "slowest_legs"):
                print(f"    {what:<13} " + " ".join(f"{k}={v:.2f}" for k, v in s[what].items() if v is not None), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
