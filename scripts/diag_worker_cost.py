#!/usr/bin/env python
"""CPU time an HTTP front-end worker spends per request of a 600 KB image tensor, and where it goes.

Why: on the H200 at mix6 x1 (run 80, ``docs/reports/serving.md``) the HTTP clients fell 1.6 s behind
their schedule while the runtime's process had CPU to spare, so the limit was the four front-end
workers or the client processes. This measures one worker on the CPU: the real ``Server`` with
``http_workers=1`` in front of a CPU service whose model takes a (3, 224, 224) float32 image (about
as cheap as a model can be, so the runtime is never the limit), driven open loop at ``--rate`` by
``gpuloom load``'s engine with binary tensor data. Reported: the worker's CPU seconds per request
(``/proc``, the process's start-up subtracted: its CPU is read once it listens and again at the
end), and with ``--profile FILE`` the worker runs under cProfile (about 2x slower) and the top
functions by own time are printed.

    .venv/bin/python scripts/diag_worker_cost.py --rate 200 --duration 5 --out /tmp/worker.json
    .venv/bin/python scripts/diag_worker_cost.py --rate 200 --duration 5 --profile /tmp/worker.prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, open loop (default 200)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals (default 5)")
    ap.add_argument("--profile", default=None, metavar="FILE", help="run the worker under cProfile, stats here")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if not (a.rate > 0 and a.duration > 0):
        ap.error("--rate and --duration must be positive")

    import numpy as np
    import torch

    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec
    from gpuloom.runtime.threadcpu import stat_cpu_s
    from gpuloom.serve import loadgen
    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.server import Server

    if a.profile:  # the worker's command line, run under cProfile instead
        popen = subprocess.Popen

        def profiled(cmd, *args, **kw):
            if list(cmd[1:3]) == ["-m", "gpuloom.serve.frontend"]:
                cmd = [cmd[0], "-m", "cProfile", "-o", a.profile, *cmd[1:]]
            return popen(cmd, *args, **kw)

        subprocess.Popen = profiled
    svc = InferenceService(policy="dstack", device="cpu", queue_limit=4096)
    svc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no profile on CPU: a crude one
        model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 1000)).eval()
        svc.load(ModelConfig("image", (TensorSpec("x", (3, 224, 224), "float32"),), max_batch=8, slo_ms=2000), model)
    server = Server(ServeCore(svc, None), host="127.0.0.1", http_port=0, grpc_port=None, http_workers=1)
    try:
        addr = server.start()
        pid = server.worker_pids()[0]
        cpu0, t0 = stat_cpu_s(f"/proc/{pid}/stat"), time.monotonic()
        times = np.arange(0.0, a.duration, 1.0 / a.rate)
        res = asyncio.run(loadgen._run(addr.http_url, "image", times, batch=1, binary=True, slo_ms=2000.0,
                                       timeout_s=30.0, seed=1)).as_dict()
        cpu1, wall = stat_cpu_s(f"/proc/{pid}/stat"), time.monotonic() - t0
    finally:
        server.stop()  # the worker exits normally: cProfile writes its file
        svc.close()
    ok = int(res["ok"])
    out = {"rate": a.rate, "duration_s": a.duration, "sent": int(res["sent"]), "ok": ok,
           "errors": {str(k): int(v) for k, v in res["errors"].items()},
           "worker_cpu_s_per_s": (cpu1 - cpu0) / wall, "worker_cpu_us_per_request": (cpu1 - cpu0) / max(ok, 1) * 1e6,
           "profiled": bool(a.profile), "request_bytes": 3 * 224 * 224 * 4}
    print(json.dumps(out, indent=1))
    if a.profile:
        import pstats

        pstats.Stats(a.profile).sort_stats("tottime").print_stats(20)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0 if ok == out["sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
