"""An open-loop HTTP load generator for any KServe v2 server (gpuloom, Triton, KServe).

Arrival times are precomputed (Poisson or constant rate) and each request is sent at its time whether
or not earlier ones have answered (open loop: a slow server sees the load pile up, as in production).
Inputs are random tensors of the model's metadata shapes; sent as Triton binary tensor data by default
or as JSON (``binary=False``, for servers without the extension).
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiohttp import http_exceptions

# (here, not where a failure is classified: with every file the process may open in use, that first
# import failed, "Too many open files", and ended the run without its report)
from .httpconn import BadResponse
from .protocol import V2_TO_NUMPY, parse_server_timing

__all__ = ["LoadResult", "run_load", "run_closed", "arrival_times", "failure_kind", "CLIENTS", "MAX_REQUESTS"]

#: who sends the inference requests: aiohttp's client, or ``httpconn``'s lean one (plain HTTP only;
#: about half aiohttp's CPU per 600 KB request, on the build VM and the H200 host: for load
#: generators that share a host with the server they measure)
CLIENTS = ("aiohttp", "lean")
#: the SLO attainment is measured against where neither the caller nor the server names one (not gpuloom)
DEFAULT_SLO_MS = 100.0
#: the most requests one open-loop run schedules (rate x duration): every request is scheduled up
#: front and its task kept until the run ends, about 1 KB of client memory each (``--rate 1e12``
#: asked numpy for 109 TiB of send times before this bound)
MAX_REQUESTS = 10_000_000


def failure_kind(e: BaseException) -> str:
    """What went wrong with a request that got no HTTP status, by one name whichever client sent it
    (aiohttp wraps the socket's errors in its own classes, the lean client raises them as they are):
    "refused", "timeout", "disconnected" (the server closed or reset the connection before answering
    in full), "bad response" (not HTTP, or broken framing); anything else by its exception's name."""
    cause = getattr(e, "os_error", None) or e.__cause__  # aiohttp.ClientConnectorError keeps it as os_error
    if isinstance(e, TimeoutError) or isinstance(cause, TimeoutError):  # asyncio's too, aiohttp's ServerTimeoutError
        return "timeout"
    code = _errno_of(e)
    if code == errno.ECONNREFUSED:
        return "refused"
    if (code in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)
            or isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
                              aiohttp.ServerDisconnectedError))
            or isinstance(e, aiohttp.ClientPayloadError)  # the body ended before its length or last chunk
            and isinstance(cause, (http_exceptions.ContentLengthError, http_exceptions.TransferEncodingError))):
        return "disconnected"
    if isinstance(e, (BadResponse, aiohttp.ClientResponseError, aiohttp.ClientPayloadError)):
        return "bad response"
    return type(e).__name__


def _errno_of(e: BaseException) -> int | None:
    """The socket error number behind ``e``: its own, its wrapped one's, or the one number that
    asyncio's "Multiple exceptions: [Errno 111] ..., [Errno 111] ..." names for every address."""
    for x in (e, getattr(e, "os_error", None), e.__cause__):
        code = getattr(x, "errno", None)
        if isinstance(code, int):
            return code
    found = set(re.findall(r"\[Errno (\d+)\]", str(e))) if isinstance(e, OSError) else set()
    return int(found.pop()) if len(found) == 1 else None


