"""Online scheduling policies: dstack and the baselines, chosen by name.

``make_policy("triton", instances=2)`` builds one; ``policy_names()`` lists them. Every policy is
plain Python (no torch) and runs unchanged against the simulated and the GPU backend.
"""

from . import clipper, gslice, ideal, nexus, temporal, triton  # noqa: F401  (register)
from .base import ModelInfo, Policy, PolicyContext, PolicyError, make_policy, policy_names, register
from .types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status

try:  # dstack needs the planner (gpuloom.plan); keep the baselines usable while it lands
    from . import dstack  # noqa: F401
except ImportError as _e:  # pragma: no cover - only while gpuloom.plan is incomplete
    import logging

    logging.getLogger(__name__).warning("dstack policy unavailable: %s", _e)

__all__ = [
    "Completion",
    "Decision",
    "Drop",
    "Layout",
    "ModelInfo",
    "Partition",
    "Policy",
    "PolicyContext",
    "PolicyError",
    "Request",
    "Result",
    "Status",
    "make_policy",
    "policy_names",
    "register",
]
