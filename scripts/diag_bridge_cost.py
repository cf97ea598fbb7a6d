#!/usr/bin/env python
"""CPU cost of the HTTP workers' bridge (``gpuloom.serve.bridge.InferBridge``) per request, on CPU.

Why: on the H200 host at 1,700 requests/s the bridge's threads used 0.32-0.35 CPU-seconds per
second (~200 us per request) in the runtime's GIL-bound process; every socket call there releases
and re-takes the GIL. This isolates the bridge: the real ``InferBridge`` on a Unix socket, around a
stand-in core whose "runtime" thread (``gpuloom-runtime-standin``) answers each request at once
with a fixed output, driven by a client in a separate process (so its CPU is not this process's)
that speaks the workers' protocol with frames made by the module's own ``pack``: a hello carrying a
shared-memory arena, then requests whose tensors are in the arena (empty payload), each sent with
its own ``sendall`` as a worker does, ``--window`` of them outstanding (closed loop), optionally
paced to ``--rate`` requests/s. ``--busy-us`` adds a thread spinning in pure Python for that many
microseconds out of every millisecond: GIL contention like the runtime's threads make.

For each run it reports requests/s and CPU microseconds per request of the bridge's threads
(``gpuloom-bridge*``, from ``gpuloom.runtime.threadcpu``; also reader and writer apart), of the stand-in runtime thread (which
runs the futures' callbacks: the reply's ``pack``), of the whole process, and of the client (when
it nears one core, the client is the limit, not the bridge); then the median and
spread (min, max) over ``--repeat`` runs, each with a fresh bridge and client.

    .venv/bin/python scripts/diag_bridge_cost.py --repeat 5 --out /tmp/bridge.json
    .venv/bin/python scripts/diag_bridge_cost.py --window 4 --rate 1700 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuloom.runtime.threadcpu import stat_cpu_s, thread_cpu  # noqa: E402
from gpuloom.serve import arena as arena_mod  # noqa: E402
from gpuloom.serve.bridge import InferBridge  # noqa: E402
from gpuloom.serve.wire import FRAME, pack  # noqa: E402


class StandInCore:
    """What ``InferBridge`` calls on ``ServeCore``; one thread answers each request at once."""

    service = None  # no device: the bridge never page-locks the arena

    def __init__(self, out_bytes: int) -> None:
        self.outputs = {"y": np.zeros((1, max(1, out_bytes // 4)), np.float32)}
        self.answered = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="gpuloom-runtime-standin", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (on_done := self._q.get()) is not None:
            on_done(self.outputs, None)  # the bridge's answer, here, as on the runtime's thread

    def check_outputs(self, name, version, wanted) -> None:
        return None

    def submit(self, name, version, inputs, deadline_ms, waited_ms=0.0, checked_for=None, on_done=None):
        self._q.put(on_done)
        return None, None

    def settle(self, name, outputs, error, t0, rows):
        self.answered += 1
        if error is not None:
            raise error
        return outputs

    def close(self) -> None:
        self._q.put(None)
        self._t.join(5)


def _busy(stop: threading.Event, busy_us: float) -> None:
    """Spin in pure Python ``busy_us`` out of every 1000 us (holding the GIL), sleep the rest."""
    while not stop.is_set():
        end = time.perf_counter() + busy_us * 1e-6
        while time.perf_counter() < end:
            pass
        time.sleep(max(0.0, (1000 - busy_us) * 1e-6))


# -- the client (a separate process, like a worker) -----------------------------------------------
def client(path: str, window: int, rate: float, in_bytes: int, inline: bool) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    x = np.ones((1, max(1, in_bytes // 4)), np.float32)
    shared = None if inline else arena_mod.Arena(max(1 << 16, x.nbytes * 2))
    js = json.dumps({"hello": 1, "arena_bytes": shared.size if shared else 0}).encode()
    socket.send_fds(sock, [FRAME.pack(len(js), 0) + js], [shared.fd] if shared else [])
    base = {"model": "m", "version": None, "deadline_ms": None, "outputs": None}
    frames = []
    for i in range(4096):  # ids repeat; the bridge only echoes them
        if shared is None:
            frames.append(b"".join(bytes(b) for b in pack(dict(base, id=i, names=["x"]), [x])))
        else:
            frames.append(b"".join(bytes(b) for b in pack(dict(base, id=i, names=["x"], arena=0), [x],
                                                          into=shared.view(0, x.nbytes))))
    buf, sent, answered, outstanding = bytearray(), 0, 0, 0
    period = 1.0 / rate if rate > 0 else 0.0
    next_at = time.perf_counter()
    try:
        while True:
            now = time.perf_counter()
            while outstanding < window and (not period or now >= next_at):
                sock.sendall(frames[sent & 4095])  # one send per request, as a worker does
                sent += 1
                outstanding += 1
                if period:
                    next_at = max(next_at + period, now - 0.05)  # catch up at most 50 ms late
            timeout = None if not period or outstanding >= window else max(0.0, next_at - time.perf_counter())
            r, _, _ = select.select([sock], [], [], timeout)
            if not r:
                continue
            data = sock.recv(1 << 20)
            if not data:
                return
            buf += data
            pos = 0
            while len(buf) - pos >= FRAME.size:
                jlen, plen = FRAME.unpack_from(buf, pos)
                end = pos + FRAME.size + jlen + plen
                if end > len(buf):
                    break
                meta = json.loads(bytes(buf[pos + FRAME.size:pos + FRAME.size + jlen]))
                if meta.get("status") != 200:
                    raise SystemExit(f"bad reply: {meta}")
                pos = end
                answered += 1
                outstanding -= 1
            del buf[:pos]
    except (ConnectionError, OSError):
        return
    finally:
        sock.close()


def _named_cpu() -> dict[str, float]:
    """CPU seconds of this process's bridge threads by full name (reader ``gpuloom-bridge``, writer
    ``gpuloom-bridge-write``), which ``thread_cpu`` sums under one role by default."""
    return {k: v for k, v in thread_cpu(key=lambda name: name).items() if k.startswith("gpuloom-bridge")}


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (the client: is it the limit?)."""
    return stat_cpu_s(f"/proc/{pid}/stat") or 0.0


