"""``gpuloom load`` against a real server on loopback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402

from gpuloom.commands import load as load_cmd  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.loadgen import arrival_times  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"


@pytest.fixture(scope="module")
def server():
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    srv = Server(core, http_port=0, grpc_port=None)
    addr = srv.start()
    yield addr, core
    srv.stop()


def _args(*argv):
    p = argparse.ArgumentParser()
    load_cmd.add_arguments(p)
    return p.parse_args(list(argv))


def test_arrival_times_have_the_asked_rate():
    t = arrival_times(200.0, 5.0, poisson=True, seed=3)
    assert abs(len(t) / 5.0 - 200.0) < 200.0 * 0.1 and np.all(np.diff(t) >= 0) and t[-1] < 5.0
    c = arrival_times(50.0, 2.0, poisson=False)
    assert len(c) == 100 and np.allclose(np.diff(c), 0.02)
    with pytest.raises(ValueError, match="positive"):
        arrival_times(0.0, 1.0)


@pytest.mark.parametrize("mode, client", [("--poisson", "aiohttp"), ("--constant", "aiohttp"), ("--poisson", "lean")])
def test_load_client_reports_throughput_attainment_and_percentiles(server, capsys, mode, client):
    addr, core = server
    before = core.books.snapshot().get("tiny_mlp")
    ok_before = before.success if before else 0
    rc = load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--rate", "40", "--duration", "1", mode, "--json",
                            "--client", client))
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sent"] > 20 and res["ok"] == res["sent"] and not res["errors"]
    assert res["slo_ms"] == 50.0  # the model's SLO, read from its config
    assert 0.0 <= res["slo_attainment"] <= 1.0 and res["p50_ms"] <= res["p99_ms"]
    assert 20 < res["throughput"] < 80
    assert core.books.snapshot()["tiny_mlp"].success - ok_before == res["ok"]  # the server saw exactly these
    st = res["server_timing_ms"]["service"]  # the server's Server-Timing, summarized over the answers
    assert st["n"] == res["ok"] and 0 < st["p50"] <= st["p99"] and st["p50"] <= res["p99_ms"]


def test_requests_carry_their_own_deadline_and_one_that_cannot_be_met_is_a_504(server, capsys):
    addr, core = server
    rc = load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--rate", "40", "--duration", "0.5",
                            "--deadline-ms", "10000", "--json"))
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] == res["sent"] > 5 and res["slo_ms"] == 10000.0  # attainment against the deadline
    before = sum(core.books.snapshot()["tiny_mlp"].dropped.values())
    rc = load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--rate", "40", "--duration", "0.5",
                            "--deadline-ms", "0.001", "--json"))  # 1 us: no batch runs that fast
    assert rc == 1  # no request succeeded (it was 0 until the sixty-ninth session's review)
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] == 0 and res["errors"] == {"504": res["sent"]} and res["slo_attainment"] == 0.0
    assert sum(core.books.snapshot()["tiny_mlp"].dropped.values()) - before == res["sent"]  # booked as drops
    assert load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--concurrency", "2", "--deadline-ms", "5")) == 2
    assert "goes with --rate" in capsys.readouterr().err
    assert load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--rate", "5", "--deadline-ms", "0")) == 2


def test_the_timeout_parameter_is_triton_microseconds():
    from gpuloom.serve.loadgen import _body
    from gpuloom.serve.protocol import deadline_ms_from_parameters

    meta = {"inputs": [{"name": "x", "shape": [-1, 4], "datatype": "FP32"}]}
    for binary in (True, False):
        body, headers = _body(meta, 1, binary, np.random.default_rng(0), deadline_ms=12.5)
        head = body[:int(headers["Inference-Header-Content-Length"])] if binary else body
        params = json.loads(head)["parameters"]
        assert params["timeout"] == 12500 and deadline_ms_from_parameters(params) == 12.5
        assert params.get("binary_data_output", False) is binary
    body, _ = _body(meta, 1, False, np.random.default_rng(0))
    assert "parameters" not in json.loads(body)  # no deadline, JSON tensors: no parameters at all


def test_load_client_human_output_and_json_tensors(server, capsys):
    addr, _ = server
    rc = load_cmd.run(_args(f"http://{addr.http_url}", "--model", "tiny_mlp", "--rate", "20", "--duration", "0.5", "--json-tensors", "--batch", "2"))
    out = capsys.readouterr().out
    assert rc == 0 and "throughput" in out and "SLO attainment" in out and "p99" in out


def test_load_client_unknown_model_and_dead_server_fail_cleanly(server, capsys):
    addr, _ = server
    assert load_cmd.run(_args(addr.http_url, "--model", "nope", "--rate", "5", "--duration", "0.2")) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert load_cmd.run(_args("127.0.0.1:1", "--model", "x", "--rate", "5", "--duration", "0.2")) == 1
    assert "error" in capsys.readouterr().err
    assert load_cmd.run(_args("https://127.0.0.1:1", "--model", "x", "--rate", "5", "--duration", "0.2",
                              "--client", "lean")) == 1
    assert "plain http" in capsys.readouterr().err


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
def test_closed_loop_concurrency_mode_measures_saturation(server, capsys, client):
    addr, core = server
    rc = load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--concurrency", "4", "--duration", "0.5", "--json",
                            "--client", client))
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["ok"] == res["sent"] > 4 and res["throughput"] > 0
    assert res["slo_ms"] == 50.0  # the model's SLO, read from its config (it was a fixed 100 ms once)
    assert load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp")) == 2  # neither --rate nor --concurrency
    assert "--concurrency" in capsys.readouterr().err


def test_closed_loop_sends_the_rows_asked_for(server, capsys):
    """``--batch`` with ``--concurrency``: requests of that many rows (it was ignored once: batch 1
    always). tiny_mlp takes at most 16 rows a request, so 16 are served and 17 stop the run at its
    start, saying why (every request was a 400 before, and the report did not say why)."""
    addr, _ = server
    argv = (addr.http_url, "--model", "tiny_mlp", "--concurrency", "2", "--duration", "0.3", "--json")
    assert load_cmd.run(_args(*argv, "--batch", "16")) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] == res["sent"] > 0 and res["first_error"] == ""
    assert load_cmd.run(_args(*argv, "--batch", "17")) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("error: batch 17 is more rows than model 'tiny_mlp' takes in a request (its config's "
                           "max_batch_size is 16): the server would refuse every request; send at most 16"), err
    assert load_cmd.run(_args(*argv, "--batch", "0")) == 2
    assert "--batch" in capsys.readouterr().err


def test_a_batch_past_the_models_max_or_an_slo_that_is_not_positive_is_said_at_once(server, capsys):
    """``--batch`` over the model's max_batch and ``--slo-ms -5`` ran to the end without saying why
    every request failed or missed (a review, sixty-fourth session)."""
    addr, _ = server
    argv = (addr.http_url, "--model", "tiny_mlp", "--rate", "20", "--duration", "0.2")
    assert load_cmd.run(_args(*argv, "--batch", "17")) == 1
    assert "batch 17 is more rows than model 'tiny_mlp' takes in a request" in capsys.readouterr().err
    for bad in ("-5", "0", "nan", "inf", "fast"):
        with pytest.raises(SystemExit) as e:
            _args(*argv, "--slo-ms", bad)
        assert e.value.code == 2
        assert "--slo-ms: expected a" in capsys.readouterr().err
    assert _args(*argv, "--slo-ms", "2.5").slo_ms == 2.5


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
def test_a_run_whose_requests_fail_says_what_the_first_was_told(server, capsys, client):
    addr, _ = server
    rc = load_cmd.run(_args(addr.http_url, "--model", "tiny_mlp", "--rate", "40", "--duration", "0.3",
                            "--deadline-ms", "0.001", "--client", client))  # 1 us: every request a 504
    out = capsys.readouterr().out
    assert rc == 1 and "errors {'504'" in out  # none succeeded: exit 1 (0 until the sixty-ninth session's review)
    assert "  first error    HTTP 504: model 'tiny_mlp': deadline exceeded" in out, out


def test_server_timing_header_round_trips_and_tolerates_junk():
    from gpuloom.serve.protocol import parse_server_timing, server_timing

    value = server_timing({"service": 3.25, "bridge": 4.0})
    assert value == "service;dur=3.250, bridge;dur=4.000"
    assert parse_server_timing(value) == {"service": 3.25, "bridge": 4.0}
    assert parse_server_timing('cache;desc="hit", db;dur=x, app;desc=a;dur="1.5", ;dur=2') == {"app": 1.5}
    assert parse_server_timing(None) == {} and parse_server_timing("") == {}


def test_the_command_offers_exactly_the_load_generators_clients():
    from gpuloom.serve.loadgen import CLIENTS

    p = argparse.ArgumentParser()
    load_cmd.add_arguments(p)
    action = next(a for a in p._actions if a.dest == "client")
    assert tuple(action.choices) == CLIENTS


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
def test_a_request_without_an_answer_is_counted_by_the_same_name_whichever_client_sent_it(client):
    """aiohttp wraps socket errors in its own classes; the lean client raises them as they are. The
    load report names each failure the same way for both."""
    import asyncio
    import socket
    import struct

    import aiohttp

    from gpuloom.serve.loadgen import _Sender, failure_kind

    answers = {"garbage": b"HELLO THERE\r\n\r\n",
               "short body": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc",
               "short chunks": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc",
               "bad chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"}

    async def serve(behaviour):
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            if behaviour == "reset":  # an RST instead of a FIN
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                           struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            if behaviour in answers:
                writer.write(answers[behaviour])
                await writer.drain()
            elif behaviour == "silent":
                await asyncio.sleep(5)
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        return srv, srv.sockets[0].getsockname()[1]

    async def one(port):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
            sender = _Sender(client, s, f"http://127.0.0.1:{port}", "m", 0.5)
            sender.use([(b"{}", {"Content-Type": "application/json"})])
            try:
                code, _ = await sender.send(0)
            except Exception as e:  # noqa: BLE001 - what the load generator sees
                return failure_kind(e)
            finally:
                sender.close()
            return f"HTTP {code}"

    async def main():
        got = {}
        with socket.socket() as sock:  # a port nobody listens on
            sock.bind(("127.0.0.1", 0))
            dead = sock.getsockname()[1]
        got["dead"] = await one(dead)
        for behaviour in ("close", "reset", "silent", *answers):
            srv, port = await serve(behaviour)
            try:
                got[behaviour] = await one(port)
            finally:
                srv.close()
        return got

    got = asyncio.run(main())
    assert got == {"dead": "refused", "close": "disconnected", "reset": "disconnected", "silent": "timeout",
                   "garbage": "bad response", "short body": "disconnected", "short chunks": "disconnected",
                   "bad chunk": "bad response"}
    # asyncio's error when every address of a name (::1 and 127.0.0.1) refused the connection
    assert failure_kind(OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 8000, 0, 0), "
                                "[Errno 111] Connect call failed ('127.0.0.1', 8000)")) == "refused"
    assert failure_kind(OSError("Multiple exceptions: [Errno 111] a, [Errno 101] b")) == "OSError"
