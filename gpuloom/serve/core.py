"""What the HTTP and gRPC front ends share: model lookup, validation, submission, outcome books.

The core adds nothing to scheduling: it checks a request against the model's specs, hands it to the
runtime (``InferenceService.submit``) with its deadline, and turns the runtime's answer or error into
a protocol answer. Both transports call :meth:`ServeCore.infer` and map :class:`ProtocolError` to
their own status codes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .metrics import UNKNOWN_MODEL, Books, build_registry
from .protocol import ProtocolError, check_inputs, v2_dtype
from .repository import Repository, RepositoryError

log = logging.getLogger("gpuloom.serve")

__all__ = ["ServeCore", "SERVER_NAME", "EXTENSIONS", "model_metadata", "model_config_json"]

SERVER_NAME = "gpuloom"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]
VERSION = "1"  # every model has one version
#: repository operations (loads, unloads) under way or waiting for one, at most; past it a new one is
#: answered 503 (a hung load left one blocked thread per later call, each run long after its client left)
MAX_ADMIN_THREADS = 8
#: ``gpuloom_request_rejected``'s reason for an infer request refused before :meth:`ServeCore.submit`
#: (framing, JSON, parameters, outputs, body size), by the status it was answered; any other 4xx:
#: ``invalid_request``
REFUSED_REASONS = {404: "unknown_model", 413: "too_large", 429: "bodies_in_flight", 503: "not_ready"}


def _version_check(name: str, version: str | None) -> None:
    if version not in (None, "", VERSION):
        raise ProtocolError(f"model {name!r} has only version {VERSION}, found version {version!r}", 404)


def model_metadata(config: Any) -> dict[str, Any]:
    """KServe v2 model metadata; shapes carry the batch dimension as -1."""
    return {
        "name": config.name,
        "versions": [VERSION],
        "platform": "pytorch_libtorch",  # as the model's config says (Triton's name for a PyTorch model)
        "inputs": [{"name": t.name, "datatype": v2_dtype(t.dtype), "shape": [-1, *t.shape]} for t in config.inputs],
        "outputs": [{"name": t.name, "datatype": v2_dtype(t.dtype), "shape": [-1, *t.shape]} for t in config.outputs],
    }


def model_config_json(config: Any) -> dict[str, Any]:
    """Triton-style model configuration (``model_config.proto`` as JSON)."""

    def tensors(ts):
        return [{"name": t.name, "data_type": "TYPE_" + v2_dtype(t.dtype), "dims": list(t.shape)} for t in ts]

    return {
        "name": config.name,
        "platform": "pytorch_libtorch",
        "backend": "gpuloom",
        "max_batch_size": config.max_batch,
        "input": tensors(config.inputs),
        "output": tensors(config.outputs),
        "dynamic_batching": {"max_queue_delay_microseconds": int(config.slo_ms * 1000)},
        "parameters": {
            "slo_ms": {"string_value": repr(float(config.slo_ms))},
            "weight": {"string_value": repr(float(config.weight))},
            "rate_hint": {"string_value": repr(float(config.rate_hint))},
        },
    }


def _exec_count(sm: Any) -> int:
    """Batches executed, from the runtime's per-model stats."""
    if not isinstance(sm, dict):
        return 0
    from .metrics import batches_from_sizes

    if sm.get("exec_count") is not None:  # counted by the backend
        return int(sm["exec_count"])
    n = batches_from_sizes(sm.get("batch_size"))  # else estimated from the batch-size histogram
    return int(n or 0)


def _duration(hist: Any) -> dict[str, int]:
    """Triton's ``{count, ns}`` from one of the runtime's ms histograms (requests, summed time)."""
    from .metrics import _histogram_parts

    parts = _histogram_parts(hist)
    if parts is None:
        return {"count": 0, "ns": 0}
    _buckets, total_ms, n = parts
    return {"count": int(n), "ns": int(total_ms * 1e6)}


async def until_done(fut: Any) -> None:
    """Wait on the running event loop until the concurrent future ``fut`` is done (its outcome is read
    by the caller), as ``await asyncio.wrap_future(fut)`` does, without its thread hop where none is
    needed. ``wrap_future`` always wakes the loop through its self-pipe (``call_soon_threadsafe``),
    even for a future resolved on the loop's own thread, which is where the runtime's loop hosted on
    the HTTP event loop resolves every request's (``--runtime-on http``, the CPU default). There
    the awaiting handler resumed 190 us after the result (median, after 10 ms idle on the build VM)
    against 81 us this way (``scripts/diag_future_hop.py``, fiftieth session). Cancelling the wait
    cancels ``fut``, as ``wrap_future`` does."""
    if fut.done():
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    thread = threading.get_ident()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def on_done(_: Any) -> None:
        if threading.get_ident() == thread:  # resolved on the loop's own thread: no hop
            wake()
            return
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    fut.add_done_callback(on_done)
    try:
        await waiter
    except asyncio.CancelledError:
        fut.cancel()
        raise


