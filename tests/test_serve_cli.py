"""``gpuloom serve`` as a process: port-taken message, SIGTERM drains and answers every request."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent

# Runs `gpuloom serve` in a child; until the runtime's InferenceService lands, the fake stands in for it.
LAUNCH = (
    "import sys; sys.path.insert(0, {tests!r}); import serve_fake\n"
    "if not serve_fake.real_service_available(): serve_fake.svc.InferenceService = serve_fake.FakeService\n"
    "import argparse; from gpuloom.commands import serve\n"
    "p = argparse.ArgumentParser(); serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))\n"
).format(tests=str(TESTS))

SLOW = '''
import time, torch

# a custom operator, so that the sleep survives compilation (in forward it would run only while tracing)
@torch.library.custom_op("gpuloom_cli_tests::sleep_plus_one", mutates_args=(), schema="(Tensor x) -> Tensor")
def sleep_plus_one(x):
    time.sleep(0.1)
    return x + 1

@sleep_plus_one.register_fake
def _(x):
    return torch.empty_like(x)

class Slow(torch.nn.Module):
    def forward(self, x):
        return sleep_plus_one(x)

def slow():
    return Slow()
'''


def _spawn(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_port(proc, timeout=60):
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"HTTP on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return int(m.group(1)), lines
    raise AssertionError("server did not start:\n" + "".join(lines))


def _taken(port, model) -> float:
    """Requests of ``model`` the server has taken so far, accepted or refused (from its /metrics)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    n = 0.0
    for line in text.splitlines():
        m = re.match(r"^gpuloom_request_(?:accepted|rejected)\{([^}]*)\} (\S+)$", line)
        if m and f'model="{model}"' in m.group(1):
            n += float(m.group(2))
    return n


