#!/usr/bin/env python
"""Would the HTTP workers' requests cost the runtime's process less through a shared-memory ring that
the runtime's own loop thread drains, than through the socket bridge's threads? CPU, stand-ins only.

Why: on the H200 the runtime's interpreter was 83-86% busy in the HTTP legs of ``serve_e2e.py``, the
bridge's threads a third of it (runs 71-74, ``docs/reports/serving.md``), while their Python work per
request is ~15 us: the rest is a reader's wake-up per request, a writer's per reply, and the GIL
hand-offs between them and the runtime's thread. Sending replies from the runtime's thread (run 73)
lost. The design this measures has no bridge thread at all: a worker writes a request into a ring in
memory it shares with the runtime's process and posts a process-shared POSIX semaphore that the
runtime's loop sleeps on anyway (``runtime/waker.py``); the loop thread, once awake, takes every
request in the ring, submits it, and the replies go into a second ring with one post of the
worker's semaphore per drain (``sem_post`` keeps the GIL: no hand-off).

Both transports carry what ``diag_bridge_cost.py`` sends: a request whose tensor lies in the worker's
arena (only its JSON travels), parsed with the bridge's own ``unpack_tensors``; a reply of
``--out-bytes`` bytes of outputs made with the bridge's ``pack``; each request's future answered by
a stand-in runtime at once. ``--transport ring,ring-thread,socket`` takes turns run by run in this
one process (the socket runs are ``diag_bridge_cost.run_once``: the real ``InferBridge``;
``ring-thread`` drains the ring on a bridge thread of its own and hands each request to a stand-in
runtime thread, which replies: the ring without touching the runtime's loop). For each run: requests
per s, CPU microseconds per request of the whole process and of its threads, and of the client
process. x86 only (the ring relies on stores not being reordered, as x86 guarantees).

    .venv/bin/python scripts/diag_ring_bridge.py --window 8 --rate 1700 --repeat 5 --out /tmp/ring.json
    .venv/bin/python scripts/diag_ring_bridge.py --window 64 --repeat 5      # saturation
    .venv/bin/python scripts/diag_ring_bridge.py --transport ring,ring-thread,socket --window 8 --rate 1700
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import ctypes.util
import json
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import diag_bridge_cost  # noqa: E402
from gpuloom.serve.wire import pack, payload_bytes, unpack_tensors  # noqa: E402

TRANSPORTS = ("ring", "ring-thread", "socket")
SLOTS = 1024  # ring entries (a power of two); a window never exceeds it
REQ_SLOT = 512  # bytes per request entry: length, then the request's JSON
_SEM, _IDX = 64, 64  # bytes per semaphore, per ring index (one cache line each)

_libc = ctypes.util.find_library("c") or "libc.so.6"
_FAST = ctypes.PyDLL(_libc, use_errno=True)  # sem_post / sem_trywait never block: keep the GIL
_SLOW = ctypes.CDLL(_libc, use_errno=True)  # waits release the GIL
for _f, _lib in (("sem_init", _FAST), ("sem_post", _FAST), ("sem_trywait", _FAST), ("sem_clockwait", _SLOW)):
    getattr(_lib, _f).restype = ctypes.c_int


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Shared:
    """The block a worker and the runtime's process share: two semaphores, two rings' indices, the
    request ring (JSON per entry), the reply ring (JSON and outputs per entry) and the arena."""

    def __init__(self, out_bytes: int, in_bytes: int) -> None:
        self.rep_slot = 512 + out_bytes
        self.off_req = 2 * _SEM + 4 * _IDX
        self.off_rep = self.off_req + SLOTS * REQ_SLOT
        self.off_arena = self.off_rep + SLOTS * self.rep_slot
        self.mm = mmap.mmap(-1, self.off_arena + max(in_bytes, 64))  # MAP_SHARED: the forked client sees it
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.view = memoryview(self.mm)
        # request tail (worker writes), request head (runtime), reply tail (runtime), reply head (worker)
        self.idx = [np.frombuffer(self.mm, np.uint64, 1, 2 * _SEM + i * _IDX) for i in range(4)]
        for i in range(2):
            if _FAST.sem_init(ctypes.c_void_p(self.base + i * _SEM), 1, 0) != 0:  # pshared=1
                raise OSError(ctypes.get_errno(), "sem_init")

    def post(self, which: int) -> None:
        _FAST.sem_post(ctypes.c_void_p(self.base + which * _SEM))

    def wait(self, which: int, timeout_s: float) -> None:
        """Sleep (GIL released) until a post or ``timeout_s``; then take every further post made."""
        sem = ctypes.c_void_p(self.base + which * _SEM)
        deadline = time.monotonic() + max(0.0, timeout_s)
        ts = _Timespec(int(deadline), int((deadline - int(deadline)) * 1e9))
        _SLOW.sem_clockwait(sem, 1, ctypes.byref(ts))  # CLOCK_MONOTONIC
        while _FAST.sem_trywait(sem) == 0:
            pass


SERVER_SEM, CLIENT_SEM = 0, 1
REQ_TAIL, REQ_HEAD, REP_TAIL, REP_HEAD = range(4)


class RingLoop:
    """The runtime's loop thread in the ring design: sleeps on its semaphore, drains the request ring,
    answers each request's future at once (the stand-in runtime), writes each reply, posts once.

    ``separate_runtime``: the ``ring-thread`` variant, which leaves the runtime's loop alone. This
    thread is then a bridge thread of its own, and each future is answered on a stand-in runtime thread
    (as ``diag_bridge_cost``'s), which writes the reply and posts the worker once per reply."""

    def __init__(self, sh: Shared, out_bytes: int, separate_runtime: bool = False) -> None:
        self.sh = sh
        self.outputs = {"y": np.zeros((1, max(1, out_bytes // 4)), np.float32)}
        self.answered = 0
        self.stop = threading.Event()
        self._runtime = diag_bridge_cost.StandInCore(out_bytes) if separate_runtime else None
        name = "gpuloom-bridge-ring" if separate_runtime else "gpuloom-ring-loop"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        if self._runtime is not None:
            self._runtime.close()

    def _run(self) -> None:
        sh, view = self.sh, self.sh.view
        req_tail, req_head, rep_tail = sh.idx[REQ_TAIL], sh.idx[REQ_HEAD], sh.idx[REP_TAIL]
        arena = view[sh.off_arena:]
        while not self.stop.is_set():
            sh.wait(SERVER_SEM, 0.05)
            head, tail = int(req_head[0]), int(req_tail[0])
            if head == tail:
                continue
            while head < tail:
                at = sh.off_req + (head % SLOTS) * REQ_SLOT
                n = int.from_bytes(view[at:at + 4], "little")
                meta = json.loads(bytes(view[at + 4:at + 4 + n]))
                off = meta["arena"]
                inputs = unpack_tensors(meta, arena[off:off + payload_bytes(meta)])  # as the bridge does
                assert inputs["x"].shape == (1, 1024)
                if self._runtime is None:
                    fut: cf.Future = cf.Future()  # the runtime's future, answered at once by the stand-in
                    fut.add_done_callback(lambda f, rid=meta["id"]: self._reply(rid, f.result()))
                    fut.set_result(self.outputs)
                else:  # submitted to the runtime's thread, which answers it and replies
                    fut, _ = self._runtime.submit("m", None, inputs, None)
                    fut.add_done_callback(lambda f, rid=meta["id"]: (self._reply(rid, f.result()),
                                                                     sh.post(CLIENT_SEM)))
                head += 1
            req_head[0] = head
            if self._runtime is None:
                sh.post(CLIENT_SEM)  # one wake of the worker per drain

    def _reply(self, rid: int, outs: dict) -> None:
        """Write the reply frame (the bridge's ``pack``) into the next reply entry."""
        sh, view = self.sh, self.sh.view
        tail = int(sh.idx[REP_TAIL][0])
        at = sh.off_rep + (tail % SLOTS) * sh.rep_slot
        pos = at + 4
        for part in pack({"id": rid, "status": 200, "names": list(outs)}, [np.asarray(v) for v in outs.values()]):
            n = len(part)
            view[pos:pos + n] = part
            pos += n
        view[at:at + 4] = (pos - at - 4).to_bytes(4, "little")
        sh.idx[REP_TAIL][0] = tail + 1
        self.answered += 1


def ring_client(sh: Shared, window: int, rate: float, stop_at: float) -> None:
    """The worker: writes requests (tensors already in the arena) at ``rate`` with at most ``window``
    outstanding, posts the runtime's semaphore per request, reads the replies when posted."""
    view = sh.view
    req_tail, rep_tail, rep_head = sh.idx[REQ_TAIL], sh.idx[REP_TAIL], sh.idx[REP_HEAD]
    x = np.ones((1, 1024), np.float32)
    metas = []
    for i in range(4096):
        meta = {"id": i, "model": "m", "version": None, "deadline_ms": None, "outputs": None, "arena": 0,
                "tensors": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "nbytes": x.nbytes}]}
        js = json.dumps(meta).encode()
        metas.append(len(js).to_bytes(4, "little") + js)
    view[sh.off_arena:sh.off_arena + x.nbytes] = memoryview(x).cast("B")
    sent = answered = 0
    period = 1.0 / rate if rate > 0 else 0.0
    next_at = time.perf_counter()
    while time.perf_counter() < stop_at:
        now = time.perf_counter()
        while sent - answered < window and (not period or now >= next_at):
            at = sh.off_req + (sent % SLOTS) * REQ_SLOT
            m = metas[sent & 4095]
            view[at:at + len(m)] = m
            sent += 1
            req_tail[0] = sent  # after the entry: x86 keeps the stores in order
            sh.post(SERVER_SEM)  # one post per request, as a worker's send per request
            if period:
                next_at = max(next_at + period, now - 0.05)
        wait = 0.05 if not period or sent - answered >= window else max(0.0, next_at - time.perf_counter())
        if int(rep_tail[0]) == answered:
            sh.wait(CLIENT_SEM, wait)
        tail = int(rep_tail[0])
        while answered < tail:
            at = sh.off_rep + (answered % SLOTS) * sh.rep_slot
            n = int.from_bytes(view[at:at + 4], "little")
            jlen = int.from_bytes(view[at + 4:at + 8], "big")  # the frame's header (FRAME: !IQ)
            meta = json.loads(bytes(view[at + 16:at + 16 + jlen]))
            if meta.get("status") != 200 or n < 12 + jlen:
                raise SystemExit(f"bad reply: {meta}")
            answered += 1
        rep_head[0] = answered


def run_ring(args, transport: str = "ring") -> dict:
    sh = Shared(args.out_bytes, 4096)
    end = time.perf_counter() + args.warmup_s + args.seconds + 0.5
    proc = mp.get_context("fork").Process(target=ring_client, args=(sh, args.window, args.rate, end))
    proc.start()  # before this process starts threads (fork copies only the calling thread)
    loop = RingLoop(sh, args.out_bytes, separate_runtime=transport == "ring-thread")
    stop = threading.Event()
    if args.busy_us > 0:
        threading.Thread(target=diag_bridge_cost._busy, args=(stop, args.busy_us), name="busy-python",
                         daemon=True).start()
    try:
        w = diag_bridge_cost.measure_window(lambda: loop.answered, proc.pid, args.warmup_s, args.seconds)
    finally:
        proc.join(10)
        stop.set()
        loop.close()
    if transport == "ring":
        bridge, runtime = 0.0, w.us("gpuloom-ring")
    else:
        bridge, runtime = w.us("gpuloom-bridge"), w.us("gpuloom-runtime")
    return {"transport": transport, "requests_per_s": round(w.n / w.wall, 1), "requests": w.n,
            "bridge_us_per_req": bridge, "runtime_us_per_req": runtime,
            "process_us_per_req": w.us("process"), "client_us_per_req": round(w.client_s / w.n * 1e6, 2)}


def run_socket(args) -> dict:
    r = diag_bridge_cost.run_once(argparse.Namespace(**{**vars(args), "in_bytes": 4096, "inline": False}))
    return {"transport": "socket", "requests_per_s": r["requests_per_s"], "requests": r["requests"],
            "bridge_us_per_req": r["bridge_us_per_req"], "runtime_us_per_req": r["runtime_standin_us_per_req"],
            "process_us_per_req": r["process_us_per_req"], "client_us_per_req": r["client_us_per_req"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="ring,socket",
                    help="a comma list of ring (drained by the runtime's loop thread), ring-thread (drained by "
                         "a bridge thread of its own) and socket (InferBridge), taking turns run by run "
                         "(default ring,socket)")
    ap.add_argument("--window", type=int, default=64, help="requests outstanding (default 64)")
    ap.add_argument("--rate", type=float, default=0.0, help="pace sends to this many requests/s (0: as fast as answered)")
    ap.add_argument("--out-bytes", type=int, default=4096, help="reply tensor bytes (default 4096)")
    ap.add_argument("--busy-us", type=float, default=0.0, help="a Python thread holds the GIL this many us per ms")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the runs and their summary here (JSON)")
    args = ap.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64"):
        ap.error("the ring relies on x86's store order; this is " + platform.machine())
    if not 0 < args.window <= SLOTS // 2:
        ap.error(f"--window must be in 1..{SLOTS // 2}")
    modes = [m.strip() for m in args.transport.split(",") if m.strip()]
    if not modes or any(m not in TRANSPORTS for m in modes):
        ap.error(f"--transport: expected a comma list of {TRANSPORTS}, got {args.transport!r}")
    runs = []
    for i in range(args.repeat):
        for m in modes:
            r = run_socket(args) if m == "socket" else run_ring(args, m)
            runs.append(r)
            print(json.dumps({"run": i, **r}), flush=True)
    summary = {m: {k: round(statistics.median(r[k] for r in runs if r["transport"] == m), 2)
                   for k in runs[0] if k != "transport"} for m in modes}
    print(json.dumps({"median": summary}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "host": {"python": platform.python_version(),
                                              "cpus": os.cpu_count()}, "runs": runs, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