@dataclass
class LoadResult:
    """One load run's account. ``None`` where there is no value (never NaN: ``as_dict()`` is valid
    JSON): latencies when no request succeeded, attainment when none was sent, rate in closed loop."""

    model: str
    rate: float | None  # requests/s asked for (open loop; None in closed loop, which asks for none)
    sent_rate: float  # requests/s actually sent: sent / the duration asked for (Poisson arrivals vary)
    duration_s: float  # the run's wall time, s: at least the duration asked for, and until the last answer
    sent: int
    ok: int
    errors: dict[str, int]  # HTTP status, or what went wrong without one (failure_kind) -> count
    throughput: float  # successful requests/s over duration_s
    slo_ms: float
    slo_attainment: float | None  # fraction of sent requests answered 200 within slo_ms; None: none sent
    p50_ms: float | None  # latency of the successful requests; None: none succeeded
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    # open loop: how late sends left after their scheduled time, ms (a client falling behind shows here)
    send_lag_p99_ms: float = 0.0
    send_lag_max_ms: float = 0.0
    # the server's own account of answered requests (``Server-Timing``, when it sends one), ms:
    # {"service": {"mean": .., "p50": .., "p99": .., "n": ..}, ...}; latency minus it is the network's
    server_timing_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # what the first failed request was told ("HTTP 400: ..." with the server's error, or what went
    # wrong without an answer), "" when none failed: a run whose every request failed says why
    first_error: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("latencies_ms")
        return d


def arrival_times(rate: float, duration_s: float, *, poisson: bool = True, seed: int = 0) -> np.ndarray:
    """Send times (s from start) for ``rate`` requests/s over ``duration_s``: both finite and
    positive, their product at most ``MAX_REQUESTS``."""
    if not (0 < rate < math.inf and 0 < duration_s < math.inf):
        raise ValueError(f"rate and duration must be finite and positive, found rate={rate}, duration={duration_s}")
    if rate * duration_s > MAX_REQUESTS:
        raise ValueError(f"rate {rate:g}/s for {duration_s:g} s is {rate * duration_s:.3g} requests; a run sends at "
                         f"most {MAX_REQUESTS:,} (each is scheduled up front, about 1 KB of memory each)")
    if not poisson:
        return np.arange(0.0, duration_s, 1.0 / rate)
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 1.5) + 16
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return t[t < duration_s]


def _latency_summary(lat: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and mean of ``lat`` (ms), as ``LoadResult``'s fields; None each when it is empty."""
    if not lat:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None}
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "mean_ms": float(np.mean(lat))}


def _url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.startswith(("http://", "https://")) else "http://" + url


def _body(meta: dict, batch: int, binary: bool, rng: np.random.Generator,
          deadline_ms: float | None = None) -> tuple[bytes, dict]:
    """One infer request of ``batch`` random rows; ``deadline_ms``: Triton's ``timeout`` parameter
    (microseconds), the request's own deadline on servers that honour it (gpuloom, Triton)."""
    inputs, blobs = [], []
    for t in meta["inputs"]:
        shape = [batch, *[d if d > 0 else 1 for d in t["shape"][1:]]]
        dt = np.dtype(V2_TO_NUMPY[t["datatype"]])
        arr = (rng.random(shape) * 4).astype(dt) if dt.kind == "f" else rng.integers(0, 4, shape).astype(dt)
        entry = {"name": t["name"], "shape": shape, "datatype": t["datatype"]}
        if binary:
            raw = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        inputs.append(entry)
    req = {"inputs": inputs}
    params: dict = {"binary_data_output": True} if binary else {}
    if deadline_ms is not None:
        params["timeout"] = max(1, round(deadline_ms * 1000.0))
    if params:
        req["parameters"] = params
    head = json.dumps(req).encode()
    headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(head))
    return head + b"".join(blobs), headers


async def fire_open_loop(times: np.ndarray, start: float, one) -> None:
    """Open loop: start ``one(i, scheduled perf_counter)`` at ``start + times[i]`` whatever the
    answers do, then wait for every request."""
    tasks = []
    for i, t in enumerate(times):
        delay = start + float(t) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start + float(t))))
    await asyncio.gather(*tasks)


