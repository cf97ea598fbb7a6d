"""A small stand-in for ``gpuloom.runtime.service.InferenceService`` (same interface) for server tests.

It runs each request's torch module directly on one worker thread (no batching, no policy): enough to
exercise the server's protocol, books, overload and shutdown paths. If the real module exists its
types and errors are used, so the server's ``except svc.X`` clauses match; otherwise an equivalent
stub module is installed under the real name.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time
import types
from dataclasses import dataclass



def _install_stub():
    mod = types.ModuleType("gpuloom.runtime.service")

    @dataclass(frozen=True)
    class TensorSpec:
        name: str
        shape: tuple
        dtype: str

    @dataclass(frozen=True)
    class ModelConfig:
        name: str
        inputs: tuple
        outputs: tuple
        max_batch: int = 32
        slo_ms: float = 100.0
        weight: float = 1.0
        rate_hint: float = 50.0

        @property
        def output_names(self):
            return tuple(t.name for t in self.outputs)

    class ServiceError(Exception):
        pass

    class UnknownModel(ServiceError):
        pass

    class ModelNotReady(ServiceError):
        pass

    class InvalidInput(ServiceError):
        pass

    class Overloaded(ServiceError):
        def __init__(self, msg="", retry_after_s=0.1):
            super().__init__(msg)
            self.retry_after_s = retry_after_s

    class DeadlineExceeded(ServiceError):
        pass

    class Expired(DeadlineExceeded):
        pass

    class Dropped(ServiceError):
        def __init__(self, reason="dropped"):
            super().__init__(reason)
            self.reason = reason

    class ModelFailed(ServiceError):
        pass

    mod.CANCELLED = "cancelled"
    for k, v in list(locals().items()):
        if isinstance(v, type):
            v.__module__ = mod.__name__
            setattr(mod, k, v)
    sys.modules[mod.__name__] = mod
    import gpuloom.runtime as rt

    rt.service = mod
    return mod


try:
    import gpuloom.runtime.service as svc  # noqa: F401
except ImportError:
    svc = _install_stub()


class FakeService:
    """Same methods as InferenceService; one worker thread; ``delay_s`` slows every execution."""

    def __init__(self, *, queue_limit: int = 1024, delay_s: float = 0.0, **_):
        self.queue_limit = queue_limit
        self.delay_s = delay_s
        self._models: dict = {}
        self._pool = cf.ThreadPoolExecutor(1)
        self._lock = threading.Lock()
        self._pending = 0
        self._live = False
        self._closed = False
        self._pend_futs: set = set()
        self.counts: dict = {}

    def start(self):
        self._live = True

    def is_live(self):
        return self._live and not self._closed

    def load(self, config, module):
        with self._lock:
            self._models[config.name] = (config, module)

    def load_many(self, models):
        for config, module in models:
            self.load(config, module)

    def reload(self, config, module):
        self.load(config, module)  # (a new version replaces the old at once)

    def unload(self, name):
        with self._lock:
            if name not in self._models:
                raise svc.UnknownModel(name)
            del self._models[name]

    def models(self):
        with self._lock:
            return [c for c, _ in self._models.values()]

    def config(self, name):
        entry = self._models.get(name)
        return entry[0] if entry is not None else None

    def ready(self, name):
        return name in self._models and not self._closed

    def submit(self, name, inputs, *, deadline_ms=None, waited_ms=0.0, checked_for=None,  # (neither modelled here)
               on_done=None):
        import torch

        with self._lock:
            if self._closed:
                raise svc.ModelNotReady("closing")
            if name not in self._models:
                raise svc.UnknownModel(name)
            config, module = self._models[name]
            if self._pending >= self.queue_limit:
                raise svc.Overloaded(f"{self._pending} queued", retry_after_s=0.2)
            self._pending += 1
        deadline = time.monotonic() + (deadline_ms if deadline_ms is not None else config.slo_ms * 100) / 1000.0
        outer: cf.Future = cf.Future()

        def run():
            try:
                if self._closed and not self._drain:
                    raise svc.Dropped("shutdown")
                if time.monotonic() > deadline:
                    raise svc.DeadlineExceeded(f"waited past {deadline_ms} ms")
                time.sleep(self.delay_s)
                xs = [torch.from_numpy(inputs[t.name]) for t in config.inputs]
                try:
                    with torch.no_grad():
                        out = module(*xs)
                except Exception as e:
                    raise svc.ModelFailed(f"{type(e).__name__}: {e}") from e
                if isinstance(out, dict):
                    vals = [out[t.name] for t in config.outputs]
                elif isinstance(out, (tuple, list)):
                    vals = list(out)
                else:
                    vals = [out]
                outer.set_result({t.name: v.numpy() for t, v in zip(config.outputs, vals)})
            except BaseException as e:
                outer.set_exception(e)
            finally:
                with self._lock:
                    self._pending -= 1
                    self.counts[name] = self.counts.get(name, 0) + 1

        if on_done is not None:  # the service's callback instead of a future (the HTTP workers' bridge)
            outer.add_done_callback(
                lambda f: on_done(None, f.exception()) if f.exception() else on_done(f.result(), None))
        self._pool.submit(run)
        return None if on_done is not None else outer

    _drain = True

    def close(self, *, drain=True, timeout_s=30):
        with self._lock:
            self._closed = True
            self._drain = drain
        self._pool.shutdown(wait=True)

    def stats(self):
        return {
            "models": {n: {"success": self.counts.get(n, 0),
                           "queue_ms": {"bounds": [1.0, 10.0], "counts": [1, 0, 0], "sum": 0.5, "count": 1},
                           "compute_ms": {"bounds": [1.0, 10.0], "counts": [0, 1, 0], "sum": 2.0, "count": 1},
                           "batch_size": {"1": self.counts.get(n, 0)}, "goodput_rps": 1.0, "slo_attainment": 1.0}
                       for n in self._models},
            "partitions": [{"index": 0, "label": "cpu", "sms": 0, "busy_ratio": 0.5}],
        }


# -- helpers shared by the serve tests ------------------------------------------------------------
def real_service_available() -> bool:
    return hasattr(svc, "InferenceService")


def make_service(*, queue_limit: int = 1024, fake_delay_s: float = 0.0):
    """The real InferenceService on CPU once it exists, else the fake; started."""
    if real_service_available():
        s = svc.InferenceService(policy="dstack", device="cpu", queue_limit=queue_limit)
    else:
        s = FakeService(queue_limit=queue_limit, delay_s=fake_delay_s)
    s.start()
    return s


#: how a test server parses HTTP: in the runtime's process, by two front-end workers, or in the
#: runtime's process with the runtime's loop on the HTTP event loop (a fixture's params and ids)
SERVER_VARIANTS = [0, 2, "runtime-on-http"]
SERVER_VARIANT_IDS = ["in-process-http", "2-http-workers", "runtime-on-http"]


def server_variant(param) -> dict:
    """``Server`` keyword arguments for one of :data:`SERVER_VARIANTS`."""
    if param == "runtime-on-http":
        return {"http_workers": 0, "runtime_on": "http"}
    return {"http_workers": param, "runtime_on": "thread"}


_SLEEP_OP = []


def _sleep_twice_op():
    """``torch.ops.gpuloom_tests.sleep_twice(x, delay_s)``: sleeps, returns 2x. A custom operator, so
    that the sleep survives compilation: a ``time.sleep`` in ``forward`` runs only while the model is
    traced (the compiled model then answered in about 2 ms, and the tests built on it had nothing
    queued when they stopped or overloaded the server)."""
    if not _SLEEP_OP:
        import torch

        @torch.library.custom_op("gpuloom_tests::sleep_twice", mutates_args=(), schema="(Tensor x, float delay_s) -> Tensor")
        def sleep_twice(x: torch.Tensor, delay_s: float) -> torch.Tensor:
            time.sleep(delay_s)
            return x * 2

        @sleep_twice.register_fake
        def _(x, delay_s):
            return torch.empty_like(x)

        _SLEEP_OP.append(torch.ops.gpuloom_tests.sleep_twice)
    return _SLEEP_OP[0]


def slow_net(delay_s: float = 0.05, features: int = 4):
    """A module that sleeps ``delay_s`` per call, compiled or not, and returns 2x its input (for
    overload/shutdown tests)."""
    import torch

    op = _sleep_twice_op()

    class SlowNet(torch.nn.Module):
        def forward(self, x):
            return op(x, delay_s)

    cfg = svc.ModelConfig(
        name="slow", inputs=(svc.TensorSpec("x", (features,), "float32"),),
        outputs=(svc.TensorSpec("y", (features,), "float32"),), max_batch=4, slo_ms=5000.0,
    )
    return cfg, SlowNet()
