"""Requests lost when a server with front-end workers stops under keep-alive load (CPU).

``N`` client threads send infer requests in a tight loop, each on its own kept-alive connection, to a
server with ``--workers`` front-end workers; after ``--run-s`` the server stops (``Server.stop``:
the workers first, then the runtime drains). Per client: its requests answered (200 or 503), and
whether one it had sent got no answer at all (the connection reset or closed with the request
unread: **lost**), or it found the listener closed when it connected again (**refused**, which a
client handles). Legs with ``GPULOOM_WORKER_STOP_GRACE_S`` = each of ``--grace`` in turn (0: the
workers close at once, as before the sixty-eighth session; the default 2: ``frontend.GracefulStop``).

    PYTHONPATH=. python scripts/diag_worker_sigterm.py --clients 50 --repeat 3 --grace 0,2
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def one_leg(clients: int, workers: int, run_s: float) -> dict:
    import serve_fake

    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository
    from gpuloom.serve.server import Server

    core = ServeCore(serve_fake.make_service(), load_repository(ROOT / "examples" / "repository" / "tiny_mlp.yaml"))
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=workers)
    addr = server.start()
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
    stop_at = threading.Event()
    out = [{"ok": 0, "unavailable": 0, "lost": False, "refused": False, "other": ""} for _ in range(clients)]

    def client(i: int) -> None:
        r = out[i]
        conn = None
        while True:
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
                    conn.connect()
            except OSError:  # the listener is closed: a refusal, which a client sees and handles
                r["refused"] = True
                return
            try:
                conn.request("POST", "/v2/models/tiny_mlp/infer", body)
            except OSError:  # the request never went out (the peer had closed): not lost, resent on a new one
                conn.close()
                conn = None
                if stop_at.is_set():
                    r["refused"] = True  # (counted as the client's clean end)
                    return
                continue
            try:
                resp = conn.getresponse()
                resp.read()
            except (http.client.RemoteDisconnected, ConnectionError) as e:  # sent, never answered
                r["lost"] = True
                r["other"] = type(e).__name__
                return
            except Exception as e:  # noqa: BLE001
                r["other"] = f"{type(e).__name__}: {e}"
                return
            if resp.status == 200:
                r["ok"] += 1
            else:
                r["unavailable"] += 1
            if resp.getheader("Connection") == "close" or resp.will_close:
                conn.close()
                conn = None

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(run_s)
    stop_at.set()
    t0 = time.monotonic()
    server.stop()
    stop_s = time.monotonic() - t0
    for t in threads:
        t.join(30)
    return {"clients": clients, "lost": sum(r["lost"] for r in out), "refused": sum(r["refused"] for r in out),
            "answered": sum(r["ok"] + r["unavailable"] for r in out), "stop_s": round(stop_s, 3),
            "other": sorted({r["other"] for r in out if r["other"] and not r["lost"]})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--run-s", type=float, default=1.5, help="seconds of load before the stop (default 1.5)")
    ap.add_argument("--grace", default="0,2", help="GPULOOM_WORKER_STOP_GRACE_S per leg, comma-separated (default 0,2)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the legs, in turns (default 3)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    graces = [g.strip() for g in args.grace.split(",") if g.strip()]
    legs = []
    for rnd in range(args.repeat):
        for g in graces if rnd % 2 == 0 else graces[::-1]:
            os.environ["GPULOOM_WORKER_STOP_GRACE_S"] = g  # the workers read it when they start
            leg = dict(one_leg(args.clients, args.workers, args.run_s), grace_s=float(g), round=rnd)
            legs.append(leg)
            print(f"round {rnd + 1} grace {g} s: {leg['lost']} of {leg['clients']} clients lost a request, "
                  f"{leg['refused']} refused at reconnect, {leg['answered']} answered, stop {leg['stop_s']} s"
                  + (f", other: {leg['other']}" if leg["other"] else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "host_cpus": os.cpu_count(), "legs": legs},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
