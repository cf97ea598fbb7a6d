#!/usr/bin/env python
"""How a model load disturbs a model being served (CPU; issue 6's "load while serving").

Serves ``examples/repository`` through ``gpuloom serve``'s Server with two HTTP workers, sends
``tiny_mlp`` requests back to back from one client, and reloads ``tiny_cnn`` ``--reloads`` times.
For each GIL switch interval the service uses while it compiles (``--switch-ms``, patched into
``service.LOAD_SWITCH_INTERVAL_MS``; 5 is Python's default), it reports the slowest ``tiny_mlp``
request that started while the model compiled, how many started then, and the slowest one
submitted during the re-plan that follows, with the server's own ``Server-Timing`` split.

    .venv/bin/python scripts/diag_load_while_serving.py --switch-ms 5,0.5 --out /tmp/load.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # serve_fake: the service the server tests use


def measure(switch_ms: float, reloads: int) -> dict:
    import serve_fake
    import tritonclient.http as tritonhttp

    import gpuloom.runtime.service as svc_mod
    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository
    from gpuloom.serve.server import Server

    saved = {"LOAD_SWITCH_INTERVAL_MS": svc_mod.LOAD_SWITCH_INTERVAL_MS,
             **{n: getattr(svc_mod.InferenceService, n) for n in ("_compile", "_replan")}}
    svc_mod.LOAD_SWITCH_INTERVAL_MS = switch_ms
    phases: list[tuple[str, float, float]] = []
    for name in ("_compile", "_replan"):  # when each phase of a load ran
        real = saved[name]

        def timed(self, *a, _real=real, _name=name, **k):
            t = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                phases.append((_name, t, time.perf_counter()))

        setattr(svc_mod.InferenceService, name, timed)
    try:
        repo = load_repository(ROOT / "examples" / "repository")
        service = serve_fake.make_service()
        core = ServeCore(service, repo, max_body_bytes=1 << 20)
        for name in repo.names():
            core.load(name)
        server = Server(core, http_port=0, grpc_port=None, http_workers=2)
        addr = server.start()
        sent: list[tuple[float, float, int, str]] = []  # start, ms, status, Server-Timing
        stop = threading.Event()
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]})

        def hammer() -> None:
            c = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
            while not stop.is_set():
                t = time.perf_counter()
                c.request("POST", "/v2/models/tiny_mlp/infer", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                sent.append((t, (time.perf_counter() - t) * 1000.0, r.status, r.getheader("Server-Timing") or ""))

        th = threading.Thread(target=hammer)
        th.start()
        client = tritonhttp.InferenceServerClient(addr.http_url)
        time.sleep(0.5)
        rows = []
        for _ in range(reloads):
            client.unload_model("tiny_cnn")
            phases.clear()
            t1 = time.perf_counter()
            client.load_model("tiny_cnn")
            time.sleep(0.3)
            comp = next(p for p in phases if p[0] == "_compile")
            plan = next(p for p in phases if p[0] == "_replan")
            in_compile = [x for x in sent if comp[1] <= x[0] <= comp[2]]
            in_plan = [x for x in sent if plan[1] <= x[0] <= plan[2]]
            worst_plan = max(in_plan, key=lambda x: x[1], default=None)
            rows.append({"compile_ms": (comp[2] - comp[1]) * 1000.0, "load_ms": (plan[2] - t1) * 1000.0,
                         "during_compile": {"requests": len(in_compile),
                                            "worst_ms": max((x[1] for x in in_compile), default=None)},
                         "during_replan": {"requests": len(in_plan),
                                           "worst_ms": worst_plan[1] if worst_plan else None,
                                           "server_timing": worst_plan[3] if worst_plan else None}})
        stop.set()
        th.join()
        server.stop()
        statuses = sorted({x[2] for x in sent})
        return {"switch_ms": switch_ms, "reloads": rows, "statuses": statuses, "requests": len(sent)}
    finally:
        svc_mod.LOAD_SWITCH_INTERVAL_MS = saved.pop("LOAD_SWITCH_INTERVAL_MS")
        for name, real in saved.items():
            setattr(svc_mod.InferenceService, name, real)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch-ms", default="5,0.5", help="switch intervals while compiling, ms, comma-separated")
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ms in (float(x) for x in a.switch_ms.split(",")):
            r = measure(ms, a.reloads)
            results.append(r)
            worst_c = [x["during_compile"]["worst_ms"] for x in r["reloads"] if x["during_compile"]["worst_ms"]]
            worst_p = [x["during_replan"]["worst_ms"] for x in r["reloads"] if x["during_replan"]["worst_ms"]]
            print(f"switch {ms:g} ms while compiling: slowest tiny_mlp request during the compile "
                  f"{min(worst_c):.0f}-{max(worst_c):.0f} ms, requests started then "
                  f"{[x['during_compile']['requests'] for x in r['reloads']]}; during the re-plan "
                  f"{[round(w) for w in worst_p]} ms; statuses {r['statuses']}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": "build VM, 2 cores",
                                           "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
