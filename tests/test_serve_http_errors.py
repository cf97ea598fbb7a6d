"""A request body the server cannot read is one 400 that says why, and no traceback in its log."""

from __future__ import annotations

import http.client
import json
import logging
import warnings

import pytest

pytest.importorskip("torch")


@pytest.fixture(params=[0, 2], ids=["in-process-http", "2-http-workers"])
def server(request):
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
    srv = Server(core, http_port=0, grpc_port=None, http_workers=request.param)
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


def test_an_unknown_model_or_version_is_a_404_even_with_a_malformed_body(server):
    for path, body in (("/v2/models/nope/infer", b"{not json"), ("/v2/models/tiny_mlp/versions/7/infer", b"{")):
        c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 404, (path, r.status, r.read())
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("POST", "/v2/models/tiny_mlp/infer", body=b"{not json", headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and "not valid JSON" in r.read().decode()


def test_statistics_say_when_the_model_last_took_a_request(server):
    import time

    before = time.time_ns() // 1_000_000
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("POST", "/v2/models/tiny_mlp/infer", body=json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}),
        headers={"Content-Type": "application/json"})
    assert c.getresponse().status == 200
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("GET", "/v2/models/tiny_mlp/stats")
    st = json.loads(c.getresponse().read())["model_stats"][0]
    assert before <= int(st["last_inference"]) <= time.time_ns() // 1_000_000, st


def test_metadata_and_config_name_one_platform(server):
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request("GET", "/v2/models/tiny_mlp")
    md = json.loads(c.getresponse().read())
    c.request("GET", "/v2/models/tiny_mlp/config")
    cfg = json.loads(c.getresponse().read())
    assert md["platform"] == cfg["platform"] == "pytorch_libtorch" and cfg["backend"] == "gpuloom"