class _Sender:
    """Sends one model's infer requests, each one of ``bodies`` (built once), with the client asked
    for: ``await send(k)`` -> (HTTP status, its Server-Timing header or None). A ``https://`` URL
    with the lean client fails at construction, before any request."""

    def __init__(self, client: str, session: Any, base: str, model: str, timeout_s: float) -> None:
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, found {client!r}")
        self.session, self.url, self.path = session, f"{base}/v2/models/{model}/infer", f"/v2/models/{model}/infer"
        self.pool = None
        if client == "lean":
            from .httpconn import ConnectionPool

            self.pool = ConnectionPool(base, timeout_s=timeout_s)
        self.bodies: list[tuple[bytes, dict]] = []
        self.encoded: list[bytes] = []
        self.first_error = ""  # LoadResult.first_error

    def use(self, bodies: list[tuple[bytes, dict]]) -> None:
        self.bodies = bodies
        if self.pool is not None:  # each variant's request bytes, head and body, built once
            self.encoded = [self.pool.encode("POST", self.path, body, headers) for body, headers in bodies]

    async def send(self, k: int) -> tuple[int, str | None]:
        """The ``k``-th request (its body: variant ``k`` modulo their number)."""
        if self.pool is not None:
            r = await self.pool.request(self.encoded[k % len(self.encoded)])
            status, timing, answer = r.status, r.headers.get("server-timing"), r.body
        else:
            body, headers = self.bodies[k % len(self.bodies)]
            async with self.session.post(self.url, data=body, headers=headers) as r:
                answer = await r.read()
                status, timing = r.status, r.headers.get("Server-Timing")
        if status != 200 and not self.first_error:
            self.first_error = f"HTTP {status}: {_error_text(answer)}"
        return status, timing

    def failed(self, e: BaseException) -> str:
        """Count-name of a request that got no answer (``failure_kind``), noted if it is the first failure."""
        kind = failure_kind(e)
        if not self.first_error:
            self.first_error = f"{kind}: {type(e).__name__}: {e}"
        return kind

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _error_text(body: bytes) -> str:
    """The server's error message in an answer: KServe's ``{"error": ...}``, else the body's start."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    text = err if isinstance(err, str) else body[:300].decode("utf-8", "replace")
    return " ".join(text.split())


async def _metadata(session, base: str, model: str, inputs: list[dict] | None) -> dict:
    """The model's KServe v2 metadata, with ``inputs`` (when given) in place of the server's."""
    async with session.get(f"{base}/v2/models/{model}") as r:
        if r.status != 200:
            raise ValueError(f"model {model!r} metadata from {base}: HTTP {r.status}: {await r.text()}")
        meta = await r.json()
    return meta if inputs is None else dict(meta, inputs=inputs)


async def _model_config(s: Any, base: str, model: str) -> dict:
    """The model's configuration (Triton's ``GET .../config``), or {} where the server gives none."""
    try:
        async with s.get(f"{base}/v2/models/{model}/config") as r:
            cfg = await r.json() if r.status == 200 else {}
    except Exception:  # noqa: BLE001 - any answer that is not a config
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _model_slo_ms(cfg: dict) -> float:
    """The model's SLO as a gpuloom server's model config states it (``parameters.slo_ms``), or
    ``DEFAULT_SLO_MS`` where the server does not say (not gpuloom)."""
    try:
        slo_ms = float(cfg.get("parameters", {}).get("slo_ms", {}).get("string_value", "nan"))
    except Exception:  # noqa: BLE001 - any answer that is not a gpuloom config
        slo_ms = float("nan")
    return slo_ms if slo_ms == slo_ms else DEFAULT_SLO_MS


async def _slo_checked(s: Any, base: str, model: str, batch: int, slo_ms: float | None) -> float:
    """``slo_ms``, or the model's where None (:func:`_model_slo_ms`), once the model's config says it
    takes ``batch`` rows a request (:func:`_check_batch`)."""
    cfg = await _model_config(s, base, model)
    _check_batch(cfg, model, batch)
    return _model_slo_ms(cfg) if slo_ms is None else slo_ms


def _check_batch(cfg: dict, model: str, batch: int) -> None:
    """ValueError when the model's config says it takes fewer rows a request than ``batch``: every
    request would be refused (a run of 400s that said nothing of why, before)."""
    most = cfg.get("max_batch_size")
    if isinstance(most, int) and not isinstance(most, bool) and 0 < most < batch:
        raise ValueError(f"batch {batch} is more rows than model {model!r} takes in a request (its config's "
                         f"max_batch_size is {most}): the server would refuse every request; send at most {most}")


async def _run(url: str, model: str, times: np.ndarray, *, batch: int, binary: bool, slo_ms: float | None,
               timeout_s: float, seed: int, variants: int = 8, inputs: list[dict] | None = None,
               client: str = "aiohttp", deadline_ms: float | None = None, rate: float | None = None,
               duration_s: float | None = None) -> LoadResult:
    """``times`` sent open loop; ``rate`` and ``duration_s``: what ``times`` were drawn for (None: the
    rate and duration ``times`` themselves span, for callers that drew them otherwise)."""
    base = _url(url)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        sender = _Sender(client, s, base, model, timeout_s)
        meta = await _metadata(s, base, model, inputs)
        if not meta.get("inputs"):
            raise ValueError(f"model {model!r} metadata from {base} lists no inputs; pass them explicitly (inputs=...)")
        if slo_ms is None and deadline_ms is not None:
            slo_ms = deadline_ms  # attainment against the deadline the requests carry
        slo_ms = await _slo_checked(s, base, model, batch, slo_ms)
        rng = np.random.default_rng(seed)
        sender.use([_body(meta, batch, binary, rng, deadline_ms) for _ in range(variants)])
        lat: list[float] = []
        lag: list[float] = []
        status: Counter = Counter()
        ok_in_slo = 0

        async def one(i: int):
            nonlocal ok_in_slo
            t0 = time.perf_counter()
            lag.append((t0 - start - float(times[i])) * 1000.0)
            try:
                code, st = await sender.send(i)
            except Exception as e:  # connection refused, timeout: counted, never raised
                status[sender.failed(e)] += 1
                return
            ms = (time.perf_counter() - t0) * 1000.0
            if code == 200:
                lat.append(ms)
                if ms <= slo_ms:
                    ok_in_slo += 1
                for k, v in parse_server_timing(st).items():
                    server_ms.setdefault(k, []).append(v)
            else:
                status[str(code)] += 1

        server_ms: dict[str, list[float]] = {}
        start = time.perf_counter()
        try:
            await fire_open_loop(times, start, lambda i, _t: one(i))
        finally:
            sender.close()
        elapsed = time.perf_counter() - start
    n = len(times)
    if duration_s is None:
        duration_s = max(float(times[-1]) if n else 0.0, 1e-9)
    if rate is None:
        rate = n / duration_s
    wall = max(elapsed, duration_s)
    lags = np.maximum(np.asarray(lag), 0.0) if lag else np.zeros(1)
    return LoadResult(
        model=model, rate=rate, sent_rate=n / duration_s, duration_s=wall,
        sent=n, ok=len(lat), errors=dict(status), throughput=len(lat) / wall, slo_ms=float(slo_ms),
        slo_attainment=ok_in_slo / n if n else None, **_latency_summary(lat), latencies_ms=lat,
        send_lag_p99_ms=float(np.percentile(lags, 99)), send_lag_max_ms=float(lags.max()),
        server_timing_ms=summarize_timing(server_ms), first_error=sender.first_error,
    )


def summarize_timing(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per Server-Timing metric: mean, p50, p99 and count of its durations, ms."""
    return {k: {"mean": float(np.mean(v)), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
                "n": len(v)} for k, v in samples.items() if v}


