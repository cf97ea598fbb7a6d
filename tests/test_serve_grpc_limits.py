"""The gRPC front end's bounds and answers that a review found missing or unlike HTTP's (sixty-ninth
session): a stream's window of unanswered requests, the bound on request bytes held at once, load
overrides, shapes numpy cannot make, raw and typed contents together, duplicated outputs, the
advertised extensions and the standard health service."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torch")
tritongrpc = pytest.importorskip("tritonclient.grpc")

import serve_fake  # noqa: E402

import grpc  # noqa: E402  (tritonclient.grpc brings it)
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as pbg  # noqa: E402

from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.grpc_server import STREAM_WINDOW, InferenceServicer  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"
SLOW_S = 0.25  # how long the "slow" model holds each request (long enough to send another meanwhile)
HUGE = [0, 2 ** 62]  # no elements, so no data to send; numpy cannot make the shape ("array is too big")


@pytest.fixture(scope="module")
def served():
    """A server on loopback (HTTP in process, gRPC) serving ``serve_fake.slow_net`` ("slow": 2x its
    [b, 4] input, SLOW_S per batch), with tiny_mlp in its repository, not loaded: (core, address)."""
    service = serve_fake.make_service()
    core = ServeCore(service, load_repository(REPO / "tiny_mlp.yaml"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a crude profile
        service.load(*serve_fake.slow_net(SLOW_S))
    server = Server(core, http_port=0, grpc_port=0)
    addr = server.start()
    yield core, addr
    server.stop()


def _stub(addr):
    return pbg.GRPCInferenceServiceStub(grpc.insecure_channel(addr.grpc_url))


def _request(rid: str = "", v: float = 1.0, model: str = "slow") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id=rid)
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(np.full((1, 4), v, np.float32).tobytes())
    return req


def _rejected(core) -> dict[tuple[str, str], int]:
    return {(m, r): n for m, b in core.books.snapshot().items() for r, n in b.rejected.items()}


def _new(before: dict, after: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def _wait_accepted(core, n: int, timeout_s: float = 10.0) -> None:
    """Until the server has accepted ``n`` requests of "slow" in all."""
    end = time.monotonic() + timeout_s
    while core.books.snapshot().get("slow") is None or core.books.snapshot()["slow"].accepted < n:
        assert time.monotonic() < end, "the server did not accept the request"
        time.sleep(0.002)


def _accepted(core) -> int:
    b = core.books.snapshot().get("slow")
    return b.accepted if b is not None else 0


def _post(addr, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    c = http.client.HTTPConnection(addr.host, addr.http_port, timeout=30)
    c.request("POST", path, body=body, headers=headers)
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    return r.status, data


# -- a stream's window (servicer alone, on a fake core) ------------------------------------------------
class _Core:
    """Stands in for ServeCore: every model is known; answers each request with its input doubled after
    ``delay_s`` times its first value; counts the infers running."""

    max_bodies_bytes = 1 << 30

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.running = 0

    def config(self, name, version=None):
        pass

    def check_outputs(self, *a):
        pass

    def refused(self, *a):
        raise AssertionError(f"nothing is refused here: {a}")

    async def infer(self, name, version, inputs, deadline):
        self.running += 1
        try:
            await asyncio.sleep(self.delay_s * float(inputs["x"].flat[0]))
        finally:
            self.running -= 1
        return {"y": inputs["x"] * 2}


class _Context:
    def time_remaining(self):
        return None


def test_a_grpc_stream_whose_client_reads_no_answers_is_read_no_further_than_its_window():
    """Before, the stream read and submitted every request its client sent, answered or not: a client
    that streamed 800 x 1 MiB and read no answers grew the server by ~870 MB. Now at most
    STREAM_WINDOW requests are unanswered or their answers unsent; the rest wait in the client (gRPC's
    flow control), and are read and answered once the client reads on."""
    total = STREAM_WINDOW * 4

    async def run():
        pulled = 0

        async def requests():
            nonlocal pulled
            for i in range(total):
                pulled += 1
                yield _request(str(i), float(i))

        servicer = InferenceServicer(_Core())
        answers = servicer.ModelStreamInfer(requests(), _Context())
        first = await answers.__anext__()
        await asyncio.sleep(0.2)  # the client reads no further answers meanwhile
        stalled = pulled, servicer.held_bytes
        rest = [m async for m in answers]
        return [first, *rest], stalled, servicer.held_bytes

    got, (pulled, held), held_after = asyncio.run(asyncio.wait_for(run(), 10))
    assert pulled == STREAM_WINDOW and held == sum(_request(str(i), float(i)).ByteSize() for i in range(pulled))
    assert sorted(int(m.infer_response.id) for m in got) == list(range(total)) and held_after == 0
    assert all(not m.error_message for m in got)
    for m in got:
        assert np.frombuffer(m.infer_response.raw_output_contents[0], np.float32)[0] == 2 * int(m.infer_response.id)


@pytest.mark.parametrize("end", ["client gone", "server stops", "reading fails", "client closes"])
def test_a_grpc_stream_gives_back_every_byte_and_leaves_nothing_running_however_it_ends(end):
    """Whatever ends the stream (the client cancels at an answer, the server stops while it waits,
    the client's stream breaks, or it closes normally), the bytes it held are given back and no
    request of it is left running, without a hang."""
    core = _Core(delay_s=0.02)  # request i is answered after 20, 40, 60 or 80 ms

    async def run():
        async def requests():
            for i in range(STREAM_WINDOW + 10):  # more than the window: some wait unread
                yield _request(str(i), float(1 + i % 4))
            if end == "reading fails":
                raise ConnectionResetError("the client's stream broke")
            if end != "client closes":
                await asyncio.Event().wait()  # the client keeps its side open

        servicer = InferenceServicer(core)
        answers = servicer.ModelStreamInfer(requests(), _Context())
        if end == "client gone":
            await answers.__anext__()
            assert servicer.held_bytes > 0 and core.running > 0
            await answers.aclose()  # (what grpc does to the handler of a call its client cancelled)
        elif end == "server stops":
            consume = asyncio.ensure_future(answers.__anext__())
            await asyncio.sleep(0.005)  # (before the first answer)
            assert servicer.held_bytes > 0 and core.running > 0
            consume.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consume
        else:
            with pytest.raises(ConnectionResetError) if end == "reading fails" else contextlib.nullcontext():
                async for _ in answers:
                    pass
        await asyncio.sleep(0.01)  # (cancelled infers finish unwinding)
        return servicer.held_bytes, core.running

    assert asyncio.run(asyncio.wait_for(run(), 10)) == (0, 0)


# -- bytes held at once (a served "slow" model) -----------------------------------------------------------
def test_a_grpc_infer_past_the_bytes_held_bound_is_resource_exhausted_and_booked(served, monkeypatch):
    """Before, gRPC ignored ``max_bodies_bytes`` (200 concurrent 1 MiB requests on an 8 MiB bound were
    all held); now, as over HTTP, a request that would take the bytes held past it is refused (the
    first always goes in), booked ``bodies_in_flight``, and the bytes are given back once answered."""
    core, addr = served
    req = _request()
    monkeypatch.setattr(core, "max_bodies_bytes", int(req.ByteSize() * 1.5))  # one request, not two
    stub = _stub(addr)
    before, accepted = _rejected(core), _accepted(core)
    held = stub.ModelInfer.future(req, timeout=30)
    _wait_accepted(core, accepted + 1)
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert "at once (limit" in e.value.details() and "gpuloom serve --max-bodies-mb" in e.value.details()
    assert _new(before, _rejected(core)) == {("slow", "bodies_in_flight"): 1}
    assert len(held.result(30).raw_output_contents) == 1
    assert len(stub.ModelInfer(req, timeout=30).raw_output_contents) == 1  # given back: the next goes in


def test_a_grpc_stream_request_past_the_bytes_held_bound_is_answered_with_the_error_and_the_stream_goes_on(
        served, monkeypatch):
    core, addr = served
    monkeypatch.setattr(core, "max_bodies_bytes", int(_request().ByteSize() * 1.5))
    first_answered = threading.Event()
    accepted = _accepted(core)

    def requests():
        yield _request("1")
        _wait_accepted(core, accepted + 1)  # held by the server
        yield _request("2")  # refused at once
        first_answered.wait(30)
        yield _request("3")  # goes in: the first's bytes were given back

    before = _rejected(core)
    got = []
    for msg in _stub(addr).ModelStreamInfer(requests(), timeout=30):
        got.append((msg.infer_response.id, msg.error_message))
        if msg.infer_response.id == "1":
            first_answered.set()
    assert [i for i, _ in got] == ["2", "1", "3"], got
    assert "gpuloom serve --max-bodies-mb" in got[0][1] and not got[1][1] and not got[2][1]
    assert _new(before, _rejected(core)) == {("slow", "bodies_in_flight"): 1}


# -- answers like HTTP's --------------------------------------------------------------------------------------
def test_a_grpc_load_with_an_override_config_or_files_is_invalid_argument_as_over_http(served):
    """Before, RepositoryModelLoad ignored the overrides and (re)loaded the model silently."""
    core, addr = served
    stub = _stub(addr)
    says = "loading with an override config or files is not supported; edit the repository"
    for params in ({"config": pb.ModelRepositoryParameter(string_param='{"max_batch_size": 2}')},
                   {"file:1/model.pt": pb.ModelRepositoryParameter(bytes_param=b"xx")}):
        with pytest.raises(grpc.RpcError) as e:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="tiny_mlp", parameters=params),
                                     timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == says, e.value
    assert core.service.config("tiny_mlp") is None  # nothing was loaded
    status, body = _post(addr, "/v2/repository/models/tiny_mlp/load",
                         json.dumps({"parameters": {"config": "{}"}}).encode(), {"Content-Type": "application/json"})
    assert (status, body) == (400, {"error": says})


def test_a_shape_numpy_cannot_make_is_a_400_naming_input_and_shape_over_grpc_and_http(served):
    """``[0, 2**62]`` needs no data, so it passed the size checks, and numpy's reshape raised "array is
    too big": UNKNOWN over gRPC and 500 over HTTP, booked nowhere. Now 400 / INVALID_ARGUMENT, booked as
    an invalid request, for raw and typed gRPC contents, HTTP binary data and JSON."""
    core, addr = served
    stub = _stub(addr)
    says = f"input 'x': shape {HUGE} is too large for an array"
    raw = pb.ModelInferRequest(model_name="slow", raw_input_contents=[b""])
    raw.inputs.add(name="x", datatype="FP32", shape=HUGE)
    typed = pb.ModelInferRequest(model_name="slow")
    typed.inputs.add(name="x", datatype="FP32", shape=HUGE)
    for req in (raw, typed):
        before = _rejected(core)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details(), e.value
        assert _new(before, _rejected(core)) == {("slow", "invalid_request"): 1}
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": HUGE,
                                   "parameters": {"binary_data_size": 0}}]}).encode()
    as_json = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": HUGE, "data": []}]}).encode()
    for body, headers in ((head, {"Inference-Header-Content-Length": str(len(head))}), (as_json, {})):
        before = _rejected(core)
        status, answer = _post(addr, "/v2/models/slow/infer", body, {"Content-Type": "application/json", **headers})
        assert status == 400 and says in answer["error"], (status, answer)
        assert _new(before, _rejected(core)) == {("slow", "invalid_request"): 1}


def test_grpc_raw_and_typed_contents_together_are_invalid_argument(served):
    """Before, the typed contents were dropped silently and the raw ones served."""
    core, addr = served
    req = _request()
    req.inputs[0].contents.fp32_contents.extend([9.0] * 4)
    before = _rejected(core)
    with pytest.raises(grpc.RpcError) as e:
        _stub(addr).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "input 'x': contents must not be given when raw_input_contents are used"
    assert _new(before, _rejected(core)) == {("slow", "invalid_request"): 1}


def test_a_grpc_output_requested_twice_is_returned_once_as_over_http(served):
    _, addr = served
    req = _request(v=3.0)
    req.outputs.add(name="y")
    req.outputs.add(name="y")
    resp = _stub(addr).ModelInfer(req, timeout=30)
    assert [o.name for o in resp.outputs] == ["y"] and len(resp.raw_output_contents) == 1
    assert np.frombuffer(resp.raw_output_contents[0], np.float32).tolist() == [6.0] * 4
    status, body = _post(addr, "/v2/models/slow/infer", json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [3.0] * 4}],
        "outputs": [{"name": "y"}, {"name": "y"}]}).encode(), {"Content-Type": "application/json"})
    assert status == 200 and [o["name"] for o in body["outputs"]] == ["y"]


def test_server_metadata_lists_only_the_extensions_implemented(served):
    """``schedule_policy`` was listed though the ``priority`` parameter it defines is ignored;
    ``model_configuration`` was missing though ModelConfig (and GET .../config) is served."""
    _, addr = served
    listed = list(_stub(addr).ServerMetadata(pb.ServerMetadataRequest(), timeout=30).extensions)
    assert listed == ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]


# -- grpc.health.v1 -------------------------------------------------------------------------------------------
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"  # HealthCheckResponse{status: SERVING / NOT_SERVING}


def _health_request(service: str) -> bytes:
    """HealthCheckRequest{service} on the wire (``string service = 1``)."""
    name = service.encode()
    return b"\x0a" + bytes([len(name)]) + name if name else b""


def test_the_standard_grpc_health_check_answers_serving_while_ready_and_not_found_for_other_services(
        served, monkeypatch):
    """Kubernetes' gRPC probes call grpc.health.v1.Health/Check, which was UNIMPLEMENTED."""
    core, addr = served
    channel = grpc.insecure_channel(addr.grpc_url)
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    for service in ("", "inference.GRPCInferenceService"):
        assert check(_health_request(service), timeout=10) == SERVING, service
    monkeypatch.setattr(core, "server_ready", lambda: False)
    for service in ("", "inference.GRPCInferenceService"):
        assert check(_health_request(service), timeout=10) == NOT_SERVING, service
    with pytest.raises(grpc.RpcError) as e:
        check(_health_request("nope"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        list(watch(_health_request(""), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Health/Check" in e.value.details()


def test_a_stream_answer_says_it_is_final_where_the_client_asks_as_triton_does(served):
    """tritonclient's ``enable_empty_final_response``: clients read until ``triton_final_response``."""
    _, addr = served
    client = tritongrpc.InferenceServerClient(addr.grpc_url)
    got: list = []
    answered = threading.Semaphore(0)

    def callback(result, error):
        got.append((result, error))
        answered.release()

    x = tritongrpc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    client.start_stream(callback=callback)
    try:  # one at a time (dstack's admission sheds a second sent at once to this slow model)
        client.async_stream_infer("slow", [x], request_id="asked", enable_empty_final_response=True)
        assert answered.acquire(timeout=30)
        client.async_stream_infer("slow", [x], request_id="not asked")
        assert answered.acquire(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    answers = {r.get_response().id: r.get_response() for r, e in got if e is None}
    assert set(answers) == {"asked", "not asked"}, got
    assert answers["asked"].parameters["triton_final_response"].bool_param is True
    np.testing.assert_array_equal(np.frombuffer(answers["asked"].raw_output_contents[0], np.float32), [2.0] * 4)
    assert "triton_final_response" not in answers["not asked"].parameters
