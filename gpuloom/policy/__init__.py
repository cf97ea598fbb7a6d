"""Online scheduling policies: dstack and the baselines, chosen by name.

``make_policy("triton", instances=2)`` builds one; ``policy_names()`` lists them. Every policy is
plain Python (no torch) and runs unchanged against the simulated and the GPU backend.
"""

from . import dstack, triton, clipper, nexus, gslice, temporal, ideal  # noqa: F401,I001  (register, in this order)
from .base import ModelInfo, Policy, PolicyContext, PolicyError, make_policy, policy_names, register
from .types import Completion, Decision, Drop, Layout, Partition, Request, Result, Status

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