def run_load(url: str, model: str, *, rate: float, duration_s: float, poisson: bool = True, batch: int = 1,
             binary: bool = True, slo_ms: float | None = None, timeout_s: float = 30.0, seed: int = 0,
             inputs: list[dict] | None = None, client: str = "aiohttp", deadline_ms: float | None = None) -> LoadResult:
    """Drive ``model`` at ``url`` open-loop; ``slo_ms`` None: ``deadline_ms`` when given, else the
    model's own SLO when the server says it. ``deadline_ms``: every request carries it as its own
    deadline (Triton's ``timeout`` parameter); one the server could not meet is answered 504.

    ``inputs`` (``[{"name", "shape": [-1, ...], "datatype"}]``) overrides the server's metadata, for
    servers whose metadata does not list them (KServe's Python server). ``client``: one of ``CLIENTS``."""
    times = arrival_times(rate, duration_s, poisson=poisson, seed=seed)
    if deadline_ms is not None and not 0 < deadline_ms < math.inf:
        raise ValueError(f"deadline_ms must be a finite positive number of ms, found {deadline_ms}")
    _check_timeout(timeout_s)
    return asyncio.run(_run(url, model, times, batch=batch, binary=binary, slo_ms=slo_ms, timeout_s=timeout_s,
                            seed=seed, inputs=inputs, client=client, deadline_ms=deadline_ms, rate=rate,
                            duration_s=duration_s))


