"""``gpuloom load``'s report, arguments and exit status (a review, sixty-ninth session): NaN in
``--json``, throughput above the rate sent, ``--rate nan`` / ``1e12`` / ``--timeout 0`` unchecked,
and exit 0 from a run in which no request succeeded.

The server is a stub on loopback (stdlib ``http.server``) whose infer answers are 200, all 503, or
every other one 503, so each run's outcome is exact and quick."""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuloom.commands import load as load_cmd
from gpuloom.serve.loadgen import arrival_times, run_closed, run_load

META = {"name": "m", "inputs": [{"name": "x", "shape": [-1, 2], "datatype": "FP32"}]}


class _Stub(BaseHTTPRequestHandler):
    """KServe v2 enough for the load client: model ``m``'s metadata and config, and infer answers
    that fail as ``failing`` says: "none", "all" (503) or "every other"."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the load client expects
    failing = "none"
    count = itertools.count()

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        answers = {"/v2/models/m": META, "/v2/models/m/config": {"max_batch_size": 8}}
        self._answer(200, answers[self.path]) if self.path in answers else self._answer(404, {"error": "no such"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        k = next(_Stub.count)
        fail = _Stub.failing == "all" or (_Stub.failing == "every other" and k % 2 == 1)
        self._answer(503, {"error": "the stub says no"}) if fail else self._answer(200, {"outputs": []})


@pytest.fixture(scope="module")
def stub_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def stub(stub_server):
    """The stub's URL; a test sets ``_Stub.failing``, put back to "none" after it."""
    yield stub_server
    _Stub.failing = "none"


def _args(*argv):
    p = argparse.ArgumentParser()
    load_cmd.add_arguments(p)
    return p.parse_args(list(argv))


def _strict_json(text: str) -> dict:
    """``text`` parsed as JSON proper: Python's json reads NaN and Infinity, which JSON has not."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_report_is_valid_json_with_null_where_there_is_no_value(stub, capsys):
    """Closed loop has no asked rate (it printed ``"rate": NaN``); a run with no success has no
    latency (``"p50_ms": NaN``)."""
    load_cmd.run(_args(stub, "--model", "m", "--concurrency", "1", "--duration", "0.1", "--json"))
    res = _strict_json(capsys.readouterr().out)
    assert res["ok"] > 0 and res["rate"] is None and res["sent_rate"] > 0 and res["p50_ms"] > 0
    _Stub.failing = "all"
    load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.2", "--json"))
    res = _strict_json(capsys.readouterr().out)
    assert res["sent"] > 0 and res["ok"] == 0 and res["slo_attainment"] == 0.0
    assert [res[k] for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")] == [None] * 4
    load_cmd.run(_args(stub, "--model", "m", "--rate", "1", "--duration", "0.001", "--json"))  # sends none
    res = _strict_json(capsys.readouterr().out)
    assert res["sent"] == 0 and res["slo_attainment"] is None and res["p99_ms"] is None


def test_text_report_says_dash_where_there_is_no_value(stub, capsys):
    _Stub.failing = "all"
    load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.2"))
    out = capsys.readouterr().out
    assert "  latency ms     p50 -  p90 -  p99 -  mean -\n" in out and "nan" not in out, out
    load_cmd.run(_args(stub, "--model", "m", "--rate", "1", "--duration", "0.001"))  # sends none
    out = capsys.readouterr().out
    assert "  SLO attainment - within 100 ms\n" in out and "nan" not in out, out


def test_throughput_is_over_at_least_the_duration_asked_for(stub, capsys):
    """Constant arrivals end at duration - 1/rate: ``--rate 10 --duration 1`` reported 11 req/s."""
    load_cmd.run(_args(stub, "--model", "m", "--rate", "20", "--duration", "0.5", "--constant", "--json"))
    res = _strict_json(capsys.readouterr().out)
    assert res["ok"] == res["sent"] == 10 and res["duration_s"] >= 0.5
    assert res["throughput"] <= 20.0 and res["throughput"] == res["ok"] / res["duration_s"]
    load_cmd.run(_args(stub, "--model", "m", "--concurrency", "1", "--duration", "0.1", "--json"))
    assert _strict_json(capsys.readouterr().out)["duration_s"] >= 0.1


def test_the_report_gives_the_rate_asked_for_and_the_rate_sent(stub, capsys):
    """Poisson arrivals send more or fewer than asked (seed 0: 14 requests in 0.5 s at 40/s, 28/s);
    "offered 40" beside "throughput 28.0" read like a server shortfall."""
    sent = len(arrival_times(40.0, 0.5, seed=0))
    assert sent == 14
    load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.5", "--json"))
    res = _strict_json(capsys.readouterr().out)
    assert res["rate"] == 40.0 and res["sent"] == sent and res["sent_rate"] == sent / 0.5
    load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.5"))
    out = capsys.readouterr().out
    assert out.startswith("model m: asked 40 req/s, sent 28.0 req/s for 0.5 s (Poisson), batch 1\n"), out


@pytest.mark.parametrize("flag, bad", [("--rate", "nan"), ("--rate", "inf"), ("--rate", "0"), ("--rate", "-3"),
                                       ("--duration", "nan"), ("--duration", "inf"), ("--duration", "0"),
                                       ("--timeout", "0"), ("--timeout", "-1"), ("--timeout", "nan")])
def test_rate_duration_and_timeout_must_be_finite_and_positive(capsys, flag, bad):
    """``--rate nan`` ended in "cannot convert float NaN", ``--rate inf`` in "cannot reach URL:
    OverflowError", ``--timeout 0`` meant no timeout with aiohttp and an error with the lean client."""
    argv = ["127.0.0.1:1", "--model", "m", "--rate", "5", "--duration", "1", flag, bad]
    with pytest.raises(SystemExit) as e:
        _args(*argv)
    assert e.value.code == 2
    assert f"argument {flag}: expected a positive number of" in capsys.readouterr().err


