"""The ``inference.GRPCInferenceService`` front end (grpc.aio), on the generated stubs tritonclient ships.

Implements ServerLive/Ready/Metadata, ModelReady/Metadata/Config/Statistics, ModelInfer (raw input
contents or typed ``contents``, not both; outputs returned as raw output contents, each requested
output once, as Triton does), ModelStreamInfer (the same requests on one bidirectional stream,
answered as each finishes; a failed request is answered with its ``error_message`` and the stream
goes on, as Triton does for models that are not decoupled) and the repository RPCs (a load with an
override config or files is INVALID_ARGUMENT, as over HTTP). Protocol errors map to gRPC codes: 400
-> INVALID_ARGUMENT, 404 -> NOT_FOUND, 429 -> RESOURCE_EXHAUSTED, 503 -> UNAVAILABLE, 504 ->
DEADLINE_EXCEEDED, 5xx -> INTERNAL. The shared-memory, trace and log RPCs answer UNIMPLEMENTED with
what to do instead.

Memory is bounded as over HTTP: the infer requests held at once (received, not yet answered) take at
most ``ServeCore.max_bodies_bytes`` (``--max-bodies-mb``); past it a request is refused
RESOURCE_EXHAUSTED (in a stream: answered with that error), booked ``bodies_in_flight``. A stream
reads its next request only while fewer than :data:`STREAM_WINDOW` of its requests are unanswered or
their answers unsent, so a client that does not read its answers stops being read (and gRPC's flow
control holds it back) instead of growing the server.

``add_servicer`` also registers the standard health service (``grpc.health.v1.Health/Check``, for
Kubernetes' gRPC probes and grpc_health_probe): SERVING while the server is ready.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math

import grpc
import numpy as np
from google.protobuf import json_format, wrappers_pb2
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from .core import EXTENSIONS, SERVER_NAME, ServeCore, model_config_json, model_metadata
from .protocol import (ProtocolError, deadline_ms_from_parameters, from_raw, is_refusal, numpy_dtype, refuse_classification,
                       refuse_load_overrides, reshape, v2_dtype)

log = logging.getLogger("gpuloom.serve.grpc")

__all__ = ["InferenceServicer", "add_servicer", "STREAM_WINDOW"]

#: most requests of one ModelStreamInfer stream unanswered or whose answers are unsent; the next is
#: read once one of them has been sent (800 x 1 MiB requests of a client that read no answers grew
#: the server by ~870 MB before this bound: a review, sixty-ninth session)
STREAM_WINDOW = 64

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# InferTensorContents field per numpy kind (typed, non-raw inputs)
_CONTENTS = {
    "bool": "bool_contents",
    "int8": "int_contents", "int16": "int_contents", "int32": "int_contents", "int64": "int64_contents",
    "uint8": "uint_contents", "uint16": "uint_contents", "uint32": "uint_contents", "uint64": "uint64_contents",
    "float32": "fp32_contents", "float64": "fp64_contents",
}


async def _abort(context, e: ProtocolError):
    code = _CODES.get(e.status, grpc.StatusCode.INTERNAL if e.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)
    await context.abort(code, str(e))


def _param_value(p: pb.InferParameter):
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


class InferenceServicer(pbg.GRPCInferenceServiceServicer):
    def __init__(self, core: ServeCore):
        self.core = core
        self.held_bytes = 0  # bytes of infer requests received and not yet answered (on the event loop only)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.core.service.is_live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.server_ready())

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.core.ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        from .. import __version__

        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        try:
            md = model_metadata(self.core.config(request.name, request.version))
        except ProtocolError as e:
            await _abort(context, e)
        return pb.ModelMetadataResponse(
            name=md["name"], versions=md["versions"], platform=md["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in md["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in md["outputs"]],
        )

    async def ModelConfig(self, request, context):
        try:
            cfg = model_config_json(self.core.config(request.name, request.version))
        except ProtocolError as e:
            await _abort(context, e)
        msg = mc.ModelConfig()
        json_format.ParseDict(cfg, msg, ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=msg)

    async def ModelStatistics(self, request, context):
        try:
            st = self.core.statistics(request.name or None, request.version or None)
        except ProtocolError as e:
            await _abort(context, e)
        for m in st["model_stats"]:
            m.pop("gpuloom", None)
        msg = pb.ModelStatisticsResponse()
        json_format.ParseDict(st, msg, ignore_unknown_fields=True)
        return msg

    async def RepositoryIndex(self, request, context):
        idx = await asyncio.to_thread(self.core.repository_index, ready_only=request.ready)  # (off the loop: a disk scan)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in idx])

    async def RepositoryModelLoad(self, request, context):
        try:
            refuse_load_overrides(request.parameters)
            await self.core.in_own_thread(self.core.load, request.model_name)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        try:
            await self.core.in_own_thread(self.core.unload, request.model_name)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):
        try:
            n = self._hold(request)
            try:
                return await self._infer(request, context)
            finally:
                self.held_bytes -= n
        except ProtocolError as e:
            await _abort(context, e)

    def _hold(self, request) -> int:
        """Count ``request``'s bytes as held until its answer is returned (the caller gives them back)
        and return them; a ProtocolError (429), booked as over HTTP, where they would take the bytes
        held past ``max_bodies_bytes`` (the first request always goes in, as over HTTP). Why: HTTP's
        bound did not apply to gRPC, whose requests were held without one (a review, sixty-ninth
        session). On the event loop's thread only: no lock."""
        n = request.ByteSize()
        if self.held_bytes and self.held_bytes + n > self.core.max_bodies_bytes:
            self.core.refused(request.model_name, request.model_version, 429)
            raise ProtocolError(f"the server is handling {self.held_bytes / 2**20:.1f} MiB of gRPC infer requests "
                                f"at once (limit {self.core.max_bodies_bytes / 2**20:.1f} MiB; gpuloom serve "
                                f"--max-bodies-mb): retry later", 429, retry_after_s=1.0)
        self.held_bytes += n
        return n

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream is submitted as it arrives (so the runtime batches them with
        everyone else's) and answered as it finishes, in that order; the client matches answers by
        ``id``. A request that fails is answered with its ``error_message``; the stream goes on. The
        stream ends once the client has closed its side and every request has been answered.

        At most :data:`STREAM_WINDOW` requests are unanswered or their answers unsent: the next one is
        read once an answer has been sent. A request's bytes count in ``held_bytes`` from its reading
        until its answer is sent, or until the stream ends, however it ends."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        answers: asyncio.Queue = asyncio.Queue()  # (answer, its request's bytes held), or None: reading ended
        pending: set[asyncio.Task] = set()
        held = 0  # this stream's part of self.held_bytes

        def answered(n: int, task: asyncio.Task) -> None:
            pending.discard(task)
            if not task.cancelled():
                answers.put_nowait((task.result(), n))

        async def read() -> None:
            nonlocal held
            try:
                await window.acquire()
                async for request in request_iterator:
                    try:
                        n = self._hold(request)
                    except ProtocolError as e:  # past the bytes bound: answered at once, the stream goes on
                        answers.put_nowait((_stream_error(request, str(e)), 0))
                    else:
                        held += n
                        task = asyncio.ensure_future(self._stream_answer(request, context))
                        pending.add(task)
                        task.add_done_callback(functools.partial(answered, n))
                    await window.acquire()  # the next request is read once an answer has been sent
            finally:  # the client closed its side (or reading failed: raised below, once the rest is answered)
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        closed = False
        try:
            while not (closed and not pending and answers.empty()):
                item = await answers.get()
                if item is None:
                    closed = True
                    continue
                msg, n = item
                yield msg
                held -= n
                self.held_bytes -= n
                window.release()
            await reader  # (done: it put the None) an error reading the stream is raised here
        finally:  # the client went away (or the server stops): nothing is left running for it
            reader.cancel()
            for task in list(pending):
                task.cancel()
            self.held_bytes -= held  # the requests unanswered, or whose answers were not sent

    async def _stream_answer(self, request, context) -> pb.ModelStreamInferResponse:
        try:
            return _final(request, pb.ModelStreamInferResponse(infer_response=await self._infer(request, context)))
        except ProtocolError as e:
            return _stream_error(request, str(e))
        except Exception as e:  # noqa: BLE001 - a bug of ours fails this request, not the stream
            log.exception("stream request %r of model %r failed", request.id, request.model_name)
            return _stream_error(request, f"internal error: {type(e).__name__}: {e}")

    async def _infer(self, request, context) -> pb.ModelInferResponse:
        """One ModelInfer request, answered; raises ProtocolError for a request that cannot be. One
        refused before it reaches the runtime (its tensors, parameters or outputs) is booked in
        ``gpuloom_request_rejected`` as over HTTP (``ServeCore.refused``); the runtime's refusals
        are booked by ``ServeCore.submit``."""
        try:
            # an unknown model or version is NOT_FOUND whatever the request holds, as over HTTP
            self.core.config(request.model_name, request.model_version)
            inputs = self._inputs(request)
            params = {k: _param_value(v) for k, v in request.parameters.items()}
            deadline = deadline_ms_from_parameters(params)  # Triton's 'timeout' (microseconds), as over HTTP
            for o in request.outputs:
                if "classification" in o.parameters:
                    refuse_classification(o.name, _param_value(o.parameters["classification"]))
            remaining = context.time_remaining()
            if remaining is not None:  # the client's gRPC deadline, seconds
                deadline = min(deadline or float("inf"), remaining * 1000.0)
            wanted = list(dict.fromkeys(o.name for o in request.outputs))  # each once, first-asked order, as over HTTP
            self.core.check_outputs(request.model_name, request.model_version, wanted or None)
        except ProtocolError as e:
            if is_refusal(e.status):
                self.core.refused(request.model_name, request.model_version, e.status)
            raise
        outputs = await self.core.infer(request.model_name, request.model_version, inputs, deadline)
        names = wanted or list(outputs)
        resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for n in names:
            arr = np.ascontiguousarray(outputs[n])
            resp.outputs.append(pb.ModelInferResponse.InferOutputTensor(name=n, datatype=v2_dtype(arr.dtype.name), shape=list(arr.shape)))
            resp.raw_output_contents.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        return resp

    @staticmethod
    def _inputs(request) -> dict[str, np.ndarray]:
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise ProtocolError(f"{len(request.inputs)} inputs but {len(raw)} raw_input_contents; expected one per input")
        out: dict[str, np.ndarray] = {}
        for i, t in enumerate(request.inputs):
            where = f"input {t.name!r}"
            if t.name in out:
                raise ProtocolError(f"{where} appears twice")
            if raw and t.HasField("contents"):  # (Triton refuses it too; the contents were dropped before)
                raise ProtocolError(f"{where}: contents must not be given when raw_input_contents are used")
            dtype = numpy_dtype(t.datatype)
            shape = tuple(int(d) for d in t.shape)
            if any(d < 0 for d in shape):
                raise ProtocolError(f"{where}: shape must be non-negative, found {list(shape)}")
            if raw:
                out[t.name] = from_raw(raw[i], dtype, shape, where)
            else:
                field = _CONTENTS.get(dtype.name)
                if field is None:
                    raise ProtocolError(f"{where}: {t.datatype} must be sent in raw_input_contents")
                vals = getattr(t.contents, field)
                n = math.prod(shape)
                if len(vals) != n:
                    raise ProtocolError(f"{where}: shape {list(shape)} needs {n} elements, contents has {len(vals)}")
                try:
                    arr = np.asarray(vals, dtype=dtype)
                except (OverflowError, ValueError, TypeError) as e:  # e.g. 300 in an INT8 tensor's int_contents
                    raise ProtocolError(f"{where}: contents are not all {t.datatype} values ({e})") from None
                out[t.name] = reshape(arr, shape, where)
        return out


def _stream_error(request, message: str) -> pb.ModelStreamInferResponse:
    """A stream's answer to ``request`` that failed with ``message`` (the stream goes on)."""
    return _final(request, pb.ModelStreamInferResponse(
        error_message=message, infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id)))