# -- one measured run ----------------------------------------------------------------------------
def run_once(args) -> dict:
    core = StandInCore(args.out_bytes)
    tmp = tempfile.mkdtemp(prefix="gpuloom-bridge-")
    path = os.path.join(tmp, "bridge.sock")
    bridge = InferBridge(core, path)
    stop = threading.Event()
    busy = None
    if args.busy_us > 0:
        busy = threading.Thread(target=_busy, args=(stop, args.busy_us), name="busy-python", daemon=True)
        busy.start()
    cmd = [sys.executable, __file__, "--client", path, "--window", str(args.window), "--rate", str(args.rate),
           "--in-bytes", str(args.in_bytes)] + (["--inline"] if args.inline else [])
    proc = subprocess.Popen(cmd)
    try:
        w = measure_window(lambda: core.answered, proc.pid, args.warmup_s, args.seconds)
    finally:
        bridge.close()
        proc.wait(10)
        stop.set()
        core.close()
    return {"requests_per_s": round(w.n / w.wall, 1), "requests": w.n,
            "bridge_us_per_req": w.us("gpuloom-bridge"),
            "reader_us_per_req": w.named_us("gpuloom-bridge"), "writer_us_per_req": w.named_us("gpuloom-bridge-write"),
            "runtime_standin_us_per_req": w.us("gpuloom-runtime"),
            "process_us_per_req": w.us("process"), "client_us_per_req": round(w.client_s / w.n * 1e6, 2),
            "bridge_cpu_s_per_s": round(w.cpu_s("gpuloom-bridge") / w.wall, 4)}


@dataclass
class Window:
    """Requests answered and CPU used over one measured window (:func:`measure_window`)."""

    n: int  # requests answered
    wall: float  # s
    client_s: float  # CPU s of the client process
    cpu0: dict  # this process's CPU s per thread role (``thread_cpu``), at the start ...
    cpu1: dict  # ... and at the end
    named0: dict  # the bridge's threads' CPU s by full name (``_named_cpu``), at the start ...
    named1: dict  # ... and at the end

    def cpu_s(self, role: str) -> float:
        return self.cpu1.get(role, 0.0) - self.cpu0.get(role, 0.0)

    def us(self, role: str) -> float:
        """CPU microseconds per request of the threads of ``role`` (or "process")."""
        return round(self.cpu_s(role) / self.n * 1e6, 2)

    def named_us(self, name: str) -> float:
        """CPU microseconds per request of the bridge thread(s) named exactly ``name``."""
        return round((self.named1.get(name, 0.0) - self.named0.get(name, 0.0)) / self.n * 1e6, 2)


def measure_window(answered: Callable[[], int], client_pid: int, warmup_s: float, seconds: float) -> Window:
    """Sleep ``warmup_s`` (SystemExit if nothing was answered by then), then measure ``seconds``."""
    time.sleep(warmup_s)
    if answered() == 0:
        raise SystemExit("no request answered during the warm-up")

    def snap() -> tuple:
        return answered(), thread_cpu(), time.perf_counter(), _proc_cpu(client_pid), _named_cpu()

    n0, c0, t0, k0, b0 = snap()
    time.sleep(seconds)
    n1, c1, t1, k1, b1 = snap()
    return Window(n1 - n0, t1 - t0, k1 - k0, c0, c1, b0, b1)


def summarize(runs: list[dict]) -> dict:
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        out[k] = {"median": round(statistics.median(vals), 4), "min": min(vals), "max": max(vals)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=64, help="requests outstanding (closed loop; default 64)")
    ap.add_argument("--rate", type=float, default=0.0, help="pace sends to this many requests/s (0: as fast as answered)")
    ap.add_argument("--in-bytes", type=int, default=4096, help="request tensor bytes (in the arena; default 4096)")
    ap.add_argument("--out-bytes", type=int, default=4096, help="reply tensor bytes (inline on the socket; default 4096)")
    ap.add_argument("--inline", action="store_true", help="send request tensors on the socket, not through the arena")
    ap.add_argument("--busy-us", type=float, default=0.0, help="a Python thread holds the GIL this many us per ms")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="write the runs and their summary here (JSON)")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: run as the client
    args = ap.parse_args(argv)
    if args.client:
        client(args.client, args.window, args.rate, args.in_bytes, args.inline)
        return 0
    runs = []
    for i in range(args.repeat):
        r = run_once(args)
        runs.append(r)
        print(json.dumps({"run": i, **r}), flush=True)
    summary = summarize(runs)
    print(json.dumps({"summary": summary}, indent=1))
    if args.out:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        Path(args.out).write_text(json.dumps({
            "label": args.label, "git": rev, "args": {k: v for k, v in vars(args).items() if k != "client"},
            "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
            "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
