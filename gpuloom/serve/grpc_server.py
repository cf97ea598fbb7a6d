"""The ``inference.GRPCInferenceService`` front end (grpc.aio), on the generated stubs tritonclient ships.

Implements ServerLive/Ready/Metadata, ModelReady/Metadata/Config/Statistics, ModelInfer (raw input
contents or typed ``contents``; outputs returned as raw output contents, as Triton does),
ModelStreamInfer (the same requests on one bidirectional stream, answered as each finishes; a failed
request is answered with its ``error_message`` and the stream goes on, as Triton does for models that
are not decoupled) and the repository RPCs. Protocol errors map to gRPC codes: 400 ->
INVALID_ARGUMENT, 404 -> NOT_FOUND, 429 -> RESOURCE_EXHAUSTED, 503 -> UNAVAILABLE, 504 ->
DEADLINE_EXCEEDED, 5xx -> INTERNAL. The shared-memory, trace and log RPCs answer UNIMPLEMENTED with
what to do instead.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from .core import EXTENSIONS, SERVER_NAME, ServeCore, model_config_json, model_metadata
from .protocol import ProtocolError, deadline_ms_from_parameters, from_raw, numpy_dtype, refuse_classification, v2_dtype

log = logging.getLogger("gpuloom.serve.grpc")

__all__ = ["InferenceServicer", "add_servicer"]

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
        idx = self.core.repository_index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in idx])

    async def RepositoryModelLoad(self, request, context):
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.core.load, request.model_name)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.core.unload, request.model_name)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context)
        except ProtocolError as e:
            await _abort(context, e)

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream is submitted as it arrives (so the runtime batches them with
        everyone else's) and answered as it finishes, in that order; the client matches answers by
        ``id``. A request that fails is answered with its ``error_message``; the stream goes on. The
        stream ends once the client has closed its side and every request has been answered."""
        answers: asyncio.Queue = asyncio.Queue()
        pending: set[asyncio.Task] = set()

        def answered(task: asyncio.Task) -> None:
            pending.discard(task)
            if not task.cancelled():
                answers.put_nowait(task.result())

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._stream_answer(request, context))
                    pending.add(task)
                    task.add_done_callback(answered)
            finally:  # the client closed its side (or reading failed: raised below, once the rest is answered)
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        closed = False
        try:
            while not (closed and not pending and answers.empty()):
                msg = await answers.get()
                if msg is None:
                    closed = True
                else:
                    yield msg
            await reader  # (done: it put the None) an error reading the stream is raised here
        finally:  # the client went away (or the server stops): nothing is left running for it
            reader.cancel()
            for task in list(pending):
                task.cancel()

    async def _stream_answer(self, request, context) -> pb.ModelStreamInferResponse:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request, context))
        except ProtocolError as e:
            return pb.ModelStreamInferResponse(
                error_message=str(e),
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id))
        except Exception as e:  # noqa: BLE001 - a bug of ours fails this request, not the stream
            log.exception("stream request %r of model %r failed", request.id, request.model_name)
            return pb.ModelStreamInferResponse(
                error_message=f"internal error: {type(e).__name__}: {e}",
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id))

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
            self.core.check_outputs(request.model_name, request.model_version,
                                    [o.name for o in request.outputs] or None)
        except ProtocolError as e:
            if 400 <= e.status < 500:
                self.core.refused(request.model_name, request.model_version, e.status)
            raise
        outputs = await self.core.infer(request.model_name, request.model_version, inputs, deadline)
        names = [o.name for o in request.outputs] or list(outputs)
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
                    out[t.name] = np.asarray(vals, dtype=dtype).reshape(shape)
                except (OverflowError, ValueError, TypeError) as e:  # e.g. 300 in an INT8 tensor's int_contents
                    raise ProtocolError(f"{where}: contents are not all {t.datatype} values ({e})") from None
        return out


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


def add_servicer(server: grpc.aio.Server, core: ServeCore) -> None:
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(core), server)