def _final(request, answer: pb.ModelStreamInferResponse) -> pb.ModelStreamInferResponse:
    """``answer`` marked ``triton_final_response`` where ``request`` asked for the flag
    (``triton_enable_empty_final_response``, tritonclient's ``enable_empty_final_response``), as
    Triton marks its stream answers: every model here answers a request once, so that answer is its
    last. Why: clients written for Triton's streams read answers until they see the flag (a review,
    sixty-ninth session: they waited for ever here)."""
    params = request.parameters
    if "triton_enable_empty_final_response" in params and params["triton_enable_empty_final_response"].bool_param:
        answer.infer_response.parameters["triton_final_response"].bool_param = True
    return answer


def _unsupported(rpc: str, why: str):
    async def answer(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: {why}")
    answer.__name__ = rpc
    return answer


_NO_SHM = ("gpuloom does not implement Triton's shared-memory extensions; send the tensors in the request "
           "(raw_input_contents)")
for _rpc in ("SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
             "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"):
    setattr(InferenceServicer, _rpc, _unsupported(_rpc, _NO_SHM))
InferenceServicer.TraceSetting = _unsupported(
    "TraceSetting", "gpuloom does not implement Triton's trace extension; its metrics are at /metrics (HTTP)")
InferenceServicer.LogSettings = _unsupported(
    "LogSettings",
    "gpuloom does not implement Triton's logging extension; the server logs to stderr (Python logging, INFO)")


# grpc.health.v1 (the standard health service), without its package: its messages have the wire
# format of protobuf's wrappers, HealthCheckRequest {string service = 1} a StringValue and
# HealthCheckResponse {ServingStatus status = 1} (an enum: a varint) an Int32Value
HEALTH_SERVICE = "grpc.health.v1.Health"
_SERVING, _NOT_SERVING = 1, 2  # HealthCheckResponse.ServingStatus
_HEALTH_NAMES = ("", "inference.GRPCInferenceService")  # the whole server; the inference service


def _health_handler(core: ServeCore) -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health``: Check answers SERVING while ``core.server_ready()`` (NOT_SERVING
    otherwise) for the server ("") and for ``inference.GRPCInferenceService``, NOT_FOUND for any
    other service; Watch is UNIMPLEMENTED (probes use Check). Why: Kubernetes' gRPC probes and
    grpc_health_probe call Check, which was UNIMPLEMENTED (a review, sixty-ninth session)."""

    async def check(service: str, context) -> int:
        if service not in _HEALTH_NAMES:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown service {service!r}; this server answers for {list(_HEALTH_NAMES)}")
        return _SERVING if core.server_ready() else _NOT_SERVING

    async def watch(service: str, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{HEALTH_SERVICE}/Watch is not implemented; call {HEALTH_SERVICE}/Check")

    def parse(data: bytes) -> str:
        return wrappers_pb2.StringValue.FromString(data).value

    def serialize(status: int) -> bytes:
        return wrappers_pb2.Int32Value(value=status).SerializeToString()

    return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(check, request_deserializer=parse, response_serializer=serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, request_deserializer=parse, response_serializer=serialize),
    })


def add_servicer(server: grpc.aio.Server, core: ServeCore) -> None:
    """Register the inference service and the standard health service on ``server``."""
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(core), server)
    server.add_generic_rpc_handlers((_health_handler(core),))
