"""Request queues and the event loop that drives a policy; backends that execute its decisions.

Pure Python at import. The execution backend (``ExecBackend``, device layers) and the online
``InferenceService`` are imported lazily on first use (they need numpy; the CPU/CUDA device layers
import torch when constructed).
"""

from ..policy.types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status
from .backend import Backend
from .core import RunRecord, Runtime
from .events import EventLoop
from .sim import ContentionModel, SimBackend

_LAZY = {
    "ExecBackend": "exec_backend",
    "ExecOutput": "exec_backend",
    "DeviceLayer": "device",
    "CpuDeviceLayer": "host_device",
    "CudaDeviceLayer": "cuda_device",
    "FakeDeviceLayer": "host_device",
    "GraphMemoryError": "device",
    "InferenceService": "service",
    "ModelConfig": "service",
    "TensorSpec": "service",
    "ServiceError": "service",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


__all__ = [
    *_LAZY,
    "Backend",
    "Completion",
    "ContentionModel",
    "Decision",
    "Drop",
    "EventLoop",
    "Layout",
    "Partition",
    "Request",
    "Result",
    "RunRecord",
    "Runtime",
    "SimBackend",
    "Status",
]
