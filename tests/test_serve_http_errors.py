"""A request body the server cannot read is one 400 that says why, and no traceback in its log."""

from __future__ import annotations

import http.client
import json
import logging
import warnings

import pytest

pytest.importorskip("torch")


@pytest.fixture
def server():
    from gpuloom.runtime.service import InferenceService
    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository
    from gpuloom.serve.server import Server

    svc = InferenceService(device="cpu")
    svc.start()
    core = ServeCore(svc, load_repository("examples/repository/tiny_mlp.yaml"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a crude profile
        core.load("tiny_mlp")
    srv = Server(core, http_port=0, grpc_port=None)
    addr = srv.start()
    yield addr
    srv.stop()


def test_a_body_that_is_not_the_gzip_it_says_is_a_400_naming_the_encoding_without_a_traceback(server, caplog):
    caplog.set_level(logging.DEBUG)
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("POST", "/v2/models/tiny_mlp/infer", body=b"\x1f\x8b\x08\x00not gzip at all",
              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    r = c.getresponse()
    body = json.loads(r.read())
    assert r.status == 400 and body["error"] == "request body could not be read: Can not decode content-encoding: gzip"
    # the server goes on: a good request on a new connection is served
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("POST", "/v2/models/tiny_mlp/infer", body=json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}),
        headers={"Content-Type": "application/json"})
    assert c.getresponse().status == 200
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks]
