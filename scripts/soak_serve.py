#!/usr/bin/env python
"""Does `gpuloom serve` stay up? A soak: minutes of mixed traffic against the real server, with the
server's memory, descriptors and threads sampled as it runs.

Why: users judge a server by whether it stays up. The tests check each behaviour once (a bad input,
a cut connection, an unload while serving); a leak shows only when they repeat for minutes: a
descriptor per cut connection, a thread per unload, an arena never unmapped. This starts `gpuloom
serve` on a CPU repository (the example's two small models by default) and, for ``--duration``
seconds, runs at once:

- ``http``: inference through unmodified ``tritonclient.http`` (binary tensor data), both models;
  every third request with a timeout of its own (Triton's ``timeout`` parameter: 50 ms, 200 ms or
  2 s), so that deadlines along a model's queue are mixed;
- ``grpc``: inference through ``tritonclient.grpc``;
- ``bad``: a wrong shape, a wrong datatype, malformed JSON, an unknown model (each must get a 4xx);
- ``cut``: connections cut mid-body, and requests whose client leaves before the answer;
- ``cycle``: every ``--cycle-s`` seconds the second model is unloaded and loaded again, while
  ``http`` keeps sending to it (it must answer "not ready"-style 4xx/503 meanwhile, never 500).

Every answer to an inference is checked against the first answer to the same input (the inputs are
eight fixed ones): rows batched with other clients' rows must not change what a client gets. The
server's process and its children (front-end workers) are sampled every ``--sample-s``: resident
memory, open descriptors, threads. At the end the server's books must balance (``/metrics``:
accepted == success + failure, nothing pending), and SIGTERM must stop it with exit code 0. The soak
is ``ok`` when all of that holds and neither descriptors nor threads end above their highest of
the first half. The server runs in a session of its own, killed whole at the end (workers too).

    .venv/bin/python scripts/soak_serve.py --duration 300 --out /tmp/soak.json
    .venv/bin/python scripts/soak_serve.py --duration 300 --serve-args="--http-workers 2"
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "examples" / "repository"
MODELS = ("tiny_mlp", "tiny_cnn")  # the second one is unloaded and loaded again (``cycle``)
INPUTS = {"tiny_mlp": ("x", (16,)), "tiny_cnn": ("image", (3, 16, 16))}
PROBES = 8  # fixed inputs per model; each answer is compared with the first answer to its input


def start_server(repository: Path, models: tuple[str, ...], extra: list[str], timeout_s: float = 180.0):
    """``gpuloom serve`` in a child on free loopback ports, in a session of its own (so that
    :func:`kill_server` reaches its front-end workers too); returns (process, HTTP port, gRPC port,
    its log lines so far)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "gpuloom", "serve", str(repository), "--models", ",".join(models),
           "--http-port", "0", "--grpc-port", "0", "--device", "cpu", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=_drain_stderr, args=(proc, lines), daemon=True).start()
    pattern = re.compile(r"HTTP on http://127\.0\.0\.1:(\d+).*gRPC on 127\.0\.0\.1:(\d+)")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            for line in list(lines):
                if m := pattern.search(line):
                    return proc, int(m.group(1)), int(m.group(2)), lines
            time.sleep(0.1)
    except BaseException:  # Ctrl-C while it starts: no server left behind
        kill_server(proc)
        raise
    kill_server(proc)
    why = "exited" if proc.poll() is not None else f"did not listen within {timeout_s:.0f} s"
    raise SystemExit(f"gpuloom serve {why}:\n" + "".join(lines[-40:]))


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the server's session (it, or workers that outlived it), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole session has exited
        pass
    proc.wait()


def _drain_stderr(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stderr:  # the server's log must not fill its pipe and block it
        lines.append(line)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the front-end workers), from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def sample(pid: int) -> dict:
    """Resident memory (MiB; of it, shared memory such as the front-end workers' arenas, whose pages
    count once touched), open descriptors and threads, summed over the server's process tree."""
    rss_kb = shmem_kb = fds = threads = n = 0
    each: dict[str, float] = {}  # pid -> resident MiB, to tell which process grows
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:  # gone meanwhile
            continue
        rss, shmem = re.search(r"VmRSS:\s+(\d+)", status), re.search(r"RssShmem:\s+(\d+)", status)
        if rss is None:  # a zombie (an exited worker not yet reaped): no memory left to count
            continue
        kb = int(rss.group(1))
        rss_kb += kb
        shmem_kb += int(shmem.group(1)) if shmem else 0  # shared arenas' pages touched
        each[str(p)] = round(kb / 1024, 1)
        threads += int(re.search(r"Threads:\s+(\d+)", status).group(1))
        n += 1
    return {"rss_mib": rss_kb / 1024, "rss_shmem_mib": shmem_kb / 1024, "fds": fds, "threads": threads, "processes": n, "rss_mib_by_pid": each}


