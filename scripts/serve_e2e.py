#!/usr/bin/env python
"""How much of the runtime's in-process goodput survives the network layer (issue 6, H200 benchmark).

One process, one set of compiled models, one ``InferenceService`` (policy ``--policy``):

1. the workload's models are built and compiled once (:func:`gpuloom.bench.e2e.build_models`;
   ``--tiny``: small MLPs of the same names, so the whole thing runs on a CPU);
2. **in-process**: :func:`gpuloom.bench.e2e.run_point` replays the workload x ``--scale`` for
   ``--duration`` s open loop against the service (``submit`` from a Python thread, no network;
   inputs in page-locked memory, launched in place as the HTTP leg's worker arenas are, unless
   ``--inprocess-copies``);
3. **HTTP**: the same service is put behind the real HTTP server (``gpuloom.serve.server.Server``,
   the code ``gpuloom serve`` runs, on 127.0.0.1 and a free port, in this process so the compiled
   models are reused) and driven open loop with *the same arrival times* (same workload, seed and
   scale) by the project's load generator (``gpuloom.serve.loadgen``: aiohttp, Triton binary tensor
   data, binary outputs), from ``--clients`` separate client processes (so the client does not
   share the server's GIL) that start together;
4. one JSON (``--out``): both legs' goodput (on-time requests/s), SLO attainment, p50/p99 per model
   and in total, the ratio HTTP / in-process (target >= 0.9), and the books: every request the
   clients sent was answered, and the server's own books balance.

With ``--retune`` the service is re-planned for the offered rates before each leg
(``InferenceService.retune``), so neither leg inherits rates measured in the other; by default both
legs run on the plan made at load for the workload's own rates (scale 1). Latency is measured the same way in both legs:
from the moment the request is handed over (``submit`` / the HTTP POST) to its answer.

    python scripts/serve_e2e.py examples/mix6.yaml --tiny --scale 0.01 --duration 3 --out /tmp/x.json
    python scripts/serve_e2e.py examples/mix6.yaml --fake-device 8 --scale 0.125 --http-workers 1 --loop-cpu
    python scripts/serve_e2e.py examples/mix6.yaml --scale 0.5 --duration 5 --out docs/results/serve/e2e_h200.json

Exit status: 0 when every request was answered and the books balance, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpuloom.commands.serve import default_http_workers, http_workers_arg  # noqa: E402

IN_PROGRESS = "in progress: the run ended before its last scale"  # the report's error while measuring
SCHEMA = "gpuloom.serve_e2e/1"
TARGET = 0.9  # issue 6: HTTP goodput >= 90% of in-process goodput


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gpuloom.bench.e2e import ARRIVALS
    from gpuloom.serve.allowance import MODES as RETURN_ALLOWANCE
    from gpuloom.serve.bridge import DRAIN_ON, WAKEUPS

    p = argparse.ArgumentParser(prog="serve_e2e.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?", help="workload file, e.g. examples/mix6.yaml")
    p.add_argument("--tiny", action="store_true", help="small MLPs named like the workload's models (CPU runs, tests)")
    p.add_argument("--fake-device", type=float, default=None, metavar="SLOW",
                   help="no models and no GPU: a fake device whose batches take the shipped H200 profiles' time, "
                        "SLOW times longer, with SLOs SLOW times longer (gpuloom.bench.fake; each request one "
                        "4-float row): the host side alone on any machine; --scale 1/SLOW offers the GPU's load")
    p.add_argument("--scale", default="1", help="load factor(s) on the workload's rates, comma-separated (default 1); "
                   "each is one in-process and one HTTP leg over the same compiled models")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals per leg (default 5)")
    p.add_argument("--policy", default="dstack", help="scheduling policy (default dstack)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--max-batch", type=int, default=16, help="max batch each model is compiled for (default 16)")
    p.add_argument("--profiles", metavar="DIR", default=None,
                   help="profile directory (default: shipped H200 profiles on CUDA; crude ones with --tiny)")
    p.add_argument("--queue-limit", type=int, default=1024, help="per-model queue bound (default 1024)")
    p.add_argument("--http-workers", default="0", metavar="N|auto[,N...]",
                   help="HTTP front-end worker processes of the server (gpuloom serve --http-workers; auto: "
                        "gpuloom serve's default for this host; default 0). Several, comma-separated: each scale's "
                        "HTTP leg once per count, each with a server of its own on the same loaded service, so "
                        "the counts are compared in one process (see --rounds)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each scale's legs this many times (in-process, then the HTTP legs, their order "
                        "reversed every other round: A B B A), one point each: how much a leg varies on this "
                        "host, measured beside what is compared (default 1)")
    p.add_argument("--worker-ring-kb", type=int, default=None, metavar="KIB",
                   help="the front-end workers' shared rings (gpuloom serve --http-worker-ring-kb; 0: requests and "
                        "replies over the socket bridge; default: the server's)")
    p.add_argument("--worker-nice", default=None, metavar="N[,N...]",
                   help="how much lower the front-end workers' CPU priority is than the service's process "
                        "(gpuloom serve --http-worker-nice; default: the server's, frontend.WORKER_NICE). "
                        "Several, comma-separated: each worker count's HTTP leg once per value, in one process, "
                        "as --http-workers does for counts")
    p.add_argument("--ring-drain-on", default="loop", metavar="|".join(DRAIN_ON) + "[,...]",
                   help="who takes requests from the workers' rings: the runtime's loop thread (default) or a "
                        "drain thread per worker (Server(ring_drain_on=...)). Both, comma-separated: each front "
                        "end's HTTP leg once per value, in one process")
    p.add_argument("--return-allowance", default="off", metavar="|".join(RETURN_ALLOWANCE) + "[,...]",
                   help="whether the front-end workers count a request's expected time outside the runtime as "
                        "waited (gpuloom serve --http-return-allowance; default off). Both, comma-separated: each "
                        "front end's HTTP leg once per value, in one process")
    p.add_argument("--early-answer", default="off", metavar="off|on[,...]",
                   help="whether the HTTP legs' served requests are answered on their partition's watcher thread "
                        "(InferenceService(early_answer=...), set per leg on the one loaded service; the in-process "
                        "legs keep the service's off) instead of the runtime's loop thread; default off. Both, "
                        "comma-separated: each front end's HTTP leg once per value, in one process")
    p.add_argument("--intake-window-ms", default="0", metavar="MS[,MS...]",
                   help="the runtime's loop takes the workers' requests at most once per this many ms (gpuloom serve "
                        "--http-intake-window-ms; default 0: at every wake-up). Several, comma-separated: each front "
                        "end's HTTP leg once per value, in one process")
    p.add_argument("--switch-interval-ms", default="off", metavar="off|MS[,...]",
                   help="the interpreter's GIL switch interval during the HTTP legs (gpuloom serve "
                        "--switch-interval-ms; default off: Python's 5 ms; the in-process legs keep it). Several, "
                        "comma-separated: each front end's HTTP leg once per value, in one process")
    p.add_argument("--worker-wakeups", choices=WAKEUPS, default="batch",
                   help="a worker's replies wake it once per batch of 8 rows or more (default) or once per reply "
                        "(Server(worker_wakeups=...))")
    p.add_argument("--client", default="lean", metavar="NAME[,NAME]",
                   help="the HTTP client the client processes send with: lean (default; gpuloom.serve.httpconn: "
                        "about half aiohttp's CPU per request on the H200 host, which the server shares, runs 85 "
                        "and 87) or aiohttp (every run before 85); both, comma-separated: each front end's HTTP "
                        "leg once per client, in one process")
    p.add_argument("--clients", type=int, default=0,
                   help="client processes driving HTTP (default: min(models, CPUs // 2), at least 1)")
    p.add_argument("--timeout", type=float, default=30.0, help="HTTP client timeout per request, s (default 30)")
    p.add_argument("--torch-launch", action="store_true",
                   help="launch batches through torch calls instead of raw driver calls (InferenceService(raw_launch=False))")
    p.add_argument("--outputs", choices=("copies", "views"), default="copies",
                   help="InferenceService(outputs=...) for both legs: outputs copied off the page-locked buffers "
                        "(default) or views of them (gpuloom serve --outputs)")
    p.add_argument("--complete-on", choices=("watcher", "loop"), default=None,
                   help="who learns that a batch is done (InferenceService(complete_on=...); default: the service's)")
    p.add_argument("--lookahead-ms", type=float, default=None,
                   help="the runtime's launch-ahead, ms (InferenceService(lookahead_ms=...); default: the service's)")
    p.add_argument("--retune", action="store_true",
                   help="re-plan for each scale's offered rates before each leg (InferenceService.retune); default: "
                        "keep the plan made at load for the workload's own rates")
    p.add_argument("--inprocess-arrivals", choices=ARRIVALS, default="thread",
                   help="who submits the in-process leg's requests: a client thread (default) or the runtime's own "
                        "loop thread (run_point's arrivals; the thread fell behind on the H200 from x0.5)")
    p.add_argument("--inprocess-copies", action="store_true",
                   help="give the in-process leg plain arrays, copied at submit; default: inputs in page-locked "
                        "memory launched in place (device.pinned_empty), as the HTTP leg's page-locked worker arenas "
                        "are, so both legs skip the same copy")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="run the service's process (both legs) on these CPUs, a taskset -c list; the front-end "
                        "workers and the HTTP clients run on the others (default: no pinning)")
    p.add_argument("--loop-cpu", action="store_true",
                   help="charge the runtime loop thread's CPU to each callback and poller it runs, in both legs "
                        "(InferenceService.loop_cpu; about 1.5 us per timed call): where its time goes, per request")
    p.add_argument("--out", metavar="FILE", default=None, help="write the JSON report here")
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)  # internal: run as a client process
    args = p.parse_args(argv)
    try:
        counts = [http_workers_arg(x.strip()) for x in str(args.http_workers).split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(f"--http-workers: {e}")
    # the counts to compare, in order; http_workers stays one number when one is given
    args.http_workers_list = [default_http_workers(os.cpu_count()) if c == "auto" else c for c in counts]
    args.http_workers = args.http_workers_list[0] if len(args.http_workers_list) == 1 else args.http_workers_list
    from gpuloom.commands.serve import nice_arg
    from gpuloom.serve.frontend import WORKER_NICE

    try:
        args.worker_nice_list = [WORKER_NICE] if args.worker_nice is None else \
            [nice_arg(x.strip()) for x in str(args.worker_nice).split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(f"--worker-nice: {e}")
    from gpuloom.serve.loadgen import CLIENTS

    args.client_list = [x.strip() for x in str(args.client).split(",") if x.strip()]
    if not args.client_list or any(c not in CLIENTS for c in args.client_list):
        p.error(f"--client takes {' or '.join(CLIENTS)} (comma-separated for both), found {args.client!r}")
    args.ring_drain_on_list = _choices_list(p, "--ring-drain-on", args.ring_drain_on, DRAIN_ON)
    args.return_allowance_list = _choices_list(p, "--return-allowance", args.return_allowance, RETURN_ALLOWANCE)
    args.early_answer_list = _choices_list(p, "--early-answer", args.early_answer, EARLY_ANSWER)
    from gpuloom.commands.serve import intake_window_arg

    try:
        args.intake_window_list = [intake_window_arg(x.strip()) for x in str(args.intake_window_ms).split(",")
                                   if x.strip()] or [0.0]
    except argparse.ArgumentTypeError as e:
        p.error(f"--intake-window-ms: {e}")
    from gpuloom.runtime.gilswitch import check_interval_ms

    try:
        args.switch_interval_list = [None if x.strip() == "off" else check_interval_ms(float(x))
                                     for x in str(args.switch_interval_ms).split(",") if x.strip()] or [None]
    except ValueError as e:
        p.error(f"--switch-interval-ms takes off or numbers of ms in (0, 100], comma-separated: {e}")
    # the front ends each scale's HTTP legs compare, in order: every combination of the lists given
    args.front_ends = [FrontEnd(w, n, c, d, a, e, i, g) for w in args.http_workers_list
                       for n in args.worker_nice_list for c in args.client_list for d in args.ring_drain_on_list
                       for a in args.return_allowance_list for e in args.early_answer_list
                       for i in args.intake_window_list for g in args.switch_interval_list]
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.client_spec is None:
        if not args.workload:
            p.error("the workload file is required")
        if args.outputs == "views" and args.torch_launch:
            p.error("--outputs views needs raw CUDA launches: drop --torch-launch or use --outputs copies")
        if args.fake_device is not None:
            if not args.fake_device >= 1:
                p.error(f"--fake-device takes how many times slower than the H200 the fake runs (>= 1), "
                        f"found {args.fake_device}")
            if args.tiny or args.device or args.profiles or args.torch_launch or args.outputs == "views":
                p.error("--fake-device brings its own device, models and profiles: drop --tiny, --device, "
                        "--profiles, --torch-launch and --outputs views")
        try:
            args.scales = [float(x) for x in args.scale.split(",") if x.strip()]
        except ValueError:
            p.error(f"--scale expects comma-separated numbers, found {args.scale!r}")
        if not args.scales or not all(x > 0 and math.isfinite(x) for x in args.scales):
            p.error(f"--scale needs positive load factors, found {args.scale!r}")
        if not (args.duration > 0 and args.max_batch >= 1 and args.timeout > 0 and args.clients >= 0):
            p.error(f"--duration and --timeout must be positive, --max-batch >= 1 and --clients >= 0; found "
                    f"duration={args.duration}, timeout={args.timeout}, max_batch={args.max_batch}, "
                    f"clients={args.clients}")
        if args.lookahead_ms is not None and not args.lookahead_ms >= 0:
            p.error(f"--lookahead-ms must be >= 0 ms (0: off), found {args.lookahead_ms}")
    return args


EARLY_ANSWER = ("off", "on")  # --early-answer's values


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """One HTTP front end a scale's legs compare: how its server is set up and which clients drive it.
    One object, rather than six values in a row, for what each leg runs, what its point records (the
    fields are the point's keys) and what the comparison groups the rounds by."""

    http_workers: int
    worker_nice: int | None
    client: str
    ring_drain_on: str
    return_allowance: str
    early_answer: str
    intake_window_ms: float = 0.0
    switch_interval_ms: float | None = None  # None: Python's

    @classmethod
    def of_point(cls, point: dict) -> FrontEnd:
        """The front end a report's point was measured with. Points of older reports lack the later
        fields: runs before 85 had aiohttp clients; before the return allowance, rings drained on the
        loop and no allowance; before the early answer's legs, it was off; before the intake window and
        the switch interval's legs, no window and Python's interval."""
        return cls(point["http_workers"], point.get("worker_nice"), point.get("client", "aiohttp"),
                   point.get("ring_drain_on", "loop"), point.get("return_allowance", "off"),
                   point.get("early_answer", "off"), point.get("intake_window_ms", 0.0),
                   point.get("switch_interval_ms"))

    def fields(self) -> dict[str, Any]:
        """Its fields by their report keys (a point's, and make_point's keyword arguments)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """What the progress lines call it."""
        return (f"{self.http_workers} worker(s) at nice +{self.worker_nice}, rings drained on "
                f"{self.ring_drain_on}, return allowance {self.return_allowance}, early answer {self.early_answer}, "
                f"intake window {self.intake_window_ms:g} ms, GIL switch interval "
                f"{'Python' + chr(39) + 's' if self.switch_interval_ms is None else f'{self.switch_interval_ms:g} ms'}")


def _choices_list(p: argparse.ArgumentParser, flag: str, text: str, choices: tuple[str, ...]) -> list[str]:
    """A comma-separated list of ``choices`` (a usage error naming ``flag`` otherwise), in order."""
    values = [x.strip() for x in str(text).split(",") if x.strip()]
    if not values or any(v not in choices for v in values):
        p.error(f"{flag} takes {' or '.join(choices)} (comma-separated for several), found {text!r}")
    return values


def _one_or_list(values: list) -> Any:
    """A report's top-level field: the one value compared, or the list of them."""
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------------
# client process: drive some models open loop over HTTP, all starting at one monotonic instant
# ---------------------------------------------------------------------------------------------------
def client_main(spec_path: str) -> int:
    """Read the spec, say ``ready``, wait for ``go <monotonic start>`` on stdin, drive, write results.

    CLOCK_MONOTONIC is system-wide on Linux, so every client process starts its arrivals together."""
    import numpy as np

    from gpuloom.serve import loadgen

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("cpus"):  # not the server's CPUs (serve_e2e --cpus)
        from gpuloom.runtime.affinity import pin_process

        pin_process(set(spec["cpus"]))
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "go":
        print(f"client: expected 'go <start>' on stdin, found {line!r}", file=sys.stderr)
        return 2
    start_at = float(line[1])

    async def drive():
        delay = start_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        runs = [m for m in spec["models"] if m["times"]]
        res = await asyncio.gather(*(
            loadgen._run(spec["url"], m["model"], np.asarray(m["times"], dtype=float), batch=1, binary=True,
                         slo_ms=float(m["slo_ms"]), timeout_s=float(spec["timeout_s"]), seed=int(m["seed"]),
                         client=spec["client"])
            for m in runs))
        return res

    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    cpu0 = time.process_time()
    with asyncio.Runner(loop_factory=factory) as runner:
        results = runner.run(drive())
    # how busy this client process was while it sent: one near 1 CPU-s/s falls behind its schedule
    busy = (time.process_time() - cpu0) / max(1e-9, time.monotonic() - start_at)
    out = [dict(r.as_dict(), latencies_ms=list(r.latencies_ms), client_cpu_s_per_s=busy) for r in results]
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


def assign(rates: dict[str, float], k: int) -> list[list[str]]:
    """Models into ``k`` groups of about equal request rate (largest first onto the lightest group)."""
    groups: list[list[str]] = [[] for _ in range(max(1, k))]
    load = [0.0] * len(groups)
    for name in sorted(rates, key=lambda n: -rates[n]):
        i = min(range(len(groups)), key=lambda j: (load[j], len(groups[j])))
        groups[i].append(name)
        load[i] += rates[name]
    return [g for g in groups if g]


def drive_http(url: str, times: dict[str, list[float]], slos: dict[str, float], *, clients: int,
               timeout_s: float, workdir: Path, cpus: set[int] | None = None,
               client: str) -> tuple[dict[str, dict], int]:
    """Run the client processes; returns ``({model: loadgen result dict}, processes used)``."""
    rates = {m: float(len(ts)) for m, ts in times.items()}
    groups = assign(rates, clients)
    procs = []
    for i, names in enumerate(groups):
        spec = {"url": url, "timeout_s": timeout_s, "out": str(workdir / f"client{i}.out.json"), "client": client,
                "cpus": sorted(cpus) if cpus else None,
                "models": [{"model": m, "times": times[m], "slo_ms": slos[m], "seed": 1000 + j}
                           for j, m in enumerate(names)]}
        sp = workdir / f"client{i}.json"
        sp.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client-spec", str(sp)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env),
                      spec["out"], names))
    try:
        for p, _, _ in procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"client process did not start (said {line!r}, exit {p.poll()})")
        start_at = time.monotonic() + 0.3
        for p, _, _ in procs:
            p.stdin.write(f"go {start_at!r}\n")
            p.stdin.flush()
        budget = max(times_end(times) + timeout_s + 30.0, 60.0)
        for p, _, _ in procs:
            rc = p.wait(timeout=max(1.0, start_at + budget - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"client process exited with status {rc}")
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out: dict[str, dict] = {}
    for _, path, names in procs:
        for r in json.loads(Path(path).read_text()):
            out[r["model"]] = r
    for m in times:  # models with no arrivals at this scale
        out.setdefault(m, {"model": m, "sent": 0, "ok": 0, "errors": {}, "latencies_ms": [], "duration_s": 0.0})
    return out, len(procs)


def times_end(times: dict[str, list[float]]) -> float:
    return max((ts[-1] for ts in times.values() if ts), default=0.0)


# ---------------------------------------------------------------------------------------------------
# summaries: one shape for both legs
# ---------------------------------------------------------------------------------------------------
def _pct(sorted_ms: list[float], q: float) -> float | None:
    from gpuloom.bench.metrics import percentile

    return percentile(sorted_ms, q) if sorted_ms else None


def http_summary(res: dict[str, dict], slos: dict[str, float], duration_s: float) -> dict[str, Any]:
    """Per model and total: the loadgen results in run_point's terms (goodput = on-time / duration).

    HTTP status -> outcome: 200 served; 429 rejected (bounded queue); 503 dropped or not ready; 504
    deadline passed in the queue; 500 failed; anything else (client timeout, connection error) other."""
    models = {}
    all_ms: list[float] = []
    for m, r in res.items():
        lat = sorted(r["latencies_ms"])
        on_time = sum(1 for x in lat if x <= slos[m])
        err = {str(k): int(v) for k, v in r["errors"].items()}
        sent = int(r["sent"])
        all_ms.extend(lat)
        models[m] = {
            "submitted": sent, "served": int(r["ok"]), "on_time": on_time, "slo_ms": slos[m],
            "answered": int(r["ok"]) + sum(err.values()),
            "rejected": err.get("429", 0), "dropped": err.get("503", 0) + err.get("504", 0),
            "failed": err.get("500", 0),
            "other": sum(v for k, v in err.items() if k not in ("429", "503", "504", "500")),
            "errors": err, "offered_rps": sent / duration_s, "goodput_rps": on_time / duration_s,
            "slo_attainment": on_time / sent if sent else 1.0,
            "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "client_wall_s": r.get("duration_s"),
            "send_lag_p99_ms": r.get("send_lag_p99_ms"), "send_lag_max_ms": r.get("send_lag_max_ms"),
            "client_cpu_s_per_s": r.get("client_cpu_s_per_s"),  # of its client process (shared by its models)
            "server_timing_ms": r.get("server_timing_ms") or {},
        }
    all_ms.sort()
    sub = sum(v["submitted"] for v in models.values())
    ok = sum(v["on_time"] for v in models.values())
    return {"offered_rps": sub / duration_s, "goodput_rps": ok / duration_s,
            "slo_attainment": ok / sub if sub else 1.0, "p50_ms": _pct(all_ms, 50), "p99_ms": _pct(all_ms, 99),
            "submitted": sub, "served": sum(v["served"] for v in models.values()), "on_time": ok,
            "answered": sum(v["answered"] for v in models.values()),
            "send_lag_max_ms": max((v["send_lag_max_ms"] or 0.0 for v in models.values()), default=0.0),
            "client_cpu_max_s_per_s": max((v["client_cpu_s_per_s"] or 0.0 for v in models.values()), default=0.0),
            "models": models}


def inproc_summary(pt: Any) -> dict[str, Any]:
    """run_point's Point in the same shape as :func:`http_summary`."""
    def num(x):
        return x if isinstance(x, (int, float)) and math.isfinite(x) else None

    models = {}
    for mp in pt.models:
        answered = mp.served + sum(mp.errors.values())
        models[mp.model] = {
            "submitted": mp.submitted, "served": mp.served, "on_time": mp.on_time,
            "answered": answered + mp.rejected, "rejected": mp.rejected, "dropped": mp.dropped, "failed": mp.failed,
            "other": mp.submitted - mp.rejected - answered, "errors": dict(mp.errors),
            "offered_rps": mp.offered_rps, "goodput_rps": mp.goodput_rps, "slo_attainment": mp.slo_attainment,
            "p50_ms": num(mp.p50_ms), "p99_ms": num(mp.p99_ms),
            "queue_ms": mp.queue_ms, "compute_ms": mp.compute_ms,  # the service's split (mean, p99 bucket)
        }
    return {"offered_rps": pt.offered_rps, "goodput_rps": pt.goodput_rps, "slo_attainment": pt.slo_attainment,
            "p50_ms": num(pt.p50_ms), "p99_ms": num(pt.p99_ms),
            "submitted": sum(v["submitted"] for v in models.values()),
            "served": sum(v["served"] for v in models.values()),
            "on_time": sum(v["on_time"] for v in models.values()),
            "answered": sum(v["answered"] for v in models.values()),
            "sm_utilization": num(pt.sm_utilization), "dispatch_overhead": num(pt.dispatch_overhead),
            "layout_changes": pt.layout_changes, "layouts_built": pt.layouts_built, "gc": pt.gc,
            "loop_lag": pt.loop_lag, "models": models,
            # how late the in-process client submitted: on the H200 the client thread fell behind
            # (session 8), and a leg that offered less load than scheduled is no fair reference
            "arrivals": pt.arrivals, "offered_as_scheduled": pt.offered_as_scheduled,
            "batches": batch_split(pt.profile_check), "lanes": list(pt.layouts)}


def batch_split(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per model, from ``profile_check`` rows (one per model, SMs, batch size): batches run, their
    mean size, their mean device ms and how long each held its partition beyond that. Why: when the
    service's compute time differs between the legs at one offered load, this says whether the
    batches were bigger or the device slower per batch."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        a = acc.setdefault(r["model"], [0, 0, 0.0, 0.0, 0])
        n = r["batches"]
        a[0] += n
        a[1] += n * r["batch"]
        a[2] += n * r["measured_ms"]
        if "hold_ms" in r:  # a backend that does not keep holds: unknown, not 0
            a[3] += n * r["hold_ms"]
            a[4] += n
    return {m: {"batches": int(n), "mean_batch": items / n, "device_ms_per_batch": dev / n,
                "hold_ms_per_batch": hold / held if held else None}
            for m, (n, items, dev, hold, held) in acc.items() if n}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def books_delta(before: dict, after: dict) -> dict[str, dict]:
    """Server books (gpuloom.serve.metrics.Books snapshots) accumulated between two snapshots."""
    out = {}
    for m, b in after.items():
        a = before.get(m)
        d = {"accepted": b.accepted - (a.accepted if a else 0), "success": b.success - (a.success if a else 0),
             "failure": b.failure - (a.failure if a else 0), "in_flight": b.in_flight,
             "dropped": {k: v - (a.dropped.get(k, 0) if a else 0) for k, v in b.dropped.items()},
             "rejected": {k: v - (a.rejected.get(k, 0) if a else 0) for k, v in b.rejected.items()}}
        d["dropped"] = {k: v for k, v in d["dropped"].items() if v}
        d["rejected"] = {k: v for k, v in d["rejected"].items() if v}
        d["balanced"] = d["accepted"] == d["success"] + d["failure"] + sum(d["dropped"].values()) + d["in_flight"]
        out[m] = d
    return out


def http_warmup(url: str, configs: list[Any]) -> None:
    """One binary-data request per model over HTTP, as the clients will send them (server code paths,
    first connections); a failure here is reported, not fatal (the leg's books will show it)."""
    import urllib.error
    import urllib.request

    import numpy as np

    from gpuloom.serve.core import model_metadata
    from gpuloom.serve.loadgen import _body

    rng = np.random.default_rng(0)
    for c in configs:
        body, headers = _body(model_metadata(c), 1, True, rng)
        req = urllib.request.Request(f"http://{url}/v2/models/{c.name}/infer", data=body, headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        except (urllib.error.URLError, OSError) as e:
            print(f"warning: HTTP warm-up of {c.name} failed: {e}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------
def print_table(rep: dict, pt: dict) -> None:
    ip, ht = pt["inprocess"], pt["http"]

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    head = (f"{'model':<16}{'offered/s':>10}{'good in/s':>10}{'good http/s':>12}{'ratio':>7}"
            f"{'attain in':>10}{'attain http':>12}{'p50 in':>8}{'p50 http':>9}{'p99 in':>8}{'p99 http':>9}")
    kind = " (tiny models)" if rep["tiny"] else ""
    if rep.get("fake_slow"):
        kind = f" (x{rep['fake_slow']:g} slower than the H200's profiles)"
    print(f"serve_e2e {rep['workload']} x{pt['scale']:g} policy {rep['policy']} on {rep['device']}"
          f"{kind}, {rep['duration_s']:g} s per leg, {pt['clients']} client process(es), "
          f"{pt.get('http_workers', 0)} front-end worker(s)"
          + (f" (rings drained on {pt.get('ring_drain_on', 'loop')}, return allowance "
             f"{pt.get('return_allowance', 'off')}, early answer {pt.get('early_answer', 'off')}, intake window "
             f"{pt.get('intake_window_ms', 0.0):g} ms, switch interval {pt.get('switch_interval_ms') or 'off'})"
             if pt.get("http_workers") else "")
          + f", {pt.get('client', 'aiohttp')} clients"
          + (f", round {pt.get('round', 0) + 1} of {rep['rounds']}" if rep.get("rounds", 1) > 1 else ""))
    print(head)
    rows = [(m, ip["models"][m], ht["models"][m]) for m in ip["models"]] + [("TOTAL", ip, ht)]
    for name, a, b in rows:
        print(f"{name:<16}{f(a['offered_rps']):>10}{f(a['goodput_rps']):>10}{f(b['goodput_rps']):>12}"
              f"{f(_ratio(b['goodput_rps'], a['goodput_rps']), '.3f'):>7}{f(a['slo_attainment'], '.3f'):>10}"
              f"{f(b['slo_attainment'], '.3f'):>12}{f(a['p50_ms'], '.2f'):>8}{f(b['p50_ms'], '.2f'):>9}"
              f"{f(a['p99_ms'], '.2f'):>8}{f(b['p99_ms'], '.2f'):>9}")
    print("where an HTTP request's time went, p50 ms (client total; the server's Server-Timing: worker process,"
          " bridge to the runtime's process, service; the service's own queue and compute means, in / http):")
    for m, b in ht["models"].items():
        st = b.get("server_timing_ms") or {}
        a = ip["models"].get(m, {})
        mean = lambda h: (h or {}).get("mean")  # noqa: E731
        print(f"  {m:<16} client {f(b['p50_ms'], '.2f'):>6}" + "".join(
            f"  {k} {f(st[k]['p50'], '.2f'):>6}" for k in ("worker", "bridge", "service") if k in st)
            + f"  queue {f(mean(a.get('queue_ms')), '.2f')} / {f(mean(b.get('queue_ms')), '.2f')}"
            + f"  compute {f(mean(a.get('compute_ms')), '.2f')} / {f(mean(b.get('compute_ms')), '.2f')}")
    if ip.get("batches") or ht.get("batches"):
        print("the service's batches, in / http: mean size, device ms per batch, ms each held its partition beyond it:")
        for m in ht["models"]:
            a, b = (ip.get("batches") or {}).get(m, {}), (ht.get("batches") or {}).get(m, {})
            print(f"  {m:<16} size {f(a.get('mean_batch'), '.2f')} / {f(b.get('mean_batch'), '.2f')}"
                  f"  device {f(a.get('device_ms_per_batch'), '.2f')} / {f(b.get('device_ms_per_batch'), '.2f')}"
                  f"  held {f(a.get('hold_ms_per_batch'), '.2f')} / {f(b.get('hold_ms_per_batch'), '.2f')}")
    if any(q.get("turnarounds") for leg in (ip, ht) for q in leg.get("lanes") or ()):
        print("each lane's turnaround with work waiting, in / http: batches, p50 / p99 ms from its previous batch"
              " reaching the host to the next submit:")
        for a, b in zip(ip.get("lanes") or (), ht.get("lanes") or ()):  # (one label: both legs' layouts alike)
            lab = a["label"] if a["label"] == b["label"] else f"{a['label']} | {b['label']}"
            print(f"  {lab:<16} {a.get('turnarounds', 0)} / {b.get('turnarounds', 0)}"
                  f"  p50 {f(a.get('turnaround_p50_ms'), '.3f')} / {f(b.get('turnaround_p50_ms'), '.3f')}"
                  f"  p99 {f(a.get('turnaround_p99_ms'), '.3f')} / {f(b.get('turnaround_p99_ms'), '.3f')}")
    r = pt["ratio"]["goodput"]
    late = (ip.get("arrivals") or {}).get("late_ms") or {}
    print(f"HTTP clients' worst send lag behind schedule: {f(ht.get('send_lag_max_ms'), '.1f')} ms; in-process "
          f"client's p99 {f(late.get('p99'), '.1f')} ms"
          + ("" if ip.get("offered_as_scheduled", True) else " (it fell behind: the in-process leg offered less load)"))
    print(f"HTTP / in-process goodput: {f(r, '.3f')} (target >= {TARGET}: {'met' if pt['meets_target'] else 'NOT met'});"
          f" every request answered: {pt['books']['all_answered']}; server books balance: {pt['books']['server_balanced']}")


def run(args: argparse.Namespace) -> int:
    from gpuloom.gpu.connections import connections_in_effect, prefer_all_connections

    prefer_all_connections()  # as gpuloom serve does, before CUDA starts
    import torch

    from gpuloom.bench.e2e import build_models, resolve_device_and_profiles, run_point, save_json
    from gpuloom.bench.workload import WorkloadError, arrival_times, load_workload
    from gpuloom.runtime.gilswitch import ShortSwitchInterval
    from gpuloom.runtime.service import InferenceService
    from gpuloom.bench.machine import describe_machine, gpuloom_settings, summary
    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.server import Server

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    t_start = time.monotonic()
    try:
        workload = load_workload(args.workload)
    except (OSError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the one place a fake device and a real one part: the world (device, workload, profiles), how
    # its models are built, and the service that runs them
    if args.fake_device is not None:  # the workload's SLOs slowed with the fake device
        from gpuloom.bench.fake import fake_models, fake_service, fake_world

        device, warns = "fake", []
        workload, profiles = fake_world(workload, args.fake_device, args.max_batch)
        args.inprocess_copies = True  # (nothing page-locked on a fake device)

        def make_models() -> dict:
            return fake_models(workload, args.max_batch)

        def make_service(extra: dict) -> InferenceService:
            return fake_service(args.policy, profiles, queue_limit=args.queue_limit, **extra)
    else:
        try:
            device, profiles, warns = resolve_device_and_profiles(workload, device=args.device,
                                                                  profiles_dir=args.profiles, tiny=args.tiny)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

        def make_models() -> dict:
            return build_models(workload, tiny=args.tiny, device=device, max_batch=args.max_batch, progress=say)

        def make_service(extra: dict) -> InferenceService:
            return InferenceService(policy=args.policy, device=device, profiles=profiles,
                                    queue_limit=args.queue_limit, **extra)
    for w in warns:
        say(f"warning: {w}")
    other_cpus = None
    if args.cpus:
        from gpuloom.runtime.affinity import parse_cpus, pin_apart

        try:
            cpus = parse_cpus(args.cpus)
        except ValueError as e:
            print(f"error: --cpus: {e}", file=sys.stderr)
            return 2
        other_cpus = pin_apart(cpus)  # the workers' and the HTTP clients'
        say(f"the service's process on CPUs {sorted(cpus)}; workers and clients on {sorted(other_cpus)}")
    clients = args.clients or min(len(workload.models), max(1, (os.cpu_count() or 2) // 2))
    # which host, how fast, at the start and the end (as the bench): HTTP ratios from two machines
    # differ (run 71 against 43), and a host can slow within one call (run 70)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    machine = {"start": describe_machine(sync)}
    say(summary(machine["start"]))

    models = make_models()
    t_built = time.monotonic()
    slos = {m.name: float(m.slo_ms) for m in workload.models}
    extra = {} if args.lookahead_ms is None else {"lookahead_ms": args.lookahead_ms}
    if args.torch_launch:
        extra["raw_launch"] = False
    if args.complete_on:
        extra["complete_on"] = args.complete_on
    if args.outputs != "copies":
        extra["outputs"] = args.outputs
    svc = make_service(extra)
    server = None
    points: list[dict] = []
    error = ""

    def make_report(error: str) -> dict:
        """The JSON report of the points measured so far (written after each one and at the end)."""
        meta = {"torch": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv[1:],
                "build_s": round(t_built - t_start, 1), "seconds": round(time.monotonic() - t_start, 1),
                "cpus": os.cpu_count(), "service_cpus": args.cpus, "inprocess_arrivals": args.inprocess_arrivals,
                "inprocess_inputs": "copied" if args.inprocess_copies else "pinned", "worker_wakeups": args.worker_wakeups,
                "machine": dict(machine), "gpuloom_settings": gpuloom_settings(),
                **connections_in_effect().as_meta()}
        if device.startswith("cuda"):
            meta["gpu"] = torch.cuda.get_device_name(0)
        ok = bool(points) and not error and all(p["books"]["all_answered"] and p["books"]["server_balanced"]
                                                for p in points)
        report = _clean({
            "schema": SCHEMA, "workload": args.workload, "policy": args.policy, "scales": args.scales,
            "duration_s": args.duration, "device": device, "tiny": args.tiny, "fake_slow": args.fake_device,
            "max_batch": args.max_batch,
            "clients": clients, "http_workers": args.http_workers,
            "worker_nice": args.worker_nice_list[0] if len(args.worker_nice_list) == 1 else args.worker_nice_list,
            "lookahead_ms": svc.lookahead_ms,
            "raw_launch": bool(getattr(svc.device, "raw_launch", False)), "complete_on": svc.complete_on,
            "outputs": svc.outputs, "target": TARGET, "ok": ok, "error": error,
            "rounds": args.rounds, "comparison": comparison(points),
            "client": args.client_list[0] if len(args.client_list) == 1 else args.client_list,
            "ring_drain_on": _one_or_list(args.ring_drain_on_list),
            "return_allowance": _one_or_list(args.return_allowance_list),
            "early_answer": _one_or_list(args.early_answer_list),
            "intake_window_ms": _one_or_list(args.intake_window_list),
            "switch_interval_ms": _one_or_list(args.switch_interval_list),
            "summary": [{"scale": p["scale"], "http_workers": p["http_workers"], "worker_nice": p["worker_nice"],
                         "client": p["client"], "ring_drain_on": p["ring_drain_on"],
                         "return_allowance": p["return_allowance"], "early_answer": p["early_answer"],
                         "intake_window_ms": p.get("intake_window_ms", 0.0),
                         "switch_interval_ms": p.get("switch_interval_ms"),
                         "round": p["round"],
                         "offered_rps": p["offered_rps"],
                         "inprocess_goodput_rps": p["inprocess"]["goodput_rps"],
                         "http_goodput_rps": p["http"]["goodput_rps"], "ratio": p["ratio"]["goodput"],
                         "meets_target": p["meets_target"]} for p in points],
            "points": points, "meta": meta,
        })
        return report

    def save(report: dict) -> None:
        if args.out:
            save_json(args.out, report)

    try:
        svc.start()
        say(f"loading {len(models)} models into the service (policy {args.policy})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # crude profiles for tiny models
            svc.load_many(list(models.values()))
        import numpy as np

        for cfg, _ in models.values():  # warm the in-process path once, as gpuloom bench does
            svc.submit(cfg.name, {t.name: np.zeros((1, *t.shape), t.dtype) for t in cfg.inputs},
                       deadline_ms=60_000).result(60)
        for scale in args.scales:
            wl = dataclasses.replace(workload.scaled(scale), duration_s=args.duration)
            rates = {m.name: wl.mean_rate(m) for m in wl.models}
            times = arrival_times(wl)  # what run_point replays; the HTTP clients send the same times
            n = sum(len(t) for t in times.values())
            for rnd in range(args.rounds):
                if args.retune:
                    svc.retune(rates)
                say(f"x{scale:g} in-process: {n / args.duration:.0f} req/s for {args.duration:g} s"
                    + (f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else ""))
                cpu0 = svc.loop_cpu(True) if args.loop_cpu else None
                t_cpu = time.monotonic()
                inproc = inproc_summary(run_point(svc, workload, args.policy, scale=scale, duration_s=args.duration,
                                                  arrivals=args.inprocess_arrivals,
                                                  pinned_inputs=not args.inprocess_copies))
                if cpu0 is not None:
                    inproc["loop_cpu"] = loop_cpu_window(svc, cpu0, t_cpu, inproc.get("submitted"), say)
                legs = args.front_ends if rnd % 2 == 0 else args.front_ends[::-1]
                for front in legs:
                    # a server of its own per leg, on the same loaded service (left running at its stop)
                    core = ServeCore(svc, None)
                    server = Server(core, host="127.0.0.1", http_port=0, grpc_port=None,
                                    http_workers=front.http_workers, worker_ring_kb=args.worker_ring_kb,
                                    worker_cpus=other_cpus, ring_drain_on=front.ring_drain_on,
                                    worker_wakeups=args.worker_wakeups, close_service=False,
                                    worker_nice=front.worker_nice, return_allowance=front.return_allowance,
                                    intake_window_ms=front.intake_window_ms)
                    addr = server.start()
                    http_warmup(addr.http_url, svc.models())
                    wait_pinned(server, svc, front.http_workers, say)
                    say(f"HTTP server on http://{addr.http_url} with {front.describe()} (the gpuloom serve code, "
                        f"in this process); {front.client} clients")
                    early_before = svc.early_answer
                    svc.early_answer = front.early_answer == "on"  # this leg's; the in-process legs keep the service's
                    if front.switch_interval_ms is not None:  # likewise, the process-wide GIL switch interval
                        ShortSwitchInterval.enter(front.switch_interval_ms)
                    try:
                        http, server_books, used = http_leg(args, svc, core, server, addr.http_url, times, slos,
                                                            clients, other_cpus, scale, rates, say, front.client)
                    finally:
                        if front.switch_interval_ms is not None:
                            ShortSwitchInterval.leave(front.switch_interval_ms)
                        svc.early_answer = early_before
                        server.stop()
                        server = None
                    points.append(make_point(scale, args.duration, inproc, http, server_books, times, used,
                                             round_=rnd, **front.fields()))
                    say(f"x{scale:g}, {front.describe()}, {front.client} clients: goodput in-process "
                        f"{inproc['goodput_rps']:.1f}/s, "
                        f"HTTP {http['goodput_rps']:.1f}/s, ratio {points[-1]['ratio']['goodput']}")
                    say(f"  busiest client process {http['client_cpu_max_s_per_s']:.2f} CPU-s/s; workers "
                        f"{[round(x, 2) for x in http['worker_cpu_s_per_s']]} CPU-s/s")
                    save(make_report(IN_PROGRESS))  # a run killed at the next leg keeps this one
    except Exception as e:  # noqa: BLE001 - the points measured so far are still reported
        import traceback

        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    finally:
        if server is not None:
            server.stop()
        svc.close(drain=False, timeout_s=10)
    machine["end"] = describe_machine(sync)
    say(summary(machine["end"]) + " (at the end)")
    report = make_report(error)
    save(report)
    if args.out:
        say(f"wrote {args.out}")
    for p in report["points"]:
        print_table(report, p)
    if len(args.front_ends) > 1 or args.rounds > 1:
        print_comparison(report["points"])
    if error:
        print(f"FAILED: {error}")
    return 0 if report["ok"] else 1


def wait_pinned(server: Any, svc: Any, workers: int, say: Any, timeout_s: float = 60.0) -> None:
    """Where the device launches rows from page-locked memory (CUDA), wait until each front-end
    worker's arena is page-locked: the bridge locks it after the worker's handshake, and a request
    taken before then is staged by a copy, which a leg would measure."""
    bridge = getattr(server, "_bridge", None)
    if bridge is None or not workers or not getattr(getattr(svc, "device", None), "stages", False):
        return
    end = time.monotonic() + timeout_s
    while bridge.pinned_arenas < workers and time.monotonic() < end:
        time.sleep(0.05)
    if bridge.pinned_arenas < workers:
        say(f"  only {bridge.pinned_arenas} of {workers} workers' arenas page-locked after {timeout_s:g} s: "
            f"the others' requests are copied")


def http_leg(args: argparse.Namespace, svc: Any, core: Any, server: Any, url: str, times: dict[str, list[float]],
             slos: dict[str, float], clients: int, other_cpus: set[int] | None, scale: float,
             rates: dict[str, float], say: Any, client: str) -> tuple[dict, dict, int]:
    """One HTTP leg through ``server``: the clients replay ``times``; returns its summary (with the
    server process's own figures: workers' CPU, the service's queue/compute split, collector pauses,
    the loop thread's lag and CPU, the bridge's counts), the server's books for the leg, and the
    number of client processes used."""
    from gpuloom.bench.e2e import hist_delta, lane_deltas, profile_check, service_snapshot
    from gpuloom.runtime.gcpause import GcMonitor
    from gpuloom.runtime.threadcpu import cpu_share

    if args.retune:
        svc.retune(rates)
    _settle(core)
    books0 = core.books.snapshot()
    snap0 = service_snapshot(svc)
    t_leg = time.monotonic()
    say(f"x{scale:g} HTTP: {clients} client process(es)")
    cpu0 = svc.loop_cpu(True) if args.loop_cpu else None
    workers0 = worker_cpu(server)
    with tempfile.TemporaryDirectory(prefix="serve_e2e.") as tmp:
        res, used = drive_http(url, times, slos, clients=clients, timeout_s=args.timeout,
                               workdir=Path(tmp), cpus=other_cpus, client=client)
    _settle(core, 10.0)
    http = http_summary(res, slos, args.duration)
    # each worker's CPU-s per s, busiest first: one near 1.0 is the HTTP path's limit (a worker
    # started during the leg counts from zero, as cpu_share counts a new thread)
    shares = cpu_share(workers0, worker_cpu(server), time.monotonic() - t_leg)
    http["worker_cpu_s_per_s"] = sorted(shares.values(), reverse=True)
    snap1 = service_snapshot(svc)  # re-plans during the leg (each drains the partitions; a new layout is captured)
    http["layout_changes"] = snap1["layout_swaps"] - snap0["layout_swaps"]
    http["batches"] = batch_split(profile_check(svc, snap0, snap1))
    http["layouts_built"] = snap1["layouts_built"] - snap0["layouts_built"]
    http["lanes"] = lane_deltas(snap0["partitions"], snap1["partitions"])
    for m, v in http["models"].items():  # the service's split, as the in-process leg reports it
        v["queue_ms"] = hist_delta(snap0, snap1, m, "queue_ms")
        v["compute_ms"] = hist_delta(snap0, snap1, m, "compute_ms")
    http["gc"] = GcMonitor.installed().since(t_leg)  # collector pauses in this (the server's) process
    http["loop_lag"] = svc.loop_lag(t_leg)
    http["thread_cpu"] = cpu_share(snap0["threads"], snap1["threads"], snap1["t"] - snap0["t"])  # this process
    if cpu0 is not None:
        http["loop_cpu"] = loop_cpu_window(svc, cpu0, t_leg, http.get("submitted"), say)
    bridge = getattr(server, "_bridge", None)
    if bridge is not None:  # requests through a worker's arena, page-locked or not, or inline
        http["bridge"] = {"arena_requests": bridge.arena_requests, "inline_requests": bridge.inline_requests,
                          "ring_requests": bridge.ring_requests, "loop_requests": bridge.loop_requests,
                          "ring_replies": bridge.ring_replies, "pinned_arenas": bridge.pinned_arenas,
                          "loop_takes": getattr(bridge, "loop_takes", None),
                          "loop_deferred": getattr(bridge, "loop_deferred", None)}
    return http, books_delta(books0, core.books.snapshot()), used


def comparison(points: list[dict]) -> list[dict]:
    """Per scale and front end (FrontEnd.of_point: worker count, their nice, the client, who drains the
    rings, the return allowance, the early answer): the ratio of each round's leg, in round order, and
    their mean and spread (what a comparison of front ends reads: a difference inside the spread says
    nothing)."""
    rows: dict[tuple[float, FrontEnd], list[float | None]] = {}
    for p in points:
        rows.setdefault((p["scale"], FrontEnd.of_point(p)), []).append(p["ratio"]["goodput"])
    out = []
    for (scale, front), ratios in rows.items():
        known = [r for r in ratios if r is not None]
        out.append({"scale": scale, **front.fields(), "ratios": ratios,
                    "mean": sum(known) / len(known) if known else None,
                    "spread": max(known) - min(known) if known else None})
    return sorted(out, key=lambda r: (r["scale"], r["http_workers"], r["worker_nice"] or 0, r["client"],
                                      r["ring_drain_on"], r["return_allowance"], r["early_answer"],
                                      r["intake_window_ms"], r["switch_interval_ms"] or 0.0))


def print_comparison(points: list[dict]) -> None:
    print("HTTP / in-process goodput by worker count, their nice, the client, who drains the rings, the return "
          "allowance, the early answer, the intake window and the switch interval (one ratio per round, in order):")
    for r in comparison(points):
        ratios = " ".join("-" if x is None else f"{x:.3f}" for x in r["ratios"])
        mean = "-" if r["mean"] is None else f"{r['mean']:.3f}"
        spread = "-" if r["spread"] is None else f"{r['spread']:.3f}"
        print(f"  x{r['scale']:g}  {r['http_workers']:>2} worker(s) at nice +{r['worker_nice']}, {r['client']:>7}, "
              f"drain {r['ring_drain_on']:>6}, allowance {r['return_allowance']:>4}, "
              f"early {r['early_answer']:>3}, window {r['intake_window_ms']:g} ms, "
              f"switch {r['switch_interval_ms'] or 'off'}: {ratios}   "
              f"mean {mean}, spread {spread}")


def worker_cpu(server: Any) -> dict[int, float]:
    """CPU seconds used so far by each HTTP front-end worker process, by pid (``/proc``; Linux)."""
    from gpuloom.runtime.threadcpu import stat_cpu_s

    out = {}
    for pid in server.worker_pids():
        secs = stat_cpu_s(f"/proc/{pid}/stat")
        if secs is not None:
            out[pid] = secs
    return out


def loop_cpu_window(svc: Any, before: dict, t0: float, requests: int | None, say: Any) -> dict:
    """The runtime loop thread's CPU by callback since ``before`` (read at monotonic ``t0``), with its
    CPU per request of the leg; the largest five are printed."""
    from gpuloom.runtime.events import cpu_delta

    wall = time.monotonic() - t0
    d = cpu_delta(before, svc.loop_cpu(), wall)
    if requests:
        d["requests"] = requests
        if d["thread_cpu_s_per_s"] is not None:
            d["thread_us_per_request"] = d["thread_cpu_s_per_s"] * wall / requests * 1e6
        for r in d["callbacks"]:
            r["us_per_request"] = r["cpu_s_per_s"] * wall / requests * 1e6
    top = ", ".join(f"{r['callback']} {r['cpu_s_per_s']:.3f} ({r['us_per_call']:.0f} us/call, "
                    f"{r['off_cpu_us_per_call']:.0f} off CPU)" for r in d["callbacks"][:5])
    thread = d["thread_cpu_s_per_s"]
    say(f"  loop thread {thread if thread is None else round(thread, 3)} CPU-s/s; by callback: {top}")
    return d


def _settle(core: Any, timeout_s: float = 30.0) -> None:
    """Wait until the server has answered everything it accepted (or ``timeout_s`` passed)."""
    end = time.monotonic() + timeout_s
    while core.books.in_flight() and time.monotonic() < end:
        time.sleep(0.01)


def make_point(scale: float, duration_s: float, inproc: dict, http: dict, server_books: dict,
               times: dict[str, list[float]], clients: int, http_workers: int = 0, round_: int = 0,
               worker_nice: int | None = None, client: str | None = None, ring_drain_on: str = "loop",
               return_allowance: str = "off", early_answer: str = "off", intake_window_ms: float = 0.0,
               switch_interval_ms: float | None = None) -> dict:
    """One load factor: both legs, their ratio, and the books of the HTTP leg.

    Books: every request the clients sent got an answer (200 or an error status; none lost), and the
    server's own books balance (accepted == success + failure + dropped, nothing in flight) and agree
    with the clients (its successes are the clients' 200s)."""
    for m, v in http["models"].items():
        v["server"] = server_books.get(m)
    all_answered = all(v["answered"] == v["submitted"] == len(times[m]) for m, v in http["models"].items())
    balanced = all(b["balanced"] and b["in_flight"] == 0 for b in server_books.values())
    match = all((server_books.get(m) or {}).get("success", 0) == v["served"] for m, v in http["models"].items())
    ratio = _ratio(http["goodput_rps"], inproc["goodput_rps"])
    return {
        "scale": scale, "offered_rps": sum(len(t) for t in times.values()) / duration_s,
        "clients": clients, "http_workers": http_workers, "worker_nice": worker_nice, "client": client, "round": round_,
        "ring_drain_on": ring_drain_on, "return_allowance": return_allowance, "early_answer": early_answer,
        "intake_window_ms": intake_window_ms, "switch_interval_ms": switch_interval_ms, "inprocess": inproc, "http": http,
        "ratio": {"goodput": ratio,
                  "slo_attainment": _ratio(http["slo_attainment"], inproc["slo_attainment"]),
                  "models": {m: _ratio(http["models"][m]["goodput_rps"], inproc["models"][m]["goodput_rps"])
                             for m in inproc["models"]}},
        "meets_target": ratio is not None and ratio >= TARGET,
        "books": {"all_answered": all_answered, "server_balanced": balanced, "server_matches_client": match},
    }


def _clean(v: Any) -> Any:
    """JSON without NaN/inf (null instead)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_spec is not None:
        return client_main(args.client_spec)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
