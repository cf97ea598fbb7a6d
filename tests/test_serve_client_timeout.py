"""Connections whose client keeps the server waiting are closed (gpuloom.serve.client_timeout);
a request the server is computing is never cut, however long it takes."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402

pytest.importorskip("aiohttp")
from gpuloom.serve.client_timeout import ClientTimeouts  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402


# -- the rule, on stand-ins -------------------------------------------------------------------
class _Transport:
    def __init__(self):
        self.closed = False

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


class _Handler:  # aiohttp's RequestHandler, as far as the sweep looks at it
    def __init__(self):
        self.transport = _Transport()


class _Request:
    def __init__(self, handler, body_in: bool):
        self.protocol = handler
        self._eof = body_in
        self.content = self

    def is_eof(self):
        return self._eof


def test_the_sweep_closes_silent_and_stalled_clients_and_never_a_request_being_computed():
    guard = ClientTimeouts(10.0)
    silent, stalled, computing, idle = _Handler(), _Handler(), _Handler(), _Handler()
    handlers = [silent, stalled, computing, idle]
    assert guard.sweep(handlers, now=0.0) == 0  # first seen now
    guard.begin(_Request(stalled, body_in=False), 1.0)  # headers in, body still coming (as the middleware)
    guard.begin(_Request(computing, body_in=True), 1.0)  # whole body in: the server computes
    guard._connection(idle, 0.0).answered = 1  # answered once, idle since: aiohttp's keep-alive timer
    assert guard.sweep(handlers, now=9.0) == 0  # nobody overdue yet
    assert guard.sweep(handlers, now=10.5) == 1 and silent.transport.closed  # no headers 10.5 s after
    assert not stalled.transport.closed  # its headers came at 1.0: 9.5 s
    assert guard.sweep(handlers, now=11.5) == 1 and stalled.transport.closed
    assert guard.sweep(handlers, now=1000.0) == 0  # the computing request and the idle one stay
    assert not computing.transport.closed and not idle.transport.closed
    assert guard.closed == {"headers": 1, "body": 1}
    assert guard.sweep([computing], now=1000.0) == 0 and set(guard._conns) == {id(computing)}  # the gone forgotten
    with pytest.raises(ValueError, match="seconds > 0"):
        ClientTimeouts(0)


# -- a real server ----------------------------------------------------------------------------
def _wait_closed(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``limit_s``)."""
    sock.settimeout(limit_s)
    t0 = time.monotonic()
    try:
        data = sock.recv(4096)
    except socket.timeout:
        return None
    except ConnectionResetError:
        return time.monotonic() - t0
    assert data == b"", data  # closed without an answer
    return time.monotonic() - t0


@pytest.fixture(scope="module", params=serve_fake.SERVER_VARIANTS, ids=serve_fake.SERVER_VARIANT_IDS)
def slow_served(request):
    """A server with a 0.3 s client timeout, serving a model that takes 1 s per batch."""
    service = serve_fake.make_service()
    core = ServeCore(service)
    cfg, module = serve_fake.slow_net(1.0)
    service.load(cfg, module)
    server = Server(core, http_port=0, grpc_port=None, client_timeout_s=0.3, **serve_fake.server_variant(request.param))
    addr = server.start()
    yield addr
    server.stop()


@pytest.mark.parametrize("sent", [
    b"",  # connected, sent nothing
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n",  # headers never finished
    b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"inputs\": [",  # body stalls
], ids=["silent", "partial-headers", "partial-body"])
def test_a_client_that_keeps_the_server_waiting_is_disconnected(slow_served, sent):
    addr = slow_served
    sock = socket.create_connection((addr.host, addr.http_port))
    try:
        if sent:
            sock.sendall(sent)
        took = _wait_closed(sock, 10.0)
    finally:
        sock.close()
    assert took is not None and took < 5.0, took  # 0.3 s, swept every 0.075 s (a worker may add its hop)


def test_a_request_computed_longer_than_the_timeout_is_answered_and_an_idle_one_is_closed_after(slow_served):
    addr = slow_served
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]})
    conn = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/v2/models/slow/infer", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        answer = json.loads(r.read())
        assert r.status == 200 and time.monotonic() - t0 >= 0.95  # 1 s of compute, 3x the client timeout
        assert np.allclose(answer["outputs"][0]["data"], [2.0, 4.0, 6.0, 8.0])
        assert _wait_closed(conn.sock, 10.0) is not None  # then idle: closed (aiohttp's keep-alive timer)
    finally:
        conn.close()
    status = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
    status.request("GET", "/v2/health/ready")  # and the server serves on
    assert status.getresponse().status == 200
    status.close()
