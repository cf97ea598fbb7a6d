"""The KServe v2 HTTP/REST front end (aiohttp), as Triton serves it, so ``tritonclient.http`` works.

Routes (``{v}`` part optional: ``/v2/models/{m}/versions/{v}/...``)::

    GET  /v2/health/live | /v2/health/ready | /v2                 server health and metadata
    GET  /v2/models/{m} | .../ready | .../config | .../stats      model metadata, readiness, config, statistics
    POST /v2/models/{m}/infer                                      JSON tensors or binary tensor data
    GET  /v2/models/stats                                          all models' statistics
    POST /v2/repository/index | /v2/repository/models/{m}/load | .../unload
    GET  /metrics  (Prometheus text)        GET /openapi.json  (this API, OpenAPI 3.0)

Errors are ``{"error": message}`` with a 4xx for anything the client got wrong, 429/503 with
``Retry-After`` under overload or shutdown, 504 when the deadline passed in the queue. A successful
infer answer carries ``Server-Timing: service;dur=MS`` (submit to outcome, in the runtime; behind
``--http-workers`` also ``bridge`` and ``worker``), so a client can tell the server's time from the
network's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from .core import EXTENSIONS, SERVER_NAME, ServeCore, model_config_json, model_metadata
from .protocol import (ProtocolError, deadline_ms_from_parameters, encode_infer_response, load_json, parse_infer_body,
                       is_refusal, refuse_load_overrides, server_timing)

log = logging.getLogger("gpuloom.serve.http")

__all__ = ["build_app"]

HEADER_LEN = "Inference-Header-Content-Length"
CORE_KEY = web.AppKey("core", ServeCore)
DEADLINE_HEADER = "X-Gpuloom-Deadline-Ms"


def _error(message: str, status: int, retry_after_s: float | None = None) -> web.Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(round(retry_after_s + 0.499))))
    return web.json_response({"error": message}, status=status, headers=headers)


_NO_SHM = ("Triton's shared-memory extensions are not implemented; send the tensors in the request (JSON, or "
           "binary tensor data)")
#: Triton extensions gpuloom does not implement: a path's first segments -> what to do instead
_UNSUPPORTED = (
    (("v2", "systemsharedmemory"), _NO_SHM),
    (("v2", "cudasharedmemory"), _NO_SHM),
    (("v2", "trace"), "Triton's trace extension is not implemented; the server's metrics are at GET /metrics"),
    (("v2", "logging"), "Triton's logging extension is not implemented; the server logs to stderr"),
)


def _no_such_endpoint(request: web.Request) -> str:
    """What a 404 for an unknown path says: what this server does not implement, or where its API is."""
    parts = tuple(p for p in request.path.split("/") if p)
    if len(parts) >= 4 and parts[:2] == ("v2", "models") and parts[-2:] == ("trace", "setting"):
        parts = ("v2", "trace")  # a model's trace settings
    for prefix, why in _UNSUPPORTED:
        if parts[:len(prefix)] == prefix:
            return f"{request.method} {request.path}: {why}"
    return (f"no such endpoint: {request.method} {request.path} (gpuloom serves the KServe v2 / Triton HTTP API; "
            f"GET /openapi.json describes it)")


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ProtocolError as e:
        return _error(str(e), e.status, e.retry_after_s)
    except web.HTTPRequestEntityTooLarge as e:
        return _error(f"request body too large: {e.text}; the limit is {request.app[CORE_KEY].max_body_bytes} bytes", 413)
    except web.HTTPNotFound:
        return _error(_no_such_endpoint(request), 404)
    except web.HTTPException as e:
        if e.status >= 400:
            return _error(e.reason or e.text or "error", e.status)
        raise
    except RequestPayloadError as e:  # e.g. a body that is not the gzip its Content-Encoding says
        # the decoder's own words where aiohttp kept them, else its "400, message:\n  ...", on one line
        why = " ".join(str(getattr(e.__cause__, "message", None) or e).split())
        return _error(f"request body could not be read: {why}", 400)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        transport = request.transport
        if transport is None or transport.is_closing():  # the client left mid-request: no one to answer
            log.debug("%s %s: the client closed the connection before the request was read", request.method, request.path)
            # (an answer to no one: aiohttp drops it quietly, where a raise would log a traceback)
            return _error("the client closed the connection before the request was read", 400)
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error("internal error: ConnectionResetError", 500)
    except Exception as e:  # a bug of ours: answer, log, never drop the connection
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(f"internal error: {type(e).__name__}: {e}", 500)


def refused_status(e: BaseException) -> int | None:
    """The 4xx (or 503: its model loading) an infer request is answered for ``e``, raised before it
    reached the runtime (what ``_errors`` answers); None for anything else (a client gone, a bug of
    ours: not a refusal)."""
    if isinstance(e, ProtocolError):
        return e.status if is_refusal(e.status) else None
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return 413
    if isinstance(e, RequestPayloadError):  # a body that is not the gzip its Content-Encoding says
        return 400
    return None


@contextlib.contextmanager
def refusals_booked(book: Callable[[int], None]):
    """Around an infer request's reading and parsing: a refusal there is booked, ``book(status)``, before
    it is answered (``ServeCore.refused`` in process; a worker tells the runtime's process), for
    ``gpuloom_request_rejected``; they were not booked at all before the sixty-fifth session."""
    try:
        yield
    except Exception as e:
        status = refused_status(e)
        if status is not None:
            book(status)
        raise


def infer_response(name: str, outputs, req, timing_ms: dict[str, float] | None = None) -> web.Response:
    """The HTTP answer to an infer request: JSON, or JSON + binary tensor data as ``req`` asked."""
    payload, hlen = encode_infer_response(name, "1", outputs, request=req)
    headers = {"Content-Type": "application/octet-stream" if hlen is not None else "application/json"}
    if hlen is not None:
        headers[HEADER_LEN] = str(hlen)
    if timing_ms:
        headers["Server-Timing"] = server_timing(timing_ms)
    return web.Response(body=payload, headers=headers)


def _version(request: web.Request) -> str | None:
    return request.match_info.get("version")


class _AnsweredPayloadErrors(logging.Filter):
    """Drops aiohttp's "Unhandled exception" record, with its traceback, for a request body that could
    not be read (e.g. not the gzip its Content-Encoding says). After the answer aiohttp reads what is
    left of the body, fails on it again and logs that; the client has had its 400 (``_errors``) and
    the connection is closed, so the record says nothing a server's operator needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RequestPayloadError))


_SERVER_LOG = logging.getLogger("aiohttp.server")
if not any(isinstance(f, _AnsweredPayloadErrors) for f in _SERVER_LOG.filters):
    _SERVER_LOG.addFilter(_AnsweredPayloadErrors())


def bodies_bounded(limit_bytes: int, max_body_bytes: int,
                   refused: Callable[[str, str | None, int], None]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware (inside ``_errors``) that bounds the bytes of infer request bodies being received or
    handled at once: a request whose body would take them past ``limit_bytes`` is answered 429 with
    Retry-After from its headers alone, before its body is read, and booked through
    ``refused(model, version, status)`` (``ServeCore.refused``, or a worker's report of it). A
    body's size is its Content-Length, or ``max_body_bytes`` where it may grow on reading (chunked, or
    compressed). The first request always goes in. Why: bodies were read whole before any overload
    check, so a burst of large requests grew the process without bound (200 concurrent 8 MB requests:
    +1.7-1.9 GB; a review, sixty-eighth session)."""
    used = [0]

    @web.middleware
    async def bodies(request: web.Request, handler):
        if request.method != "POST" or not request.path.endswith("/infer"):
            return await handler(request)
        n = request.content_length
        if n is None or request.headers.get("Content-Encoding", "identity") != "identity":
            n = max_body_bytes
        if used[0] and used[0] + n > limit_bytes:
            refused(request.match_info.get("model", ""), _version(request), 429)
            raise ProtocolError(f"the server is receiving or handling {used[0] / 2**20:.1f} MiB of request bodies "
                                f"at once (limit {limit_bytes / 2**20:.1f} MiB; gpuloom serve --max-bodies-mb): "
                                f"retry later", 429, retry_after_s=1.0)
        used[0] += n
        try:
            return await handler(request)
        finally:
            used[0] -= n

    return bodies


def close_when(stopping: Callable[[], bool]) -> Callable[..., Awaitable[None]]:
    """An ``on_response_prepare`` hook: while ``stopping()``, every answer closes its connection
    (``Connection: close``). Why: a client that sent its next request on a kept-alive connection as
    the listeners closed got no answer, its bytes dropped unread (the sixty-fifth session's SIGTERM
    runs); told to close, it does not send one there."""

    async def close_when_stopping(request: web.Request, response: web.StreamResponse) -> None:
        if stopping():
            response.force_close()  # the server closes it after this answer, and says so (this hook
            response.headers["Connection"] = "close"  # runs after aiohttp wrote its own Connection header)

    return close_when_stopping


def build_app(core: ServeCore) -> web.Application:
    """The aiohttp application serving ``core`` (bodies over ``core.max_body_bytes`` get 413)."""
    bounded = bodies_bounded(core.max_bodies_bytes, core.max_body_bytes, core.refused)
    app = web.Application(middlewares=[_errors, bounded], client_max_size=core.max_body_bytes)
    app[CORE_KEY] = core

    app.on_response_prepare.append(close_when(lambda: core.closing))
    r = web.RouteTableDef()

    @r.get("/v2/health/live")
    async def live(request):
        ok = core.service.is_live()
        return web.json_response({"live": ok}, status=200 if ok else 503)

    @r.get("/v2/health/ready")
    async def ready(request):
        ok = core.server_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    @r.get("/v2")
    async def server_metadata(request):
        from .. import __version__

        return web.json_response({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    @r.get("/v2/models/stats")
    async def all_stats(request):
        return web.json_response(core.statistics())

    for suffix in ("", "/versions/{version}"):
        base = "/v2/models/{model}" + suffix

        @r.get(base)
        async def metadata(request):
            return web.json_response(model_metadata(core.config(request.match_info["model"], _version(request))))

        @r.get(base + "/ready")
        async def model_ready(request):
            name = request.match_info["model"]
            core.config(name, _version(request))  # 404 for unknown
            ok = core.ready(name, _version(request))
            return web.json_response({"name": name, "ready": ok}, status=200 if ok else 400)

        @r.get(base + "/config")
        async def config(request):
            return web.json_response(model_config_json(core.config(request.match_info["model"], _version(request))))

        @r.get(base + "/stats")
        async def stats(request):
            return web.json_response(core.statistics(request.match_info["model"], _version(request)))

        @r.post(base + "/infer")
        async def infer(request):
            t_in = time.perf_counter()  # the deadline counts from here (the body may still be arriving)
            name = request.match_info["model"]
            version = _version(request)
            with refusals_booked(functools.partial(core.refused, name, version)):
                body = await request.read()  # aiohttp undoes gzip/deflate Content-Encoding, within client_max_size
                core.config(name, version)  # an unknown model or version is a 404 whatever the body holds (as Triton)
                req = parse_infer_body(body, request.headers.get(HEADER_LEN))
                deadline = deadline_ms_from_parameters(req.parameters, request.headers.get(DEADLINE_HEADER))
                core.check_outputs(name, version, req.outputs)
            t0 = time.perf_counter()
            outputs = await core.infer(name, version, req.inputs, deadline, (t0 - t_in) * 1e3)
            return infer_response(name, outputs, req, {"service": (time.perf_counter() - t0) * 1e3})

    @r.post("/v2/repository/index")
    async def repo_index(request):
        body = await _json_body(request, optional=True)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise ProtocolError(f"'ready' must be true or false, found {ready!r}", 400)
        # off the event loop: it re-reads the repository from disk (300 YAML files: 105 ms), and on a CPU the
        # runtime's loop runs on this one (a review, sixty-ninth session)
        return web.json_response(await asyncio.to_thread(core.repository_index, ready_only=ready))

    @r.post("/v2/repository/models/{model}/load")
    async def repo_load(request):
        body = await _json_body(request, optional=True)
        refuse_load_overrides(body.get("parameters") or {})
        await core.in_own_thread(core.load, request.match_info["model"])
        return web.json_response({})

    @r.post("/v2/repository/models/{model}/unload")
    async def repo_unload(request):
        await _json_body(request, optional=True)
        await core.in_own_thread(core.unload, request.match_info["model"])
        return web.json_response({})

    @r.get("/metrics")
    async def metrics(request):
        """The Prometheus text, declared as the format :func:`~.metrics.render` writes (0.0.4): a scraper
        reads the body by the version the header names (``CONTENT_TYPE_LATEST`` is 1.0.0 now)."""
        from .metrics import CONTENT_TYPE, render

        return web.Response(body=render(core.registry), headers={"Content-Type": CONTENT_TYPE})

    @r.get("/openapi.json")
    async def openapi(request):
        from .openapi import openapi_document

        return web.json_response(openapi_document())

    app.add_routes(r)
    return app


async def _json_body(request: web.Request, *, optional: bool) -> dict:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise ProtocolError("request body must be a JSON object", 400)
    body = load_json(raw)
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, found {type(body).__name__}", 400)
    if "parameters" in body and not isinstance(body["parameters"], dict):
        raise ProtocolError("'parameters' must be an object", 400)
    return body
