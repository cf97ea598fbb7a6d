"""Errors of the GPU layer.

User mistakes (an impossible partition layout) are ``ValueError`` subclasses; a missing GPU or
missing bindings are ``RuntimeError`` subclasses that say what is needed and how to get it.
"""

from __future__ import annotations


class PartitionError(ValueError):
    """A partition layout the device cannot provide (sum over the device, size off the granularity)."""


class GpuError(RuntimeError):
    """Base class of GPU-side failures (no GPU, missing bindings, a failing driver call)."""


class NoGpuError(GpuError):
    """A GPU-only feature was asked for on a machine without a usable CUDA GPU."""


class BindingsMissingError(GpuError):
    """``cuda.bindings`` (the CUDA driver API for Python) is not installed."""


class DriverError(GpuError):
    """A CUDA driver call failed; the message names the call, the error and the arguments."""
