"""The bytes between an HTTP front-end worker process (``frontend.py``) and the runtime's process
(``bridge.py``): frames, compact ring records, and what packs, reads and checks them on both sides.

Frame on the socket, both ways: ``!IQ`` (JSON length, payload length), the JSON, then the payload
(the tensors' raw little-endian bytes, back to back, in the order the JSON lists them). A worker's
first frame is a hello carrying its shared-memory arena (``gpuloom.serve.arena``) as a descriptor;
a request whose tensors it wrote there says ``"arena": offset`` and has an empty payload. With
rings (``gpuloom.serve.ring``, the default where supported) the hello also carries the rings'
block and an eventfd; the runtime answers it with a frame saying whether it mapped them, and from
then on requests and successful replies travel through the rings as compact records (below), error
replies as frames, and the socket takes only what does not fit.

Compact ring records: ``RING_MAGIC`` where a frame's JSON length would be, a small struct with what
changes from request to request (id, arena offset, deadline; id, service time), then JSON that
repeats (model, tensors' names, types and shapes), which each side parses once per distinct text
(``_Templates``). On the build VM, in four interleaved pairs of runs against the code before, the
runtime thread's intake went from 121-171 to 122-137 us per HTTP request and its replies from 98-145
to 84-97 (twenty-fifth session, ``serve_e2e.py --loop-cpu``).
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from typing import Any, Callable

import numpy as np

from .protocol import ProtocolError, numpy_dtype, v2_dtype

FRAME = struct.Struct("!IQ")
RING_MAGIC = b"\xff\xff\xff\xff"  # no frame's JSON is 4 GiB long: a compact ring record follows
RING_REQ = struct.Struct("<4sIQQddd")  # magic, JSON bytes, request id, arena offset, deadline ms (NaN: none),
#   ms the request had been in the worker (from its handler) when passed on, and when it was passed on (ms on
#   the host's monotonic clock, time.monotonic(), which every process reads alike: the runtime adds the time
#   the record then waited in the ring to both)
RING_OK = struct.Struct("<4sIQQd")  # magic, JSON bytes, payload bytes, request id, service ms
_TEMPLATES_MAX = 1024  # distinct JSON texts a side remembers (then it starts over)
_TEMPLATE_BYTES_MAX = 4096  # longer texts (client-chosen names can be long) are parsed each time, not kept


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes, C order, little-endian, as a byte view (a copy only where they are not)."""
    if a.size == 0:  # (memoryview cannot cast a view with a zero in its shape)
        return memoryview(b"")
    if not (a.flags.c_contiguous and a.dtype.byteorder != ">"):
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return memoryview(a).cast("B")


def _describe(names: list[str], arrays: list[np.ndarray]) -> tuple[list[dict], list[memoryview]]:
    """The tensors' JSON descriptions (name, datatype, shape, nbytes) and their bytes."""
    bufs = [_raw(a) for a in arrays]
    return [{"name": n, "datatype": _v2_name(a.dtype), "shape": list(a.shape), "nbytes": b.nbytes}
            for n, a, b in zip(names, arrays, bufs)], bufs


def _copy_into(into: memoryview, bufs: list[memoryview]) -> None:
    off = 0
    for b in bufs:
        into[off:off + b.nbytes] = b
        off += b.nbytes


def pack(meta: dict, arrays: list[np.ndarray], into: memoryview | None = None) -> list[Any]:
    """A frame as a list of buffers (header, JSON, each tensor's bytes) for ``writelines``/``sendall``.

    ``into``: a block of the shared arena (``meta["arena"]`` says where) that takes the tensors'
    bytes instead; the frame then has an empty payload."""
    tensors, bufs = _describe(meta.pop("names"), arrays)
    js = json.dumps(dict(meta, tensors=tensors)).encode()
    if into is not None:
        _copy_into(into, bufs)
        return [FRAME.pack(len(js), 0), js]
    return [FRAME.pack(len(js), sum(b.nbytes for b in bufs)), js, *bufs]