class ServeCore:
    """The runtime plus the repository behind both transports.

    ``service`` is a started ``gpuloom.runtime.service.InferenceService``; ``repository`` (optional) is
    what the repository API can load/unload by name.
    """

    def __init__(self, service: Any, repository: Repository | None = None, *, max_body_bytes: int = 64 << 20,
                 max_bodies_bytes: int = 1 << 30):
        from ..runtime import service as svc

        self.svc = svc
        self.service = service
        self.repository = repository
        self.max_body_bytes = max_body_bytes
        # infer request bodies being received or handled at once, bytes, per HTTP process (http_server.bodies_bounded)
        self.max_bodies_bytes = max_bodies_bytes
        self.books = Books()
        self._waits: set = set()  # repository calls awaited in in_own_thread (event loop futures)
        self._admin_threads = 0  # in_own_thread's threads not yet ended (running, or waiting for _repo_lock)
        self._admin_lock = threading.Lock()
        self.closing = False
        self._repo_lock = threading.Lock()
        self._states: dict[str, str] = {}  # name -> READY | UNAVAILABLE | LOADING (+ reason)
        self._reasons: dict[str, str] = {}
        self.registry = build_registry(self.books, self._stats, lambda: [c.name for c in self.service.models()])

    # -- lookup --------------------------------------------------------------------------------
    def _stats(self) -> dict:
        return self.service.stats()

    def config(self, name: str, version: str | None = None) -> Any:
        _version_check(name, version)
        c = self.service.config(name)
        if c is not None:
            return c
        if self._states.get(name) == "LOADING":  # (not yet served: a first load)
            raise ProtocolError(f"model {name!r} is loading; retry shortly", 503, retry_after_s=1.0)
        known = sorted(c.name for c in self.service.models())
        raise ProtocolError(f"unknown model {name!r}; loaded models: {known}", 404)

    def check_outputs(self, name: str, version: str | None, wanted) -> None:
        """ProtocolError (400) unless every requested output name is one of the model's; checked
        before spending compute. ``wanted``: output names, or None for all."""
        if wanted is None:
            return
        have = self.config(name, version).output_names
        unknown = [n for n in wanted if n not in have]
        if unknown:
            raise ProtocolError(f"model {name!r} has no outputs {unknown}; it has {sorted(have)}", 400)

    def ready(self, name: str, version: str | None = None) -> bool:
        if version not in (None, "", VERSION):
            return False
        try:
            return bool(self.service.ready(name))
        except self.svc.ServiceError:
            return False

    def server_ready(self) -> bool:
        """Live, not stopping, and every model ready, or between two of its versions (a reload: a
        moment, during which the server stays ready, as Triton's does)."""
        swapping = getattr(self.service, "swapping", lambda name: False)
        return (not self.closing) and self.service.is_live() and all(
            self.service.ready(c.name) or swapping(c.name) for c in self.service.models())

    # -- inference -----------------------------------------------------------------------------
    def refused(self, name: str, version: str | None, status: int) -> None:
        """Book an infer request answered ``status`` (4xx) before it reached :meth:`submit`: its body
        too large, not parsed (framing, JSON, parameters) or asking for outputs the model lacks; or
        for a model or version that is not served. Counted in ``gpuloom_request_rejected`` under the
        model, as submit's own refusals are; under ``_unknown`` where the URL names no model served
        (a bounded label set under fuzzing)."""
        known = version in (None, "", VERSION) and (self.service.config(name) is not None
                                                    or self._states.get(name) == "LOADING")
        self.books.reject(name if known else UNKNOWN_MODEL, REFUSED_REASONS.get(status, "invalid_request"))

    def submit(self, name: str, version: str | None, inputs: Mapping[str, np.ndarray], deadline_ms: float | None,
               waited_ms: float = 0.0, checked_for: Any = None,
               on_done: Callable[[Any, BaseException | None], None] | None = None):
        """Validate and submit; returns the runtime's concurrent Future (None with ``on_done``: the
        service calls it instead, ``InferenceService.submit``; pass what it gets to :meth:`settle`), and
        the model's config when the inputs matched it exactly (else None). Raises ProtocolError (4xx/503).
        ``waited_ms``: how long the request has been in the server already (its deadline counts from
        then: ``InferenceService.submit``). ``checked_for``: a config an earlier request of the very
        same layout (names, dtypes, shapes) matched exactly; while it is still the model's config,
        these inputs are not checked again (the workers' bridge remembers it per request layout)."""
        if self.closing:  # (under its name only where it is one served: a bounded label set)
            self.books.reject(name if self.service.config(name) is not None else UNKNOWN_MODEL, "shutting_down")
            raise ProtocolError("server is shutting down; not accepting new requests", 503, retry_after_s=1.0)
        try:
            config = self.config(name, version)
        except ProtocolError as e:
            if e.status == 503:  # a model of the repository loading
                self.books.reject(name, "not_ready")
            else:
                self.books.reject(UNKNOWN_MODEL, "unknown_model")  # bounded label set under fuzzing
            raise
        if checked_for is not config:
            try:
                exact = check_inputs(config, inputs)
            except ProtocolError:
                self.books.reject(name, "invalid_input")
                raise
            checked_for = config if exact else None
        svc = self.svc
        try:
            fut = self.service.submit(name, dict(inputs), deadline_ms=deadline_ms, waited_ms=waited_ms,
                                      checked_for=checked_for, on_done=on_done)
        except svc.InvalidInput as e:
            self.books.reject(name, "invalid_input")
            raise ProtocolError(f"invalid input for model {name!r}: {e}", 400) from None
        except svc.UnknownModel as e:
            self.books.reject(name, "unknown_model")
            raise ProtocolError(f"unknown model {name!r}: {e}", 404) from None
        except svc.ModelNotReady as e:
            self.books.reject(name, "not_ready")
            raise ProtocolError(f"model {name!r} is not ready: {e}", 503, retry_after_s=1.0) from None
        except svc.Overloaded as e:  # a full queue, or over its planned share of an overloaded GPU (Shed)
            self.books.reject(name, "shed" if isinstance(e, svc.Shed) else "overloaded")
            ra = getattr(e, "retry_after_s", None) or 0.1
            raise ProtocolError(f"model {name!r} is overloaded: {e}", 429, retry_after_s=ra) from None
        self.books.accept(name)
        return fut, checked_for

    def outcome(self, name: str, fut: Any, t0: float, rows: int) -> dict[str, np.ndarray]:
        """Book the finished future's outcome and return its outputs or raise ProtocolError."""
        try:
            out = fut.result(timeout=0)
        except BaseException as e:  # noqa: BLE001 - booked and mapped to its status by settle
            return self.settle(name, None, e, t0, rows)
        return self.settle(name, out, None, t0, rows)

    def lost(self, name: str, reason: str) -> None:
        """Book a request the runtime served whose answer had nowhere to go (its HTTP front-end
        worker's connection closed, and the client's with it) as dropped for ``reason``."""
        self.books.finish(name, "dropped", reason=reason)

    def settle(self, name: str, outputs: Any, error: BaseException | None, t0: float,
               rows: int) -> dict[str, np.ndarray]:
        """Book a finished request's outcome (its outputs, or the error the runtime answered it with;
        ``t0``: when it was submitted, ``time.perf_counter``) and return its outputs or raise
        ProtocolError."""
        svc = self.svc
        try:
            if error is not None:
                raise error
            out = outputs
        except svc.Expired as e:  # (a DeadlineExceeded the service answered itself: the runtime's books say so)
            self.books.finish(name, "dropped", reason="expired")
            raise ProtocolError(f"model {name!r}: deadline exceeded: {e}", 504) from None
        except svc.DeadlineExceeded as e:
            self.books.finish(name, "dropped", reason="deadline")
            raise ProtocolError(f"model {name!r}: deadline exceeded: {e}", 504) from None
        except svc.Dropped as e:
            reason = str(getattr(e, "reason", "") or "dropped")
            self.books.finish(name, "dropped", reason=reason)
            raise ProtocolError(f"model {name!r}: request dropped ({reason}): {e}", 503, retry_after_s=1.0) from None
        except svc.ModelFailed as e:
            self.books.finish(name, "failure")
            raise ProtocolError(f"model {name!r} failed: {e}", 500) from None
        except BaseException as e:  # anything else the runtime raised: still answered, still booked
            self.books.finish(name, "failure")
            log.exception("model %s: unexpected runtime error", name)
            raise ProtocolError(f"model {name!r}: internal error {type(e).__name__}: {e}", 500) from None
        self.books.finish(name, "success", rows=rows, us=(time.perf_counter() - t0) * 1e6)
        return out

    async def infer(self, name: str, version: str | None, inputs: Mapping[str, np.ndarray], deadline_ms: float | None,
                    waited_ms: float = 0.0):
        """Submit and await; returns ``{output name: ndarray}`` or raises ProtocolError."""
        t0 = time.perf_counter()
        fut, _ = self.submit(name, version, inputs, deadline_ms, waited_ms)
        rows = next(iter(inputs.values())).shape[0]
        try:
            await until_done(fut)
        except asyncio.CancelledError:  # the client gave up (a gRPC deadline or cancel): no one to answer
            if fut.done() and not fut.cancelled():  # answered just before: booked as the runtime booked it
                try:
                    self.outcome(name, fut, t0, rows)
                except ProtocolError:
                    pass
            else:  # its queued rows left the queue; the runtime books it "cancelled" too
                self.books.finish(name, "dropped", reason=self.svc.CANCELLED)
            raise
        except BaseException:
            pass  # the outcome is read (and booked) below
        return self.outcome(name, fut, t0, rows)

    # -- repository ------------------------------------------------------------------------------
    def _rescan(self) -> Repository | None:
        """The repository as on disk now (Triton re-reads it for the index and at each load): one
        model's bad entry only makes that model unavailable (``Repository.errors``). RepositoryError
        only when the repository cannot be read at all. Not under ``_repo_lock``: the index must not
        wait for a load's compile, and a scan replaced by a newer one is harmless."""
        if self.repository is None:
            return None
        self.repository = self.repository.reload()
        return self.repository

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model of the repository as on disk now (a model added since is listed, UNAVAILABLE
        until loaded), and every loaded one; an invalid entry is UNAVAILABLE with its mistake as the
        reason, as Triton lists a model that failed to load. ``ready_only``: the READY ones alone (the
        protocol's ``{"ready": true}``)."""
        repo = self.repository
        try:
            repo = self._rescan()
        except RepositoryError as e:
            log.warning("model repository cannot be read (the index shows it as last read): %s", e)
        errors = repo.errors if repo is not None else {}
        loaded = {c.name for c in self.service.models()}
        names = loaded | set(repo.models if repo is not None else {}) | set(errors)
        out = []
        for n in sorted(names):
            if n in loaded and self.ready(n):
                out.append({"name": n, "version": VERSION, "state": "READY"})
                continue
            if self._states.get(n) == "LOADING":
                out.append({"name": n, "version": VERSION, "state": "LOADING"})
                continue
            reason = errors.get(n) or self._reasons.get(n) or ("not ready" if n in loaded else "not loaded")
            out.append({"name": n, "version": VERSION, "state": "UNAVAILABLE", "reason": reason})
        return [m for m in out if m["state"] == "READY"] if ready_only else out

    def load(self, name: str) -> None:
        """(Re)load ``name`` from the repository (re-read from disk, its ``file.py`` re-executed);
        blocking. Only ``name``'s entry must be valid. When the new version fails to build or compile
        (entry, file, weights, factory, its sample run), a model already loaded under that name keeps
        serving (as Triton keeps the loaded version); once compiled, it replaces the old one
        (``InferenceService.reload``: the model's requests meanwhile are answered 503, retry)."""
        if self.repository is None:
            raise ProtocolError("this server has no model repository to load from", 400)
        self._refuse_when_closing("loading")
        with self._repo_lock:
            self._refuse_when_closing("loading")  # (a load queued behind another, past the stop)
            try:
                repo = self._rescan()
            except RepositoryError as e:
                raise ProtocolError(f"model repository cannot be read: {e}", 400) from None
            entry = self._entry(repo, name)
            self._states[name] = "LOADING"
            built = False
            try:
                config, module = entry.build()
                built = True
                self.service.reload(config, module)  # (a load where none is loaded)
            except (Exception, SystemExit) as e:  # (sys.exit in the model's forward, run at load: its fault)
                if self.closing:  # the service stopped under it: not the model's fault
                    self._states.pop(name, None)
                    raise ProtocolError(f"the server is shutting down; model {name!r} was not loaded", 503,
                                        retry_after_s=1.0) from None
                raise self._load_failed(name, e, entry, built=built) from None
            self._states[name] = "READY"
            self._reasons.pop(name, None)

    def load_all(self, names: Sequence[str]) -> None:
        """Load ``names`` (none loaded yet, as at a server's start) with one plan and one layout build:
        loaded one by one, each load re-plans and captures every loaded model's graphs again. Each
        model's entry is built (its file
        run, its weights read) first, one at a time: one that fails stops the load before anything
        is loaded, naming it. If the joint load fails, they are loaded one at a time, so that the
        model at fault is the one reported (and the ones before it serve)."""
        if self.repository is None:
            raise ProtocolError("this server has no model repository to load from", 400)
        if len(names) < 2:
            for n in names:
                self.load(n)
            return
        with self._repo_lock:
            try:
                repo = self._rescan()
            except RepositoryError as e:
                raise ProtocolError(f"model repository cannot be read: {e}", 400) from None
            built = []
            try:
                for name in names:
                    entry = self._entry(repo, name)
                    self._states[name] = "LOADING"
                    try:
                        built.append(entry.build())
                    except Exception as e:
                        raise self._load_failed(name, e, entry, built=False) from None
            except ProtocolError:
                for name in names[:len(built)]:  # built but never loaded: "not loaded" again, not LOADING
                    self._states.pop(name, None)
                raise
            try:
                self.service.load_many(built)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - attributed below, one model at a time
                log.info("loading %d models together failed (%s: %s); loading them one at a time", len(names),
                         type(e).__name__, e)
                fallback = True
            else:
                fallback = False
                for name in names:
                    self._states[name] = "READY"
                    self._reasons.pop(name, None)
        if fallback:
            for name in names:
                self.load(name)

    def _entry(self, repo: Any, name: str) -> Any:
        """``name``'s entry in the scanned ``repo``; its invalid entry (marked UNAVAILABLE) or its
        absence is the ProtocolError to answer."""
        if name in repo.errors:
            raise self._load_failed(name, RepositoryError(repo.errors[name]), None, built=False)
        entry = repo.models.get(name)
        if entry is None:
            invalid = f" (and invalid ones {sorted(repo.errors)})" if repo.errors else ""
            raise ProtocolError(f"model {name!r} is not in the repository; it has {repo.names()}{invalid}", 404)
        return entry

    async def in_own_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a daemon thread of its own, awaited: for the repository's loads and
        unloads, which take as long as a compile or a user's factory (minutes), or never end (one that
        hangs). In the event loop's default executor they queued the server's own drain behind them at
        a stop, and the process waited for them to end before it could exit (a SIGTERM held 44.6 s by a
        45 s factory; a review, sixty-ninth session). What ``fn`` raises is raised here; a SystemExit (a
        user's file calling ``sys.exit``) as a RuntimeError, so that it cannot end the server. At a stop
        (:meth:`abandon_waits`) the wait ends at once, answered 503; the thread is left to finish. At
        most ``MAX_ADMIN_THREADS`` run or wait at once; past them a call is answered 503 at once."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():  # abandoned at a stop, or its handler cancelled (its client went away)
                return
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

        def run() -> None:
            try:
                outcome = (fn(*args), None)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                outcome = (None, e)
            except BaseException as e:  # noqa: BLE001 - SystemExit: never the server's own exit from here
                outcome = (None, RuntimeError(f"{getattr(fn, '__name__', 'a call')} raised {type(e).__name__}: {e}"))
            finally:
                with self._admin_lock:
                    self._admin_threads -= 1
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

        with self._admin_lock:
            if self._admin_threads >= MAX_ADMIN_THREADS:  # (one hung load: every later call waits behind it)
                raise ProtocolError(f"{self._admin_threads} repository operations are under way or waiting for "
                                    f"one (at most {MAX_ADMIN_THREADS}); retry once they are done", 503,
                                    retry_after_s=5.0)
            self._admin_threads += 1
        self._waits.add(done)
        try:
            threading.Thread(target=run, name=f"gpuloom-{getattr(fn, '__name__', 'call')}", daemon=True).start()
            return await done
        finally:
            self._waits.discard(done)

    def abandon_waits(self) -> None:
        """On the event loop, at a stop: answer every repository call still waiting in
        :meth:`in_own_thread` with 503 (their threads go on; being daemons, they hold no exit)."""
        for done in list(self._waits):
            if not done.done():
                done.set_exception(ProtocolError("the server is shutting down; the operation was abandoned", 503,
                                                 retry_after_s=1.0))

    def _refuse_when_closing(self, what: str) -> None:
        """503 once the server stops: a load would hold its stop up (a factory of 45 s held a SIGTERM
        for 44.6 s) and then fail on a service no longer running."""
        if self.closing:
            raise ProtocolError(f"the server is shutting down; not {what} models", 503, retry_after_s=1.0)

    def _load_failed(self, name: str, e: BaseException, entry: Any, *, built: bool) -> ProtocolError:
        """Mark ``name`` unavailable with the cause, log it, and return the answer to raise.

        A mistake in the model is an ordinary event (400), logged as one ERROR line with the cause
        and, when it was raised in the model's own ``file.py``, where; its traceback only at DEBUG.
        That is anything raised while building it (its entry, weights, factory or forward), a
        ValueError or ServiceError of the runtime's load (the message says why), or any error
        raised in the user's file. Anything else is the server's fault: logged with its traceback,
        answered 500."""
        at = entry.raised_at(e) if entry is not None else None
        cause = f"{type(e).__name__}: {e}" + (f" (raised at {at})" if at else "")
        self._states[name] = "UNAVAILABLE"
        self._reasons[name] = f"load failed: {cause}"
        if not built or at is not None or isinstance(e, (ValueError, self.svc.ServiceError)):
            log.error("loading model %s failed: %s", name, cause)
            log.debug("loading model %s failed", name, exc_info=e)
            return ProtocolError(f"loading model {name!r} failed: {cause}", 400)
        log.error("loading model %s failed unexpectedly: %s", name, cause, exc_info=e)
        return ProtocolError(f"loading model {name!r} failed: internal error {cause}", 500)

    def unload(self, name: str) -> None:
        """Stop serving ``name``. As Triton, unloading a model of the repository that is not loaded
        succeeds and changes nothing (a client may unload without asking first). A name neither
        loaded nor in the repository is 404, as its load is (Triton answers success there too; a
        404 tells a mistyped name)."""
        self._refuse_when_closing("unloading")
        with self._repo_lock:
            loaded = sorted(c.name for c in self.service.models())
            if name not in loaded:
                repo = self.repository
                try:
                    repo = self._rescan()
                except RepositoryError:
                    pass  # as last read
                if repo is None or (name not in repo.models and name not in repo.errors):
                    has = f", the repository has {sorted(set(repo.models) | set(repo.errors))}" if repo else ""
                    raise ProtocolError(f"model {name!r} is neither loaded nor in the repository; loaded: {loaded}{has}",
                                        404)
                return
            self.service.unload(name)
            self._states[name] = "UNAVAILABLE"
            self._reasons[name] = "unloaded"

    # -- statistics ------------------------------------------------------------------------------
    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension shape, with gpuloom's books and runtime stats alongside.
        A version no model has is a 404, with a name or without (gRPC's ModelStatistics may ask for
        every model's statistics at one version; it used to get them all, whatever the version)."""
        if name is not None:
            self.config(name, version)
        elif version not in (None, "", VERSION):
            raise ProtocolError(f"no model has version {version!r}: every model has only version {VERSION} "
                                f"(leave the version out for every model's statistics)", 404)
        snap = self.books.snapshot()
        try:
            st = self.service.stats() or {}
        except Exception:
            st = {}
        st_models = st.get("models", {}) if isinstance(st.get("models"), dict) else {}
        names = [name] if name is not None else sorted(c.name for c in self.service.models())
        models = []
        for n in names:
            b = snap.get(n)
            sm = st_models.get(n, {})
            fail = (b.failure + sum(b.dropped.values())) if b else 0
            compute = _duration(sm.get("compute_ms"))
            models.append({
                "name": n,
                "version": VERSION,
                "last_inference": b.last_inference_ms if b else 0,
                "inference_count": b.inferences if b else 0,
                "execution_count": _exec_count(sm),
                "inference_stats": {
                    "success": {"count": b.success if b else 0, "ns": int((b.request_us if b else 0) * 1000)},
                    "fail": {"count": fail, "ns": 0},
                    "queue": _duration(sm.get("queue_ms")),
                    # the runtime times the whole batch (input copy, replay, output copy) as one, so all of
                    # it is compute_infer's; the input and output steps count the same requests with no
                    # time of their own (Triton counts each request in all three, and perf_analyzer
                    # refuses statistics whose three counts differ)
                    "compute_input": {"count": compute["count"], "ns": 0},
                    "compute_infer": compute,
                    "compute_output": {"count": compute["count"], "ns": 0},
                },
                "batch_stats": [],
                "gpuloom": {"books": b.as_dict() if b else {}, "runtime": sm},
            })
        return {"model_stats": models}
