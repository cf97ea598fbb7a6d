"""KServe v2 / Open Inference Protocol tensors, as Triton speaks them (JSON and binary data).

Pure numpy: parses an HTTP infer body (JSON tensors, or Triton's binary tensor data extension with
``Inference-Header-Content-Length``) into ``{name: ndarray}``, checks it against a model's input specs,
and encodes result arrays back (JSON ``data`` or binary, per output). Every user mistake raises
:class:`ProtocolError` carrying the HTTP status (4xx) and a message saying what was expected and found.

The gRPC server reuses :func:`check_inputs`, :func:`from_raw`, :func:`reshape`, :func:`refuse_load_overrides`
and the dtype tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = [
    "ProtocolError",
    "InferRequest",
    "V2_TO_NUMPY",
    "NUMPY_TO_V2",
    "v2_dtype",
    "numpy_dtype",
    "parse_infer_body",
    "check_inputs",
    "from_raw",
    "reshape",
    "refuse_load_overrides",
    "is_refusal",
    "encode_infer_response",
    "deadline_ms_from_parameters",
    "server_timing",
    "parse_server_timing",
]

# KServe v2 datatype names <-> numpy dtype names. BYTES (variable-length strings) is not served:
# gpuloom models take numeric tensors only.
V2_TO_NUMPY: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
NUMPY_TO_V2: dict[str, str] = {v: k for k, v in V2_TO_NUMPY.items()}


class ProtocolError(ValueError):
    """A request the protocol layer refuses; ``status`` is the HTTP status code to answer (4xx/5xx)."""

    def __init__(self, message: str, status: int = 400, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


def v2_dtype(numpy_name: str) -> str:
    """``"float32"`` -> ``"FP32"``; ValueError for a dtype the protocol has no name for."""
    try:
        return NUMPY_TO_V2[np.dtype(numpy_name).name]
    except (KeyError, TypeError) as e:
        raise ValueError(f"dtype {numpy_name!r} has no KServe v2 name; expected one of {sorted(NUMPY_TO_V2)}") from e


def numpy_dtype(v2_name: Any) -> np.dtype:
    """``"FP32"`` -> ``np.dtype('float32')``; ProtocolError (400) for anything else."""
    if not isinstance(v2_name, str) or v2_name not in V2_TO_NUMPY:
        raise ProtocolError(f"unsupported datatype {v2_name!r}; expected one of {sorted(V2_TO_NUMPY)}")
    return np.dtype(V2_TO_NUMPY[v2_name])


@dataclass
class InferRequest:
    """A parsed infer request: tensors by name plus what the client asked of the response."""

    inputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # requested outputs: name -> wants binary (None: all outputs, binary per ``binary_data_output``)
    outputs: dict[str, bool] | None = None


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise ProtocolError(f"{where}: 'shape' must be a list of non-negative integers, found {value!r}")
    return tuple(value)


def _flatten(data: Any) -> list:
    """Nested JSON lists -> one flat list (the protocol allows both row-major flat and nested)."""
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [iter(data)]
    while stack:
        try:
            item = next(stack[-1])
        except StopIteration:
            stack.pop()
            continue
        if isinstance(item, list):
            stack.append(iter(item))
        else:
            out.append(item)
    return out


_JSON_TYPES = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}  # JSON values a tensor of each kind takes


def _json_tensor(t: Mapping[str, Any], dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    flat = _flatten(t["data"])
    n = math.prod(shape)
    if len(flat) != n:
        raise ProtocolError(f"{where}: shape {list(shape)} needs {n} elements, 'data' has {len(flat)}")
    allowed = _JSON_TYPES[dtype.kind]
    found = set(map(type, flat))  # every element's type (numpy would take null as NaN, "2.5" as 2.5, true as 1)
    if not found <= allowed:
        x = next(x for x in flat if type(x) not in allowed)
        raise ProtocolError(f"{where}: element {x!r} is not a valid {NUMPY_TO_V2[dtype.name]} value")
    try:
        arr = np.asarray(flat, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"{where}: 'data' is not all {NUMPY_TO_V2[dtype.name]} values ({e})") from None
    return reshape(arr, shape, where)


def reshape(arr: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """``arr.reshape(shape)``; a ProtocolError (400) naming the input and shape where numpy cannot
    make that shape. Why: a shape with a zero and a huge dimension (``[0, 2**62]``) needs no data,
    so it passes the size checks, and numpy's ValueError ("array is too big") was answered as an
    internal error (500 over HTTP, UNKNOWN over gRPC) and booked nowhere (a review, sixty-ninth
    session)."""
    try:
        return arr.reshape(shape)
    except (ValueError, OverflowError) as e:
        raise ProtocolError(f"{where}: shape {list(shape)} is too large for an array ({e})") from None


def from_raw(raw: bytes | memoryview, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Raw little-endian row-major bytes -> array; ProtocolError on a size mismatch.

    A view of ``raw`` on a little-endian host (no copy: the runtime copies each row when it
    stages it, and a 600 KB image tensor copied once more per request cost the event loop), else a
    byte-swapped copy."""
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise ProtocolError(
            f"{where}: shape {list(shape)} of {NUMPY_TO_V2.get(dtype.name, dtype.name)} needs {need} bytes, found {len(raw)}"
        )
    arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    if arr.dtype != dtype:  # a big-endian host
        arr = arr.astype(dtype)
    return reshape(arr, shape, where)