@pytest.mark.parametrize("extra", [[], ["--runtime-on", "http", "--device", "cpu"]], ids=["default", "runtime-on-http"])
def test_sigterm_drains_and_answers_every_accepted_request(tmp_path, extra):
    (tmp_path / "slow.py").write_text(SLOW)
    (tmp_path / "slow.yaml").write_text("name: slow\nsource: slow.py:slow\ninputs: [{name: x, shape: [2]}]\nmax_batch: 4\nslo_ms: 5000\n")
    proc = _spawn(str(tmp_path), "--http-port", "0", "--grpc-port", "0", *extra)
    try:
        port, lines = _wait_port(proc)
        # by default (--runtime-on auto) a model whose batches take 100 ms keeps the loop off HTTP's
        assert ("the runtime's loop on HTTP's event loop" in lines[-1]) == bool(extra), lines[-1]
        results = []
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]})

        def send():
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("POST", "/v2/models/slow/infer", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                results.append((r.status, json.loads(r.read())))
            except OSError as e:
                results.append((type(e).__name__, None))

        threads = [threading.Thread(target=send) for _ in range(10)]
        for t in threads:
            t.start()
        # the stop comes once every request is in the server (polled: a fixed 0.15 s sleep could come
        # before any was on a loaded host, and then none is left to drain)
        end = time.monotonic() + 30
        while _taken(port, "slow") < len(threads):
            assert time.monotonic() < end, f"{_taken(port, 'slow')} of {len(threads)} requests in the server in 30 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    ok = [r for s, r in results if s == 200]
    assert len(ok) >= 1 and all(r["outputs"][0]["data"] == [2.0, 3.0] for r in ok)
    # drained: served, or told to retry (503 stopping; 429 the policy's admission, now that the model is
    # really slow), never cut off
    assert all(s in (200, 429, 503) for s, _ in results), results
    assert "stopped (drained)" in proc.stderr.read()


def test_by_default_a_small_cpu_model_is_served_from_the_http_event_loop():
    """``--runtime-on auto`` (the default): on the CPU, a model whose largest batch takes under
    AUTO_HOST_MAX_BATCH_MS has its runtime's loop on HTTP's event loop, and serves from there."""
    proc = _spawn(str(ROOT / "examples" / "repository" / "tiny_mlp.yaml"), "--http-port", "0", "--no-grpc",
                  "--device", "cpu")
    try:
        port, lines = _wait_port(proc)
        assert "the runtime's loop on HTTP's event loop" in lines[-1], lines[-1]
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/v2/models/tiny_mlp")
        meta = json.loads(c.getresponse().read())
        spec = meta["inputs"][0]
        shape = [1, *[d for d in spec["shape"] if d != -1]]
        body = json.dumps({"inputs": [{"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                                       "data": [0.5] * int(np.prod(shape))}]})
        for _ in range(3):
            c.request("POST", "/v2/models/tiny_mlp/infer", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200, r.read()
            assert json.loads(r.read())["outputs"][0]["shape"][0] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_says_clearly_when_the_port_is_taken(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        proc = _spawn(str(ROOT / "examples" / "repository" / "tiny_mlp.yaml"), "--http-port", str(port), "--no-grpc")
        _, err = proc.communicate(timeout=60)
    finally:
        sock.close()
    assert proc.returncode == 2  # said before any model is built (it used to come after the loading)
    assert f"HTTP port {port} on 127.0.0.1 is already in use" in err and "--http-port" in err
    assert "loading" not in err, err


def test_serve_rejects_a_bad_repository(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: a\n")
    proc = _spawn(str(tmp_path / "bad.yaml"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "'source'" in err


def test_http_workers_default_to_four_on_a_host_with_cpus_to_spare_and_none_on_a_small_one():
    from gpuloom.commands.serve import default_http_workers, http_workers_arg

    assert default_http_workers(8) == 4 and default_http_workers(12) == 6 and default_http_workers(16) == 8
    assert default_http_workers(64) == 8  # each worker's ring is looked at on every wake-up of the loop
    assert default_http_workers(2) == 0 and default_http_workers(None) == 0
    assert http_workers_arg("3") == 3 and http_workers_arg("0") == 0
    for bad in ("-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="'auto' or a non-negative number"):
            http_workers_arg(bad)


def _serve_parser_and_repo(tmp_path):
    """``gpuloom serve``'s parser and a one-model repository (its source is never imported)."""
    from gpuloom.commands import serve

    (tmp_path / "m.yaml").write_text("name: m\nsource: 'x.py:f'\ninputs: [{name: x, shape: [4], dtype: float32}]\n")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p, str(tmp_path / "m.yaml")


def _record_service(monkeypatch) -> list[dict]:
    """Replace the InferenceService with a recorder of its keyword arguments that stops the command."""
    import gpuloom.runtime.service as service_mod

    seen: list[dict] = []

    def record(**kw):
        seen.append(kw)
        raise ValueError("recorded")

    monkeypatch.setattr(service_mod, "InferenceService", record)
    return seen


def test_every_flag_left_alone_gives_the_service_its_own_default(tmp_path, monkeypatch):
    """``gpuloom serve`` with no flags configures the InferenceService exactly as its own defaults do:
    a default written twice drifts unseen (the repository's parser once kept gpuloom's kernels off
    after ModelConfig had turned them on)."""
    import inspect

    from gpuloom.commands import serve
    from gpuloom.runtime.service import InferenceService

    defaults = {k: v.default for k, v in inspect.signature(InferenceService).parameters.items()}
    seen = _record_service(monkeypatch)
    p, repo = _serve_parser_and_repo(tmp_path)
    assert serve.run(p.parse_args([repo])) == 2
    given = {k: v for k, v in seen[0].items() if k not in ("policy_options", "profiles")}
    assert len(given) >= 12, given
    assert given == {k: defaults[k] for k in given}
    assert seen[0]["policy_options"] == {} and seen[0]["profiles"] is defaults["profiles"]


def test_launch_on_and_switch_interval_reach_the_service(tmp_path, monkeypatch):
    """``--launch-on`` and ``--switch-interval-ms`` configure the InferenceService; by default the
    service picks the launch thread for its device, and the interpreter's switch interval stays."""
    from gpuloom.commands import serve

    seen = _record_service(monkeypatch)
    p, repo = _serve_parser_and_repo(tmp_path)
    assert serve.run(p.parse_args([repo, "--launch-on", "inline", "--switch-interval-ms", "0.5",
                                   "--workqueues", "balanced"])) == 2
    assert serve.run(p.parse_args([repo])) == 2
    assert seen[0]["launch_on"] == "inline" and seen[0]["switch_interval_ms"] == 0.5
    assert seen[0]["workqueues"] == "balanced" and seen[1]["workqueues"] == "shared"
    assert seen[1]["launch_on"] == "auto" and seen[1]["switch_interval_ms"] is None
    with pytest.raises(SystemExit):
        p.parse_args([repo, "--launch-on", "gpu"])


def test_graph_cache_sets_where_this_process_compiles_keep_their_graphs(tmp_path, monkeypatch):
    """``--graph-cache DIR|none`` is read by every compile of the server's process; without it the
    environment's setting (or the default) stays."""
    from gpuloom.commands import serve
    from gpuloom.engine import graph_cache

    _record_service(monkeypatch)
    p, repo = _serve_parser_and_repo(tmp_path)
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", str(tmp_path / "from-env"))
    assert serve.run(p.parse_args([repo])) == 2
    assert graph_cache.cache_dir() == tmp_path / "from-env"
    assert serve.run(p.parse_args([repo, "--graph-cache", str(tmp_path / "graphs")])) == 2
    assert graph_cache.cache_dir() == tmp_path / "graphs"
    assert serve.run(p.parse_args([repo, "--graph-cache", "none"])) == 2
    assert graph_cache.cache_dir() is None


def test_outputs_reach_the_service_and_views_with_torch_launches_are_refused_with_the_reason(
        tmp_path, monkeypatch, capsys):
    """``--outputs views`` reaches the InferenceService (copies by default); with ``--torch-launch``
    serve refuses it before it loads anything, says why in its own flags, and exits 2."""
    from gpuloom.commands import serve

    p, repo = _serve_parser_and_repo(tmp_path)
    assert serve.run(p.parse_args([repo, "--outputs", "views", "--torch-launch"])) == 2
    assert "drop --torch-launch" in capsys.readouterr().err
    seen = _record_service(monkeypatch)
    assert serve.run(p.parse_args([repo, "--outputs", "views"])) == 2
    assert serve.run(p.parse_args([repo])) == 2
    assert seen[0]["outputs"] == "views" and seen[1]["outputs"] == "copies"
    with pytest.raises(SystemExit):
        p.parse_args([repo, "--outputs", "both"])


def test_runtime_on_http_takes_no_front_end_workers_by_default_and_refuses_explicit_ones(tmp_path, monkeypatch, capsys):
    from gpuloom.commands import serve

    monkeypatch.setattr(serve, "default_http_workers", lambda cpus: 4)  # as on a host with 8 or more CPUs
    p, repo = _serve_parser_and_repo(tmp_path)
    assert serve.run(p.parse_args([repo, "--runtime-on", "http", "--http-workers", "2"])) == 2
    assert "use --http-workers 0" in capsys.readouterr().err
    _record_service(monkeypatch)
    for argv, workers in (([], 4), (["--http-workers", "auto"], 4), (["--runtime-on", "http"], 0),
                          (["--runtime-on", "http", "--http-workers", "auto"], 0),
                          (["--runtime-on", "http", "--http-workers", "0"], 0)):
        args = p.parse_args([repo, *argv])
        assert serve.run(args) == 2 and args.http_workers == workers  # (resolved before the service is made)
    with pytest.raises(SystemExit):
        p.parse_args([repo, "--runtime-on", "gpu"])


def test_runtime_on_http_where_the_loop_cannot_be_hosted_is_refused_before_any_model_loads(tmp_path, capsys):
    from gpuloom.commands import serve

    p, repo = _serve_parser_and_repo(tmp_path)  # (its model's source does not exist: a load would fail)
    assert serve.run(p.parse_args([repo, "--runtime-on", "http", "--device", "cpu", "--launch-on", "loop"])) == 2
    err = capsys.readouterr().err
    assert "--runtime-on http: " in err and "inline launches" in err and "loading" not in err


def test_policy_options_reach_the_service_and_bad_ones_are_refused_before_loading(tmp_path, monkeypatch, capsys):
    from gpuloom.commands import serve

    p, repo = _serve_parser_and_repo(tmp_path)
    for spec, says in (("dstack:lookahead_ms=1", "configure the service"), ("dstack:bogus=1", "bogus"),
                       ("dstack:min_sms=-8", "min_sms"), ("nope", "known policies")):
        assert serve.run(p.parse_args([repo, "--policy", spec])) == 2
        assert says in capsys.readouterr().err
    seen = _record_service(monkeypatch)
    assert serve.run(p.parse_args([repo, "--policy", "dstack:min_sms=0:replan=false"])) == 2
    assert seen[0]["policy"] == "dstack" and seen[0]["policy_options"] == {"min_sms": 0, "replan": False}


def test_cpus_lists_parse_like_taskset_and_bad_ones_are_refused():
    from gpuloom.commands.serve import cpus_arg

    assert cpus_arg("1") == {1} and cpus_arg("0,2-3") == {0, 2, 3} and cpus_arg(" 4 - 5 ") == {4, 5}
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="CPU list"):
            cpus_arg(bad)


def test_http_worker_nice_takes_0_to_19_and_refuses_the_rest_with_the_range(tmp_path):
    from gpuloom.commands.serve import nice_arg

    p, repo = _serve_parser_and_repo(tmp_path)
    assert p.parse_args([repo]).http_worker_nice is None  # the server's default (frontend.WORKER_NICE)
    assert p.parse_args([repo, "--http-worker-nice", "0"]).http_worker_nice == 0
    assert nice_arg("19") == 19
    for bad in ("20", "-1", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="from 0 to 19"):
            nice_arg(bad)


def test_http_return_allowance_is_off_by_default_and_reaches_the_server(tmp_path, monkeypatch, capsys):
    """``--http-return-allowance``: auto or off (the default until an A/B on the GPU), handed to the
    Server, which hands it to its front-end workers."""
    from gpuloom.commands import serve
    from gpuloom.serve.server import Server

    p, repo = _serve_parser_and_repo(tmp_path)
    assert p.parse_args([repo]).http_return_allowance == "off"
    assert p.parse_args([repo, "--http-return-allowance", "auto"]).http_return_allowance == "auto"
    with pytest.raises(SystemExit):
        p.parse_args([repo, "--http-return-allowance", "on"])
    assert "--http-return-allowance: invalid choice: 'on'" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(Server, "serve_forever", lambda self, on_started=None: (
        seen.append(self.return_allowance), self.core.service.close()))
    empty = tmp_path / "empty"
    empty.mkdir()
    for flags, want in (([], "off"), (["--http-return-allowance", "auto"], "auto")):
        assert serve.run(p.parse_args([str(empty), "--device", "cpu", "--http-port", "0", "--no-grpc", *flags])) == 0
        assert seen.pop() == want


def test_client_timeout_takes_seconds_above_zero_and_says_so_otherwise(tmp_path, capsys):
    from gpuloom.commands.serve import client_timeout_arg

    p, repo = _serve_parser_and_repo(tmp_path)
    assert p.parse_args([repo]).client_timeout == 60.0
    assert p.parse_args([repo, "--client-timeout", "2.5"]).client_timeout == 2.5
    for bad in ("0", "-1", "x", "inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
            client_timeout_arg(bad)
    with pytest.raises(SystemExit):  # at parse time, before any model is compiled
        p.parse_args([repo, "--client-timeout", "0"])
    assert "--client-timeout: expected seconds > 0, got '0'" in capsys.readouterr().err


def test_cpus_pins_every_thread_of_the_server(tmp_path):
    """``--cpus``: every thread of the server runs on those CPUs, those started at import included."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    (tmp_path / "slow.py").write_text(SLOW)
    (tmp_path / "slow.yaml").write_text("name: slow\nsource: slow.py:slow\ninputs: [{name: x, shape: [2]}]\nmax_batch: 4\nslo_ms: 5000\n")
    proc = _spawn(str(tmp_path), "--http-port", "0", "--no-grpc", "--cpus", str(cpu), "--launch-on", "inline")
    try:
        port, _ = _wait_port(proc)
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]})
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/v2/models/slow/infer", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read())["outputs"][0]["data"] == [2.0, 3.0]
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        names = {open(f"/proc/{proc.pid}/task/{t}/comm").read().strip() for t in tids}
        assert len(tids) >= 3, names  # the HTTP loop, the runtime's loop, its watcher, ...
        got = {(t, open(f"/proc/{proc.pid}/task/{t}/comm").read().strip()): os.sched_getaffinity(t) for t in tids}
        assert all(v == {cpu} for v in got.values()), got
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_taken_grpc_port_or_a_host_with_no_address_is_refused_before_any_model_loads(tmp_path, capsys):
    from gpuloom.commands import serve

    p, repo = _serve_parser_and_repo(tmp_path)  # (its model's source does not exist: a load would fail)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert serve.run(p.parse_args([repo, "--http-port", "0", "--grpc-port", str(port)])) == 2
    err = capsys.readouterr().err
    assert f"gRPC port {port} on 127.0.0.1 is already in use" in err and "--grpc-port" in err and "loading" not in err
    assert serve.run(p.parse_args([repo, "--host", "no-such-host.invalid", "--http-port", "0", "--no-grpc"])) == 2
    err = capsys.readouterr().err
    assert "cannot listen for HTTP on no-such-host.invalid" in err and "--host" in err and "loading" not in err


def test_ctrl_c_while_a_model_loads_stops_in_one_line_with_status_130(tmp_path, monkeypatch, capsys):
    """A compile takes minutes; Ctrl-C in it used to end in the compiler's 448-line stack."""
    from gpuloom.commands import serve
    from gpuloom.serve.core import ServeCore

    def interrupted(self, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(ServeCore, "load", interrupted)
    p, repo = _serve_parser_and_repo(tmp_path)
    assert serve.run(p.parse_args([repo, "--device", "cpu", "--http-port", "0", "--no-grpc"])) == 130
    err = capsys.readouterr().err
    assert "interrupted while loading: stopping" in err and "Traceback" not in err, err


def test_ctrl_c_while_a_model_builds_ends_the_process_at_once_in_one_line(tmp_path):
    """Ctrl-C before the server serves ends the process with status 130 and one line, whatever it
    interrupts. Raised as Python's KeyboardInterrupt it aborted the process when it landed in torch's
    C++ callbacks or under the builder thread's compile at teardown, and when it landed in the GC
    monitor's callback it was ignored and the server started anyway (sixty-fifth session, on the CPU). Here the model's factory is still running (on the builder thread)."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "nets.py").write_text("import time\n\ndef slow():\n    time.sleep(60)\n")
    (tmp_path / "slow.yaml").write_text("name: slow\nsource: 'nets.py:slow'\n"
                                        "inputs: [{name: x, shape: [4], dtype: float32}]\n")
    p = subprocess.Popen([sys.executable, "-m", "gpuloom", "serve", str(tmp_path), "--device", "cpu",
                          "--http-port", "0", "--no-grpc"], stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + 120
    while "loading slow" not in seen and time.monotonic() < deadline:
        seen += p.stderr.readline()
    assert "loading slow" in seen, seen
    time.sleep(0.5)  # in the factory
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    assert p.wait(timeout=30) == 130
    assert time.monotonic() - t0 < 10  # not after the factory's 60 s
    assert "interrupted while starting: stopping (no model served)" in rest and "Traceback" not in rest, rest


def test_an_empty_repository_is_served_with_a_warning_saying_how_to_add_a_model(tmp_path, monkeypatch, capsys):
    from gpuloom.commands import serve
    from gpuloom.serve.server import Server, ServerAddress

    # started, then stopped as the real one stops: the service closed (a started one left open kept the
    # process's collector settings for the tests after it: test_gcpause failed after this file)
    monkeypatch.setattr(Server, "serve_forever", lambda self, on_started=None: (
        on_started(ServerAddress("127.0.0.1", 1, None)), self.core.service.close()))
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert serve.run(p.parse_args([str(tmp_path), "--device", "cpu", "--http-port", "0", "--no-grpc"])) == 0
    err = capsys.readouterr().err
    assert f"warning: {tmp_path} has no models" in err and "/v2/repository/models/<name>/load" in err
    assert "serving 0 models (none yet)" in err, err


def test_gpuloom_warnings_print_as_one_line_and_other_packages_keep_their_location(capsys):
    import warnings

    import gpuloom.runtime.service as service_mod
    from gpuloom.commands.output import plain_warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # Python's own printer (pytest records warnings in place of it while a test runs)
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(m, c, f, n, line))
        plain_warnings()
        warnings.warn_explicit("no latency profile for 'm'", UserWarning, service_mod.__file__, 10)
        warnings.warn_explicit("something else", FutureWarning, "/elsewhere/pkg/mod.py", 7)
    err = capsys.readouterr().err
    assert "warning: no latency profile for 'm'\n" in err and "service.py" not in err, err
    assert "/elsewhere/pkg/mod.py:7: FutureWarning: something else" in err, err


def test_ports_out_of_range_the_same_port_twice_and_a_device_that_is_none_are_one_line_errors(tmp_path, capsys):
    """(A review, sixty-fourth session: --http-port 70000 served on port 4464; the same port for HTTP and
    gRPC failed only after the models loaded, as "already in use"; --device nosuch printed a traceback.)"""
    from gpuloom.commands import serve

    p, repo = _serve_parser_and_repo(tmp_path)  # (its model's source does not exist: a load would fail)
    assert serve.port_number("65535") == 65535 and serve.port_number("0") == 0
    for bad in ("70000", "-5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="0-65535"):
            serve.port_number(bad)
    assert serve.run(p.parse_args([repo, "--http-port", "9123", "--grpc-port", "9123"])) == 2
    err = capsys.readouterr().err
    assert "--http-port and --grpc-port are both 9123" in err and "loading" not in err
    assert serve.run(p.parse_args([repo, "--http-port", "0", "--no-grpc", "--device", "nosuch"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device nosuch: ValueError: device must be") and "Traceback" not in err


def test_an_ipv6_host_is_bracketed_for_grpc_and_in_urls():
    """(--host ::1 failed at gRPC's listen, "Misformatted domain name", reported as a taken port.)"""
    from gpuloom.serve.server import ServerAddress, _grpc_address

    assert _grpc_address("::1", 8001) == "[::1]:8001" and _grpc_address("127.0.0.1", 8001) == "127.0.0.1:8001"
    assert _grpc_address("", 8001) == "[::]:8001" and _grpc_address("[::1]", 8001) == "[::1]:8001"
    addr = ServerAddress("::1", 8000, 8001)
    assert addr.http_url == "[::1]:8000" and addr.grpc_url == "[::1]:8001"
    assert ServerAddress("127.0.0.1", 8000, None).http_url == "127.0.0.1:8000"


def _tiny_mlp_server(**server_kw):
    """A started server of tiny_mlp on the fake service, and a JSON infer body for it: (core, server,
    address, body)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import serve_fake

    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository
    from gpuloom.serve.server import Server

    core = ServeCore(serve_fake.make_service(), load_repository(ROOT / "examples" / "repository" / "tiny_mlp.yaml"))
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, **server_kw)
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
    return core, server, server.start(), body


def _kept_alive_first(addr, body: str) -> http.client.HTTPConnection:
    """A connection whose first infer request was answered 200 and kept alive."""
    c = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
    c.request("POST", "/v2/models/tiny_mlp/infer", body)
    r = c.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("Connection") is None  # kept alive while serving
    return c


def test_once_the_server_stops_every_answer_closes_its_connection():
    """During a stop's drain the server answers requests on kept-alive connections (503, or their
    results), then closes those connections: the answers now say ``Connection: close``, so a client
    does not send its next request on a connection the server is about to close. Without it, a
    SIGTERM under keep-alive load left every one of 50 tight-loop clients with a request the server
    dropped unread or reset (sixty-fifth session, ``docs/reports/serving.md``)."""
    core, server, addr, body = _tiny_mlp_server()
    try:
        c = _kept_alive_first(addr, body)
        core.closing = True  # what a stop sets first
        c.request("POST", "/v2/models/tiny_mlp/infer", body)
        r = c.getresponse()
        r.read()
        assert r.status == 503 and r.getheader("Connection") == "close"
    finally:
        core.closing = False
        server.stop()


def test_a_stopping_front_end_worker_answers_a_request_sent_on_a_kept_alive_connection_and_closes_it():
    """A front-end worker told to stop (SIGTERM, as ``Server.stop`` does first) stops taking
    connections, answers what arrives on the ones open for a short grace, saying ``Connection: close``,
    then closes. Before, it stopped at once: a request sent on a kept-alive connection just after was
    dropped unread and its client saw the connection reset (``docs/reports/serving.md``, sixty-fifth
    session's SIGTERM runs: left for the workers then)."""
    _, server, addr, body = _tiny_mlp_server(http_workers=1)
    try:
        c = _kept_alive_first(addr, body)
        (pid,) = server.worker_pids()
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.1)  # the worker is stopping now
        c.request("POST", "/v2/models/tiny_mlp/infer", body)
        r = c.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("Connection") == "close"
        with pytest.raises(OSError):  # the listener is closed: no new connection while it stops
            probe = socket.create_connection((addr.host, addr.http_port), timeout=1)
            probe.close()
            raise AssertionError("the stopping worker still took a connection")
    finally:
        server.stop()


@pytest.mark.parametrize("upload_s", [0.6, 4.0], ids=["within-the-grace", "beyond-it"])
def test_a_stopping_worker_waits_for_a_body_still_arriving_within_its_grace_and_never_for_the_drain_timeout(upload_s):
    """A request whose body is still arriving when its worker is told to stop: within the grace (2 s)
    the worker waits for it and answers it (the runtime's process is stopping too: 503); past the grace it cuts that connection, so the stop ends then
    instead of waiting out the drain timeout for bytes aiohttp's cleanup drops (a review, sixty-eighth
    session: no answer and ``Server.stop`` 8.7 s with an 8 s drain timeout, the body spread over 0.6 s)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import serve_fake

    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository
    from gpuloom.serve.server import Server

    core = ServeCore(serve_fake.make_service(), load_repository(ROOT / "examples" / "repository" / "tiny_mlp.yaml"))
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, drain_timeout_s=12.0)
    addr = server.start()
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}).encode()
    head = (f"POST /v2/models/tiny_mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Gpuloom-Deadline-Ms: 20000\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    stopper = threading.Thread(target=server.stop)
    try:
        s = socket.create_connection((addr.host, addr.http_port), timeout=30)
        s.sendall(head + body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")  # kept alive, with an answer behind it
        s.sendall(head + body[:len(body) // 2])  # the next request: its headers and half its body
        time.sleep(0.05)
        t0 = time.monotonic()
        stopper.start()
        rest = body[len(body) // 2:]
        for i in range(6):
            time.sleep(upload_s / 6)
            try:
                s.sendall(rest[i * len(rest) // 6:(i + 1) * len(rest) // 6])
            except OSError:  # cut past the grace
                break
        try:
            got = s.recv(65536)
        except OSError:
            got = b""
        stopper.join(30)
        took = time.monotonic() - t0
        if upload_s < 2.0:  # answered (the runtime's process is stopping too: a 503 with Retry-After, or served)
            assert got.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")) and b"Connection: close" in got, got[:200]
        assert took < 6.0, f"Server.stop took {took:.1f} s (the drain timeout is 12)"
    finally:
        if not stopper.is_alive():
            server.stop()


def test_the_start_handler_of_ctrl_c_keeps_an_ignored_sigint_ignored_and_puts_the_previous_back():
    """A server started in the background by a script, with SIGINT ignored, went on ignoring it until it
    served before the start handler; it does again (a review, sixty-fifth session)."""
    import signal

    from gpuloom.commands.serve import _QuitOnCtrlC

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _QuitOnCtrlC():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with _QuitOnCtrlC() as q:
            assert signal.getsignal(signal.SIGINT) == q._quit
            q.release()
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