class _Templates:
    """JSON texts that repeat across records, parsed once each: ``get(text)`` is ``make(json.loads(
    text))``, remembered (up to ``_TEMPLATES_MAX`` texts of at most ``_TEMPLATE_BYTES_MAX`` bytes,
    then forgotten all at once: a few MiB at most, whatever clients send). What ``make`` raises is
    raised again, and nothing is remembered. Any thread may call it (dict get and set)."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make, self._known = make, {}

    def get(self, text: bytes) -> Any:
        made = self._known.get(text)
        if made is None:
            made = self._make(json.loads(text))
            if len(text) <= _TEMPLATE_BYTES_MAX:
                if len(self._known) >= _TEMPLATES_MAX:
                    self._known = {}
                self._known[text] = made
        return made


class _Layout:
    """Where a record's tensors lie in its payload, from their JSON descriptions (``tensors``: name,
    datatype, shape, nbytes), checked: per tensor its name, little-endian dtype, shape and byte span,
    back to back; ``nbytes`` in all."""

    __slots__ = ("spans", "nbytes")

    def __init__(self, tensors: Any) -> None:
        if not isinstance(tensors, list):
            raise ValueError(f"a frame's tensors must be a list of descriptions, got {type(tensors).__name__}")
        spans, off = [], 0
        for t in tensors:
            n, shape, name = t["nbytes"], t["shape"], t["name"]
            if not (_is_int(n) and n >= 0 and isinstance(shape, list) and all(_is_int(d) for d in shape)
                    and isinstance(name, str)):
                raise ValueError(f"a tensor of a frame needs a name, integer nbytes and an integer shape; got {t!r}")
            spans.append((name, numpy_dtype(t["datatype"]).newbyteorder("<"), tuple(shape), off, off + n))
            off += n
        self.spans, self.nbytes = tuple(spans), off

    def arrays(self, payload: memoryview) -> dict[str, np.ndarray]:
        """The tensors as arrays viewing ``payload`` (no copy); ValueError where a shape and its bytes disagree."""
        return {name: np.frombuffer(payload[a:b], dtype=dt).reshape(shape) for name, dt, shape, a, b in self.spans}


class _RequestTemplate:
    """What a compact request's JSON says, checked once: the model, the outputs asked for, and where
    its inputs lie in the request's arena block. ``checked_for``: the model config its inputs last
    matched exactly (``ServeCore.submit``); every request of this text has the same names, dtypes and
    shapes, so while the model keeps that config they are not checked again."""

    __slots__ = ("model", "version", "outputs", "layout", "checked_for")

    def __init__(self, js: Any) -> None:
        if not isinstance(js, dict) or not isinstance(js.get("model"), str) or not isinstance(js.get("tensors"), list):
            raise ValueError("a compact ring request's JSON must be an object with a model name and its tensors")
        self.model, self.version, self.outputs = js["model"], js.get("version"), js.get("outputs")
        self.layout = _Layout(js["tensors"])
        self.checked_for = None


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float


def ring_request(rid: int, meta: dict, tensors: list[dict], arena_offset: int, deadline_ms: float | None,
                 waited_ms: float = 0.0, handed_ms: float | None = None) -> list[Any]:
    """A worker's compact request record (its tensors already in the arena at ``arena_offset``).
    ``handed_ms``: when it is passed on (``time.monotonic()`` in ms; default now)."""
    js = json.dumps({"model": meta["model"], "version": meta.get("version"), "outputs": meta.get("outputs"),
                     "tensors": tensors}).encode()
    handed = time.monotonic() * 1e3 if handed_ms is None else float(handed_ms)
    return [RING_REQ.pack(RING_MAGIC, len(js), rid, arena_offset,
                          math.nan if deadline_ms is None else float(deadline_ms), float(waited_ms), handed), js]


def _reply_key(names: list[str], arrays: list[np.ndarray]) -> tuple:
    return tuple((n, a.dtype.str, a.shape) for n, a in zip(names, arrays))


class _ReplyEncoder:
    """Successful replies as compact records: the outputs' JSON description is made once per set of
    names, dtypes and shapes (a model's batch of n rows always gives the same)."""

    def __init__(self) -> None:
        self._known: dict[tuple, bytes] = {}

    def record(self, rid: int, names: list[str], arrays: list[np.ndarray], service_ms: float) -> list[Any]:
        key = _reply_key(names, arrays)
        js = self._known.get(key)
        if js is None:
            tensors, bufs = _describe(names, arrays)
            js = json.dumps({"status": 200, "names": names, "tensors": tensors}).encode()
            if len(self._known) >= _TEMPLATES_MAX:
                self._known = {}
            self._known[key] = js
        else:
            bufs = [_raw(a) for a in arrays]
        return [RING_OK.pack(RING_MAGIC, len(js), sum(b.nbytes for b in bufs), rid, service_ms), js, *bufs]


def read_ring_reply(record: memoryview, templates: "_Templates") -> tuple[dict, memoryview]:
    """A reply from the reply ring as ``(meta, payload)``, whether a compact record or a frame; the
    payload is copied out, since the ring reuses its bytes. ``templates``: ``_Templates(dict)``."""
    if record[:4] == RING_MAGIC:
        _, jlen, plen, rid, service_ms = RING_OK.unpack_from(record)
        start = RING_OK.size
        meta = dict(templates.get(bytes(record[start:start + jlen])), id=rid, service_ms=service_ms)
        return meta, memoryview(bytes(record[start + jlen:start + jlen + plen]))
    jlen, plen = FRAME.unpack_from(record)
    meta = json.loads(bytes(record[FRAME.size:FRAME.size + jlen]))
    return meta, memoryview(bytes(record[FRAME.size + jlen:FRAME.size + jlen + plen]))


_V2_NAMES: dict[str, str] = {}  # numpy dtype name -> v2 name, as found


def _v2_name(dtype: np.dtype) -> str:
    """``v2_dtype(dtype.name)``, remembered: ``np.dtype(name)`` from a string takes ~3.5 us, per
    tensor of every frame (replies are packed on the runtime's thread)."""
    name = _V2_NAMES.get(dtype.name)
    if name is None:
        name = _V2_NAMES[dtype.name] = v2_dtype(dtype.name)  # ValueError for no v2 name: not remembered
    return name


def payload_bytes(meta: dict) -> int:
    return _Layout(meta["tensors"]).nbytes


def unpack_tensors(meta: dict, payload: memoryview) -> dict[str, np.ndarray]:
    """The frame's tensors as arrays viewing ``payload`` (no copy)."""
    return _Layout(meta["tensors"]).arrays(payload)


def _error_frame(rid: int, e: ProtocolError) -> list[Any]:
    return pack({"id": rid, "status": e.status, "error": str(e), "retry_after_s": e.retry_after_s, "names": []}, [])


def _internal_error_frame(rid: int, e: Exception) -> list[Any]:
    """A 500 for what the bridge did not expect: the worker's client is still answered."""
    return _error_frame(rid, ProtocolError(f"internal error: {type(e).__name__}: {e}", 500))


def _failure_frame(rid: int, e: Exception) -> list[Any]:
    """The answer to a request that failed with ``e``: its own status for a ProtocolError, else a 500."""
    return _error_frame(rid, e) if isinstance(e, ProtocolError) else _internal_error_frame(rid, e)


def _recv_control(conn: socket.socket, max_fds: int) -> tuple[dict | None, list[int]]:
    """A control frame (a worker's hello, the runtime's answer to it): its JSON object and the
    descriptors that came with it. None for the object when the connection closed first or the frame
    is not one (it has a payload, or its JSON is no object); the caller owns the descriptors either way."""
    data, fds, _, _ = socket.recv_fds(conn, FRAME.size, max_fds)
    if not data:
        return None, fds
    if len(data) < FRAME.size:
        rest = _recv_exact(conn, FRAME.size - len(data))
        if rest is None:
            return None, fds
        data += bytes(rest)
    jlen, plen = FRAME.unpack(data)
    js = _recv_exact(conn, jlen)
    if js is None or plen:
        return None, fds
    obj = json.loads(bytes(js))
    return (obj if isinstance(obj, dict) else None), fds


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when the connection closes first."""
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def _recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    return buf if _recv_into(conn, memoryview(buf)) else None