def test_a_run_of_more_requests_than_the_bound_is_refused_before_it_starts(capsys):
    """``--rate 1e12`` reported "cannot reach URL: MemoryError: Unable to allocate 109 TiB". The
    library refuses the same, and a timeout that is not a finite positive number of seconds."""
    assert load_cmd.run(_args("127.0.0.1:1", "--model", "m", "--rate", "1e12", "--duration", "10")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rate 1e+12 for --duration 10 s is 1e+13 requests; one run sends at most "
                          "10,000,000 (it schedules every request up front"), err
    from gpuloom.serve.loadgen import MAX_REQUESTS  # (here: a name the fix added)

    with pytest.raises(ValueError, match="at most 10,000,000"):
        arrival_times(MAX_REQUESTS + 1.0, 1.0)
    for rate, duration in ((float("nan"), 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="finite and positive"):
            arrival_times(rate, duration)
    for run in (lambda: run_load("127.0.0.1:1", "m", rate=5, duration_s=0.1, timeout_s=0),
                lambda: run_closed("127.0.0.1:1", "m", concurrency=1, duration_s=0.1, timeout_s=-1)):
        with pytest.raises(ValueError, match="timeout_s must be a finite positive number of seconds"):
            run()


def test_exit_status_is_1_when_no_request_succeeded_and_0_when_some_did(stub, capsys):
    _Stub.failing = "all"
    assert load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.2")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: none of the ") and "(errors {'503': " in err
    assert err.rstrip().endswith("the first was told: HTTP 503: the stub says no"), err
    assert load_cmd.run(_args(stub, "--model", "m", "--concurrency", "2", "--duration", "0.1")) == 1
    assert capsys.readouterr().err.startswith("error: none of the ")
    _Stub.failing = "none"
    assert load_cmd.run(_args(stub, "--model", "m", "--rate", "1", "--duration", "0.001", "--json")) == 1
    assert capsys.readouterr().err == ("error: no request was sent in 0.001 s at 1 req/s (its arrivals drew no "
                                       "send time): raise --rate or --duration\n")
    _Stub.failing = "every other"
    assert load_cmd.run(_args(stub, "--model", "m", "--rate", "40", "--duration", "0.3", "--json")) == 0
    res = _strict_json(capsys.readouterr().out)
    assert 0 < res["ok"] < res["sent"] and res["errors"]["503"] == res["sent"] - res["ok"]