def _check_timeout(timeout_s: float) -> None:
    """ValueError unless ``timeout_s`` is a finite positive number of seconds (aiohttp reads 0 as
    "no timeout", the lean client refuses it: neither is asked for by 0)."""
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite positive number of seconds, found {timeout_s}")


async def _closed(url: str, model: str, concurrency: int, duration_s: float, *, binary: bool, slo_ms: float | None,
                  inputs: list[dict] | None, seed: int, timeout_s: float, client: str = "aiohttp",
                  batch: int = 1) -> LoadResult:
    base = _url(url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        sender = _Sender(client, s, base, model, timeout_s)
        meta = await _metadata(s, base, model, inputs)
        slo_ms = await _slo_checked(s, base, model, batch, slo_ms)
        rng = np.random.default_rng(seed)
        sender.use([_body(meta, batch, binary, rng) for _ in range(8)])
        lat: list[float] = []
        status: Counter = Counter()
        sent = 0
        stop_at = time.perf_counter() + duration_s

        async def worker(k: int):
            nonlocal sent
            i = k
            while time.perf_counter() < stop_at:
                seq = i
                i += concurrency
                sent += 1
                t0 = time.perf_counter()
                try:
                    code, _ = await sender.send(seq)
                except Exception as e:
                    status[sender.failed(e)] += 1
                    continue
                if code == 200:
                    lat.append((time.perf_counter() - t0) * 1000.0)
                else:
                    status[str(code)] += 1

        start = time.perf_counter()
        try:
            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        finally:
            sender.close()
        wall = max(time.perf_counter() - start, duration_s)
    return LoadResult(
        model=model, rate=None, sent_rate=sent / duration_s, duration_s=wall, sent=sent, ok=len(lat),
        errors=dict(status), throughput=len(lat) / wall, slo_ms=slo_ms,
        slo_attainment=sum(ms <= slo_ms for ms in lat) / sent if sent else None, **_latency_summary(lat),
        latencies_ms=lat, first_error=sender.first_error,
    )


def run_closed(url: str, model: str, *, concurrency: int, duration_s: float, binary: bool = True,
               slo_ms: float | None = None, inputs: list[dict] | None = None, seed: int = 0, timeout_s: float = 30.0,
               client: str = "aiohttp", batch: int = 1) -> LoadResult:
    """Closed loop (perf_analyzer's concurrency mode): ``concurrency`` clients, each sending its next
    request of ``batch`` rows when the last one answers, for ``duration_s``. Measures requests/s at
    saturation; ``slo_ms`` None: the model's, as :func:`run_load` takes it."""
    if concurrency < 1 or not 0 < duration_s < math.inf or batch < 1:
        raise ValueError(f"concurrency and batch must be >= 1 and duration finite and positive, found {concurrency}, "
                         f"{batch}, {duration_s}")
    _check_timeout(timeout_s)
    return asyncio.run(_closed(url, model, concurrency, duration_s, binary=binary, slo_ms=slo_ms, inputs=inputs,
                               seed=seed, timeout_s=timeout_s, client=client, batch=batch))
