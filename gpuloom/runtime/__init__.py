"""Request queues and the event loop that drives a policy; backends that execute its decisions.

Pure Python except a future GPU backend (issue 5), which will import torch lazily.
"""

from ..policy.types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status
from .backend import Backend
from .core import RunRecord, Runtime
from .events import EventLoop
from .sim import ContentionModel, SimBackend

__all__ = [
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
