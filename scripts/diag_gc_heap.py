#!/usr/bin/env python
"""How long does a full garbage collection stop ``gpuloom serve``, and what does it scan? (issue 6)

The soak (``scripts/soak_serve.py``, 900 s on the example repository's two small models) saw four
full collections of up to 171 ms: every request in flight waits that long. The service freezes the
heap after a load (``gcpause.freeze_loaded``), so a full collection should scan only what was made
since. This starts the server in process as ``gpuloom serve`` does (the same command's code), waits
until it answers, then reports the collector's view: objects frozen, objects still tracked (what a full
collection scans), and a full collection's pause; again after ``--requests`` inferences over HTTP and
gRPC. Writes JSON to ``--out``.

    PYTHONPATH=. .venv/bin/python scripts/diag_gc_heap.py --requests 2000 --out gc_heap.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_http_big_tensor import _wait_ready  # noqa: E402
from bench_protocol import free_port  # noqa: E402


CLIENT = r"""
import sys, numpy as np, tritonclient.grpc as grpcclient, tritonclient.http as httpclient
http_port, grpc_port, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
h = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
x = np.random.rand(1, 16).astype(np.float32)
for i in range(n):
    c, mod = (g, grpcclient) if i % 2 else (h, httpclient)
    inp = mod.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    c.infer("tiny_mlp", [inp])
"""


def heap(label: str) -> dict:
    """The collector's view now: frozen and tracked objects, a full collection's pause, and the
    modules the tracked objects' types come from (the ten largest)."""
    from gpuloom.runtime.gcpause import GcMonitor

    before = GcMonitor.installed().snapshot()  # the server's record of the collector so far
    tracked = gc.get_objects()
    kinds = Counter(type(o).__module__ or "?" for o in tracked)
    n = len(tracked)
    del tracked
    t0 = time.perf_counter()
    gc.collect()
    ms = (time.perf_counter() - t0) * 1000.0
    row = {"at": label, "frozen": gc.get_freeze_count(), "tracked": n, "full_collection_ms": round(ms, 1),
           "tracked_by_type_module": dict(kinds.most_common(10)), "server_collections_so_far": before}
    print(f"{label:<22} frozen {row['frozen']:>9,}  tracked {n:>9,}  full collection {ms:7.1f} ms", file=sys.stderr)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", default=str(ROOT / "examples" / "repository"))
    ap.add_argument("--models", default="tiny_mlp,tiny_cnn")
    ap.add_argument("--requests", type=int, default=2000, help="inferences after start-up, half over gRPC")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from gpuloom.commands import serve

    http_port, grpc_port = free_port(), free_port()
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([a.repository, "--models", a.models, "--http-port", str(http_port), "--grpc-port",
                         str(grpc_port), "--device", "cpu", "--profile-cache", "none"])

    def measure() -> None:
        try:
            _wait_ready(http_port, timeout_s=300.0)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        rows = [heap("ready")]
        # the clients in a process of their own: their modules and objects stay out of this heap
        subprocess.run([sys.executable, "-c", CLIENT, str(http_port), str(grpc_port), str(a.requests)], check=True)
        rows.append(heap(f"after {a.requests} requests"))
        out = {"python": sys.version.split()[0], "models": a.models, "requests": a.requests, "rows": rows}
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
        sys.stderr.flush()
        os._exit(0)  # no drain needed: the numbers are taken

    threading.Thread(target=measure, daemon=True, name="measure").start()
    serve.run(args)  # on this (the main) thread, as the command runs it
    return 1  # only if the server stopped before the measurement ended


if __name__ == "__main__":
    sys.exit(main())