class Soak:
    """The traffic threads, their outcome counts, and what went wrong (``unexpected``)."""

    def __init__(self, http_port: int, grpc_port: int, duration_s: float, rate: float, cycle_s: float) -> None:
        self.http_url, self.grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        self.port, self.duration_s, self.rate, self.cycle_s = http_port, duration_s, rate, cycle_s
        self.outcomes: dict[str, Counter] = {k: Counter() for k in ("http", "grpc", "bad", "cut", "cycle")}
        self.unexpected: list[str] = []  # the first few, verbatim
        self.unexpected_n = 0
        self.reference: dict[tuple[str, int], list[np.ndarray]] = {}
        self.mismatches = 0
        self.cycles = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        rng = np.random.default_rng(0)
        self.probes = {m: [rng.standard_normal((1, *shape)).astype(np.float32) for _ in range(PROBES)]
                       for m, (_, shape) in INPUTS.items()}

    def run(self) -> None:
        threads = [threading.Thread(target=self._guard, args=(f,), name=f.__name__, daemon=True)
                   for f in (self._http, self._grpc, self._bad, self._cut, self._cycle)]
        for t in threads:
            t.start()
        self._stop.wait(self.duration_s)
        self._stop.set()
        for t in threads:
            t.join(60)

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a traffic thread that dies is a finding, not a crash of the soak
            self._bad_news(f"{fn.__name__} thread died: {type(e).__name__}: {e}")

    def _paced(self, rate: float):
        """Yield at ``rate`` per second (later when the server is slower) until the soak ends."""
        i, t0 = 0, time.monotonic()
        while not self._stop.is_set():
            yield i
            i += 1
            delay = t0 + i / rate - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return

    def _count(self, kind: str, outcome: str, expected: bool, detail: str = "") -> None:
        with self._lock:
            self.outcomes[kind][outcome] += 1
        if not expected:
            self._bad_news(f"{kind}: {outcome} {detail}".strip())

    def _bad_news(self, text: str) -> None:
        with self._lock:
            self.unexpected_n += 1
            if len(self.unexpected) < 20:
                self.unexpected.append(text[:300])

    def _check(self, model: str, probe: int, outs: list[np.ndarray]) -> bool:
        key = (model, probe)
        with self._lock:
            ref = self.reference.setdefault(key, outs)
        same = len(ref) == len(outs) and all(a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6)
                                             for a, b in zip(ref, outs))
        if not same:
            with self._lock:
                self.mismatches += 1
        return same

    def _http(self) -> None:
        import tritonclient.http as th
        from tritonclient.utils import InferenceServerException

        client = th.InferenceServerClient(self.http_url, connection_timeout=30, network_timeout=30)
        for i in self._paced(self.rate):
            model = MODELS[i % 2]
            name, _ = INPUTS[model]
            x = self.probes[model][i % PROBES]
            inp = th.InferInput(name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            timeout_us = (50_000, 200_000, 2_000_000)[(i // 3) % 3] if i % 3 == 0 else None
            try:
                res = client.infer(model, [inp], timeout=timeout_us)
            except InferenceServerException as e:
                status = str(e.status() or "error")
                # while ``cycle`` has the model unloaded: not found / not ready; under load 429/503
                # (refused) and 504 (its deadline passed: an answer, booked as a drop)
                expected = status in ("429", "503", "504") or (model == MODELS[1] and status in ("400", "404"))
                self._count("http", status, expected, str(e))
                continue
            names = [o["name"] for o in res.get_response()["outputs"]]
            ok = self._check(model, i % PROBES, [res.as_numpy(n) for n in names])
            self._count("http", "200" if ok else "200 but a different answer", ok, model)

    def _grpc(self) -> None:
        import tritonclient.grpc as tg
        from tritonclient.utils import InferenceServerException

        client = tg.InferenceServerClient(self.grpc_url)
        model, (name, _) = MODELS[0], INPUTS[MODELS[0]]
        for i in self._paced(self.rate / 2):
            x = self.probes[model][i % PROBES]
            inp = tg.InferInput(name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                res = client.infer(model, [inp], client_timeout=30)
            except InferenceServerException as e:
                status = str(e.status() or "error")
                self._count("grpc", status, status in ("StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED",
                                                       "StatusCode.DEADLINE_EXCEEDED"), str(e))
                continue
            names = [o.name for o in res.get_response().outputs]
            ok = self._check(model, i % PROBES, [res.as_numpy(n) for n in names])
            self._count("grpc", "OK" if ok else "OK but a different answer", ok)

    def _post(self, path: str, body: bytes) -> int:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            return r.status
        finally:
            c.close()

    def _bad(self) -> None:
        def tensor(shape, datatype="FP32"):
            return {"name": "x", "shape": shape, "datatype": datatype, "data": [0.5] * int(np.prod(shape))}

        cases = [
            ("wrong shape", "/v2/models/tiny_mlp/infer", json.dumps({"inputs": [tensor([1, 15])]}).encode()),
            ("wrong datatype", "/v2/models/tiny_mlp/infer", json.dumps({"inputs": [tensor([1, 16], "INT8")]}).encode()),
            ("malformed JSON", "/v2/models/tiny_mlp/infer", b'{"inputs": [{"name": "x", '),
            ("unknown model", "/v2/models/no_such_model/infer", json.dumps({"inputs": [tensor([1, 16])]}).encode()),
        ]
        for i in self._paced(self.rate / 4):
            what, path, body = cases[i % len(cases)]
            try:
                status = self._post(path, body)
            except OSError as e:
                self._count("bad", type(e).__name__, False, what)
                continue
            self._count("bad", str(status), 400 <= status < 500 and status != 429, what)

    def _cut(self) -> None:
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}).encode()
        for i in self._paced(self.rate / 8):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            try:
                head = (f"POST /v2/models/tiny_mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode()
                if i % 2 == 0:  # cut in the middle of the body
                    s.sendall(head + body[: len(body) // 2])
                    outcome = "cut mid-body"
                else:  # the whole request, then gone before the answer
                    s.sendall(head + body)
                    outcome = "left before the answer"
            except OSError as e:
                self._count("cut", type(e).__name__, False)
                continue
            finally:
                s.close()
            self._count("cut", outcome, True)

    def _cycle(self) -> None:
        import tritonclient.http as th
        from tritonclient.utils import InferenceServerException

        client = th.InferenceServerClient(self.http_url, connection_timeout=120, network_timeout=120)
        while not self._stop.wait(self.cycle_s):
            try:
                client.unload_model(MODELS[1])
                time.sleep(1.0)  # ``http`` keeps sending to it meanwhile
                client.load_model(MODELS[1])
                ready = client.is_model_ready(MODELS[1])
            except InferenceServerException as e:
                self._count("cycle", str(e.status() or "error"), False, str(e))
                continue
            self.cycles += 1
            self._count("cycle", "reloaded" if ready else "not ready after load", ready)


def scrape(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return text


def books(text: str) -> dict:
    """Per model, from ``/metrics``: accepted, success, failure (every reason), pending."""
    out: dict[str, dict[str, float]] = {}
    for name, key in (("gpuloom_request_accepted", "accepted"), ("nv_inference_request_success", "success"),
                      ("nv_inference_request_failure", "failure"), ("nv_inference_pending_request_count", "pending")):
        for m in re.finditer(rf'^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$', text, re.M):
            model = re.search(r'model="([^"]+)"', m.group(1)).group(1)
            out.setdefault(model, Counter())[key] += float(m.group(2))
    return {m: dict(v) for m, v in out.items()}


def gc_between(start: dict | None, end: dict) -> dict | None:
    """The collections and pauses between two :func:`gc_pauses` readings: per generation, pause ms, and
    the longest pause where it is longer than every one before ``start`` (None otherwise: the metrics
    keep only the longest so far). None without both readings."""
    if not start or not end.get("collections") or start.get("pause_ms") is None or end.get("pause_ms") is None:
        return None
    runs = {g: end["collections"].get(g, 0.0) - start["collections"].get(g, 0.0) for g in end["collections"]}
    grew = end["max_pause_ms"] is not None and start["max_pause_ms"] is not None and end["max_pause_ms"] > start["max_pause_ms"]
    return {"collections": runs, "pause_ms": end["pause_ms"] - start["pause_ms"],
            "max_pause_ms": end["max_pause_ms"] if grew else None, "max_pause_ms_at_start": start["max_pause_ms"]}


def gc_pauses(text: str) -> dict:
    """The runtime process's garbage collections by generation, and their pauses (ms), from ``/metrics``."""
    runs = {m.group(1): float(m.group(2))
            for m in re.finditer(r'^gpuloom_gc_collections\{generation="(\d)"\} ([0-9.e+-]+)$', text, re.M)}
    one = {name: float(m.group(1)) for name in ("gpuloom_gc_pause_ms", "gpuloom_gc_pause_max_ms")
           if (m := re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M))}
    return {"collections": runs, "pause_ms": one.get("gpuloom_gc_pause_ms"), "max_pause_ms": one.get("gpuloom_gc_pause_max_ms")}


def sample_at(samples: list[dict], fraction: float) -> dict:
    """The first sample taken at or after ``fraction`` of the sampled time."""
    return next(s for s in samples if s["t"] >= samples[-1]["t"] * fraction)


def trend(samples: list[dict], key: str) -> dict:
    """The second half's least-squares slope per minute, and where the value stood at 20% and at the end."""
    if not samples:  # the sampler never read the server: nothing to judge (``ok`` is then false)
        nan = float("nan")
        return {"at_20pct": nan, "end": nan, "max": nan, "second_half_slope_per_min": nan}
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
    t = np.array([s["t"] for s in half]) / 60.0
    v = np.array([s[key] for s in half], dtype=float)
    slope = float(np.polyfit(t, v, 1)[0]) if len(half) >= 3 and np.ptp(t) > 0 else float("nan")
    at20 = sample_at(samples, 0.2)[key]
    return {"at_20pct": at20, "end": samples[-1][key], "max": max(s[key] for s in samples),
            "second_half_slope_per_min": slope}


def growing(samples: list[dict], key: str) -> bool:
    """Did ``key`` end above everything it reached in the first half (a leak, not the ups and downs of
    connections and threads coming and going)? True when there is nothing to judge."""
    first = [s[key] for s in samples if s["t"] <= samples[-1]["t"] / 2] if samples else []
    return not first or samples[-1][key] > max(first)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    p.add_argument("--rate", type=float, default=60.0, help="HTTP inferences per second (default 60; gRPC half "
                   "that, bad requests a quarter, cut connections an eighth)")
    p.add_argument("--cycle-s", type=float, default=20.0, help="seconds between unload/load cycles (default 20)")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between resource samples (default 2)")
    p.add_argument("--serve-args", default="", help="more arguments for gpuloom serve, e.g. '--http-workers 2'")
    p.add_argument("--repository", type=Path, default=REPOSITORY,
                   help=f"model repository with the models {', '.join(MODELS)} as in examples/repository (the default)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)

    try:
        import tritonclient.grpc  # noqa: F401
        import tritonclient.http  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"soak_serve.py drives the server with tritonclient ({e}): pip install "
                         "'tritonclient[http,grpc]' (or the project's test extra: pip install -e '.[test]')") from None
    t_start = time.monotonic()
    proc, http_port, grpc_port, log_lines = start_server(args.repository, MODELS, shlex.split(args.serve_args))
    print(f"soak: server pid {proc.pid}, HTTP {http_port}, gRPC {grpc_port}, started in "
          f"{time.monotonic() - t_start:.1f} s; {args.duration:.0f} s of traffic", file=sys.stderr, flush=True)
    soak = Soak(http_port, grpc_port, args.duration, args.rate, args.cycle_s)
    try:  # the collector's record before the traffic: start-up's collections (loading) are not the traffic's
        gc_start = gc_pauses(scrape(http_port))
    except OSError:
        gc_start = None
    samples: list[dict] = []
    t0 = time.monotonic()
    sampler_stop = threading.Event()

    def sampler() -> None:
        while True:
            try:
                samples.append({"t": time.monotonic() - t0, **sample(proc.pid)})
            except Exception as e:  # noqa: BLE001 - a sampler that dies would make a cut-short trend look flat
                soak._bad_news(f"sampling the server failed: {type(e).__name__}: {e}")
            if sampler_stop.wait(args.sample_s):
                return

    st = threading.Thread(target=sampler, daemon=True)
    final_books: dict = {}
    gc_end: dict = {"collections": {}, "pause_ms": None, "max_pause_ms": None}  # unless /metrics is read
    exit_code, stop_s = None, float("nan")
    try:
        st.start()
        soak.run()
        time.sleep(2.0)  # what is in flight finishes
        sampler_stop.set()
        st.join()
        server_alive = proc.poll() is None
        if server_alive:
            try:
                text = scrape(http_port)
                final_books, gc_end = books(text), gc_pauses(text)
            except OSError as e:
                soak._bad_news(f"/metrics at the end: {type(e).__name__}: {e}")
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                exit_code = None
            stop_s = time.monotonic() - t_term
        else:
            exit_code = proc.returncode
            soak._bad_news(f"the server exited during the soak with code {exit_code}")
    finally:
        sampler_stop.set()
        kill_server(proc)  # its workers too, whatever happened above

    balanced = bool(final_books) and all(
        b.get("accepted", 0) == b.get("success", 0) + b.get("failure", 0) and b.get("pending", 0) == 0
        for b in final_books.values())
    report = {
        "duration_s": args.duration, "rate": args.rate, "cycle_s": args.cycle_s, "serve_args": args.serve_args,
        "outcomes": {k: dict(v) for k, v in soak.outcomes.items()},
        "unexpected_n": soak.unexpected_n, "unexpected": soak.unexpected, "answer_mismatches": soak.mismatches,
        "cycles": soak.cycles, "books": final_books, "books_balanced": balanced, "gc": gc_end,
        "gc_during_traffic": gc_between(gc_start, gc_end),
        "server_alive_at_end": server_alive, "sigterm_exit_code": exit_code, "sigterm_stop_s": round(stop_s, 2),
        "resources": {k: trend(samples, k) for k in ("rss_mib", "rss_shmem_mib", "fds", "threads", "processes")},
        "samples": samples, "server_log_tail": log_lines[-20:],
    }
    report["ok"] = (server_alive and exit_code == 0 and balanced and soak.unexpected_n == 0
                    and soak.mismatches == 0 and not growing(samples, "fds") and not growing(samples, "threads"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    r = report["resources"]
    print(f"soak {'ok' if report['ok'] else 'FAILED'}: " + "; ".join(
        f"{k} {sum(v.values())} ({', '.join(f'{o} {n}' for o, n in v.most_common())})" for k, v in soak.outcomes.items()),
        file=sys.stderr)
    print(f"  unexpected {soak.unexpected_n}, answer mismatches {soak.mismatches}, unload/load cycles {soak.cycles}, "
          f"books balanced {balanced}, SIGTERM exit {exit_code} in {stop_s:.1f} s", file=sys.stderr)
    print(f"  garbage collections by generation {gc_end['collections']}, paused {gc_end['pause_ms']} ms in all, "
          f"longest {gc_end['max_pause_ms']} ms", file=sys.stderr)
    during = report["gc_during_traffic"]
    if during:
        longest = (f"longest {during['max_pause_ms']:.1f} ms" if during["max_pause_ms"] is not None
                   else f"none longer than start-up's {during['max_pause_ms_at_start']:.1f} ms")
        print(f"  of them during the traffic: {during['collections']}, paused {during['pause_ms']:.1f} ms, {longest}",
              file=sys.stderr)
    for k in ("rss_mib", "rss_shmem_mib", "fds", "threads"):
        print(f"  {k}: {r[k]['at_20pct']:.1f} at 20% -> {r[k]['end']:.1f} at the end (max {r[k]['max']:.1f}; "
              f"second half {r[k]['second_half_slope_per_min']:+.2f}/min)", file=sys.stderr)
    at20 = sample_at(samples, 0.2)["rss_mib_by_pid"] if samples else {}
    for pid_, mib in (samples[-1]["rss_mib_by_pid"] if samples else {}).items():
        role = "server" if pid_ == str(proc.pid) else "worker"
        print(f"  {role} {pid_}: {at20.get(pid_, float('nan')):.1f} MiB at 20% -> {mib:.1f} at the end", file=sys.stderr)
    for u in soak.unexpected[:10]:
        print(f"  unexpected: {u}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