def load_json(text: bytes | bytearray | str) -> Any:
    """A request body's JSON; a ProtocolError (400) that says why where it is none (a body nested
    100,000 deep is a RecursionError in ``json.loads``: a 500 before the sixty-fourth session)."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("request body is not valid JSON: nested too deeply") from None


def parse_infer_body(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """Parse an HTTP ``/infer`` body; ``header_length`` is the ``Inference-Header-Content-Length`` header.

    With the header, the first ``header_length`` bytes are the JSON request and the rest are the inputs'
    binary data, in input order, each ``parameters.binary_data_size`` long.
    """
    if header_length is not None:
        try:
            hlen = int(header_length)
        except ValueError:
            raise ProtocolError(f"Inference-Header-Content-Length must be an integer, found {header_length!r}") from None
        if not 0 <= hlen <= len(body):
            raise ProtocolError(f"Inference-Header-Content-Length {hlen} is outside the body of {len(body)} bytes")
        head, binary = body[:hlen], memoryview(body)[hlen:]
    else:
        head, binary = body, memoryview(b"")
    req = load_json(head)
    if not isinstance(req, dict):
        raise ProtocolError(f"request must be a JSON object with 'inputs', found {type(req).__name__}")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError("'parameters' must be an object")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(f"'id' must be a string, found {rid!r}")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("request needs 'inputs': a non-empty list of tensors {name, shape, datatype, data}")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ProtocolError(f"inputs[{i}] must be an object with a string 'name'")
        name = t["name"]
        where = f"input {name!r}"
        if name in tensors:
            raise ProtocolError(f"{where} appears twice")
        dtype = numpy_dtype(t.get("datatype"))
        shape = _shape(t.get("shape"), where)
        tp = t.get("parameters") or {}
        if not isinstance(tp, dict):
            raise ProtocolError(f"{where}: 'parameters' must be an object")
        size = tp.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(f"{where}: binary_data_size must be a non-negative integer, found {size!r}")
            if offset + size > len(binary):
                raise ProtocolError(
                    f"{where}: binary_data_size {size} at offset {offset} runs past the {len(binary)} bytes of binary data"
                )
            tensors[name] = from_raw(binary[offset : offset + size], dtype, shape, where)
            offset += size
        elif "data" in t:
            tensors[name] = _json_tensor(t, dtype, shape, where)
        else:
            raise ProtocolError(f"{where} has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data were not claimed by any input's binary_data_size")
    outputs = None
    default_binary = bool(params.get("binary_data_output", False))
    if req.get("outputs") is not None:
        outs = req["outputs"]
        if not isinstance(outs, list):
            raise ProtocolError("'outputs' must be a list of {name, parameters}")
        outputs = {}
        for j, o in enumerate(outs):
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise ProtocolError(f"outputs[{j}] must be an object with a string 'name'")
            op = o.get("parameters") or {}
            if not isinstance(op, dict):
                raise ProtocolError(f"output {o['name']!r}: 'parameters' must be an object")
            refuse_classification(o["name"], op.get("classification"))
            outputs[o["name"]] = bool(op.get("binary_data", default_binary))
    return InferRequest(inputs=tensors, id=rid, parameters=params, outputs=outputs)


def refuse_classification(output: str, class_count: Any) -> None:
    """A 400 for an output asked for as Triton's top-k classes: gpuloom does not implement that
    extension (it would answer BYTES tensors), and serving the raw tensor instead would surprise."""
    if class_count not in (None, 0, False):
        raise ProtocolError(f"output {output!r}: gpuloom does not implement Triton's classification extension "
                            f"(parameter 'classification' = {_short(class_count)}); ask for the output without "
                            "it and take the top classes from the tensor")


def is_refusal(status: int) -> bool:
    """Whether a request answered ``status`` before the runtime took it is booked as refused
    (``gpuloom_request_rejected``): a 4xx, or 503 for a model of the repository still loading. One
    rule for the HTTP and gRPC front ends."""
    return 400 <= status < 500 or status == 503


def refuse_load_overrides(parameters: Mapping[str, Any]) -> None:
    """A 400 for a repository load that carries an override ``config`` or ``file:...`` contents
    (Triton's model repository extension allows them): gpuloom loads what the repository holds, and
    reloading it silently instead would leave the client believing its override is served. Shared
    by the HTTP and gRPC load endpoints, so that both refuse the same requests in the same words."""
    if "config" in parameters or any(k.startswith("file:") for k in parameters):
        raise ProtocolError("loading with an override config or files is not supported; edit the repository", 400)


_SPEC_DTYPES: dict[str, np.dtype] = {}  # a spec's dtype name -> numpy dtype (np.dtype(str) per request costs)


def check_inputs(config: Any, inputs: Mapping[str, np.ndarray]) -> bool:
    """Check names, dtypes and per-sample shapes against ``config.inputs`` (TensorSpec: name, shape, dtype).

    Shapes are ``[batch, *spec.shape]`` with ``1 <= batch <= config.max_batch`` (a ``-1`` in the spec
    matches any size). Raises ProtocolError (400) saying what was expected.

    Runs per request (for the HTTP workers' requests, on the runtime's thread): a request that matches
    exactly passes in one look per input; anything else (a wildcard, an error) takes the full check.
    Returns True for an exact match (every input present, its dtype and every dimension of its
    per-sample shape the spec's, one batch size for all), which the runtime then need not check again
    (``InferenceService.submit(checked_for=)``); False for a request that passed through a wildcard.
    """
    specs = config.inputs
    names = getattr(config, "input_names", None)  # ModelConfig's, made once; else made here
    if names is None:
        names = frozenset(s.name for s in specs)
    if len(inputs) == len(specs) == len(names):  # (names that repeat in the specs: the full check says so)
        batch = None
        for spec in specs:
            arr = inputs.get(spec.name)
            dt = _SPEC_DTYPES.get(spec.dtype)
            if dt is None:
                dt = _SPEC_DTYPES[spec.dtype] = np.dtype(spec.dtype)
            if (arr is None or arr.dtype != dt or arr.ndim != len(spec.shape) + 1
                    or arr.shape[1:] != tuple(spec.shape) or (batch is not None and arr.shape[0] != batch)):
                break
            batch = arr.shape[0]
        else:
            if batch is not None and 1 <= batch <= config.max_batch:
                return True
    _check_inputs_fully(config, inputs)
    return False


def _check_inputs_fully(config: Any, inputs: Mapping[str, np.ndarray]) -> None:
    """:func:`check_inputs`, every rule in turn, each with its message."""
    want = {s.name: s for s in config.inputs}
    missing = [n for n in want if n not in inputs]
    extra = [n for n in inputs if n not in want]
    if missing or extra:
        raise ProtocolError(
            f"model {config.name!r} expects inputs {sorted(want)}; missing {missing}, unexpected {extra}"
        )
    batch = None
    for name, arr in inputs.items():
        spec = want[name]
        expected = ["b", *spec.shape]
        if np.dtype(spec.dtype) != arr.dtype:
            raise ProtocolError(
                f"input {name!r} of model {config.name!r}: expected datatype {v2_dtype(spec.dtype)}, found {NUMPY_TO_V2.get(arr.dtype.name, arr.dtype.name)}"
            )
        ok = arr.ndim == len(spec.shape) + 1 and all(w == -1 or w == f for w, f in zip(spec.shape, arr.shape[1:]))
        if not ok:
            raise ProtocolError(
                f"input {name!r} of model {config.name!r}: expected shape {expected} (b = batch, 1..{config.max_batch}), found {list(arr.shape)}"
            )
        if not 1 <= arr.shape[0] <= config.max_batch:
            raise ProtocolError(
                f"input {name!r} of model {config.name!r}: batch {arr.shape[0]} outside 1..{config.max_batch} (max_batch)"
            )
        if batch is not None and arr.shape[0] != batch:
            raise ProtocolError(f"model {config.name!r}: inputs disagree on the batch size ({batch} vs {arr.shape[0]})")
        batch = arr.shape[0]


def _short(v: Any, limit: int = 60) -> str:
    """``repr(v)``, cut to ``limit`` characters (a client's value echoed in an error can be huge)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def deadline_ms_from_parameters(params: Mapping[str, Any], header_ms: str | None = None) -> float | None:
    """The request's deadline in ms from now: Triton's ``timeout`` parameter (microseconds) or the
    ``X-Gpuloom-Deadline-Ms`` header; None -> the model's SLO applies."""
    if header_ms is not None:
        try:
            v = float(header_ms)
        except ValueError:
            raise ProtocolError(f"X-Gpuloom-Deadline-Ms must be a number of milliseconds, found {header_ms!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise ProtocolError(f"X-Gpuloom-Deadline-Ms must be positive, found {header_ms!r}")
        return v
    t = params.get("timeout")
    if t is None:
        return None
    try:
        us = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else math.nan
    except OverflowError:  # an integer past a float's range
        us = math.nan
    if not (math.isfinite(us) and us >= 0):
        raise ProtocolError(f"parameter 'timeout' must be a non-negative number of microseconds, found {_short(t)}")
    return None if us == 0 else us / 1000.0


def encode_infer_response(
    model: str,
    version: str,
    outputs: Mapping[str, np.ndarray],
    *,
    request: InferRequest,
) -> tuple[bytes, int | None]:
    """Result arrays -> (body, json_header_length or None). Binary outputs follow the JSON header."""
    if request.outputs is None:
        binary_default = bool(request.parameters.get("binary_data_output", False))
        wanted = {n: binary_default for n in outputs}
    else:
        unknown = [n for n in request.outputs if n not in outputs]
        if unknown:
            raise ProtocolError(f"model {model!r} has no outputs {unknown}; it has {sorted(outputs)}")
        wanted = request.outputs
    out_json = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        arr = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": v2_dtype(arr.dtype.name), "shape": list(arr.shape)}
        if binary:
            raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        out_json.append(entry)
    resp: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": out_json}
    if request.id is not None:
        resp["id"] = request.id
    head = json.dumps(resp, allow_nan=True).encode()
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)


def server_timing(durations_ms: Mapping[str, float]) -> str:
    """A W3C ``Server-Timing`` header value: where a request's time went inside the server.

    ``{"service": 3.1, "bridge": 3.6}`` -> ``"service;dur=3.100, bridge;dur=3.600"`` (milliseconds, as
    the standard says; browsers' dev tools and ``gpuloom load`` read it). A client's latency minus the
    outermost duration is what the network and the client itself took.
    """
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in durations_ms.items())


def parse_server_timing(value: str | None) -> dict[str, float]:
    """``"service;dur=3.1, bridge;dur=3.6"`` -> ``{"service": 3.1, "bridge": 3.6}``; entries without a
    readable ``dur`` are skipped (the header is advisory: a malformed one never fails a request)."""
    out: dict[str, float] = {}
    for entry in (value or "").split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            key, _, raw = p.partition("=")
            if key.strip().lower() == "dur" and name:
                try:
                    ms = float(raw.strip().strip('"'))
                except ValueError:
                    break
                if math.isfinite(ms):
                    out[name] = ms
                break
    return out
