"""Thin, checked wrappers over the CUDA driver's green-context API (``cuda.bindings.driver``).

Every call goes through ``_call``, which turns a failing ``CUresult`` into a ``DriverError`` naming
the call and the error. Nothing here touches torch; ``partition.py`` builds torch streams on top.

Facts this relies on (measured on an H200, driver 580, see ``docs/architecture.md``):

* ``cuDevSmResourceSplitByCount`` returns groups of exactly ``minCount`` SMs (a multiple of 8 on
  Hopper) plus a remainder; groups of one split are disjoint.
* A split's outputs cannot be split again directly; make a green context from the remainder, read
  its resource back (``cuGreenCtxGetDevResource``) and split that.
* Streams from ``cuGreenCtxStreamCreate`` run their kernels on the green context's SMs only.
* The SMs the co-scheduled splits leave over (TPCs 38, 45, 52, 59-65 on the H200 measured) run
  cuDNN convolutions 1.4-1.7x slower than their count; matrix products run at their count
  (``scripts/diag_carvings.py``, run 41). Whoever takes the remainder gets them.
* A remainder is "unstructured" (no co-scheduling guarantee). Splitting one with the default
  flags gave groups short of the count asked (6 SMs for 8, 14 for 16; 10 for 16 off an 84-SM
  remainder, 12 for 16 off 60: run 41), or 8-SM groups where cuDNN
  convolutions fail with ``CUDNN_STATUS_EXECUTION_FAILED_CUDART``; with
  ``CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING`` every group had its count and every model ran
  (``scripts/diag_partition_cudnn.py``, ``docs/results/runtime/diag_partition_h200.json``). But the
  same flag on every remainder of another layout made a 24-SM partition where cuDNN failed while
  capturing, which the default flags had run: no one flag is safe, so the runtime tries both.
* Workqueues (the hardware queues work is submitted through; ``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by
  default) are shared by every context unless a green context is created with a workqueue
  configuration of scope "balanced" (CUDA 13.1+ drivers): the driver's documentation warns that
  green contexts with disjoint SMs may still wait on each other through them. Measured: yes, with 8
  (gpu/connections.py asks for 32); "balanced" is refused by driver 580 (CUDA_ERROR_INVALID_RESOURCE_TYPE).
"""

from __future__ import annotations

from typing import Any

from .errors import BindingsMissingError, DriverError


def driver() -> Any:
    """The ``cuda.bindings.driver`` module, or ``BindingsMissingError`` saying how to install it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:  # pragma: no cover - exercised by monkeypatching in tests
        raise BindingsMissingError(
            "SM partitions (green contexts) need the CUDA driver bindings: pip install cuda-bindings "
            "(or pip install 'gpuloom[gpu]'); found none: " + str(e)
        ) from e
    return cu


def _call(cu: Any, name: str, *args: Any) -> Any:
    """Call ``cu.<name>(*args)``; raise ``DriverError`` unless it returns CUDA_SUCCESS; return the rest."""
    out = getattr(cu, name)(*args)
    err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if int(err) != 0:
        try:
            _, ename = cu.cuGetErrorName(err)
            ename = ename.decode() if isinstance(ename, bytes) else str(ename)
        except Exception:  # noqa: BLE001 - best effort naming of the error
            ename = str(err)
        shown = ", ".join(_short(a) for a in args)
        raise DriverError(f"{name}({shown}) failed with {ename}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _short(a: Any) -> str:
    sm = getattr(a, "sm", None)
    if sm is not None:
        return f"<SM resource: {sm.smCount} SMs>"
    r = repr(a)
    return r if len(r) < 40 else r[:37] + "..."


class GreenDriver:
    """The driver calls gpuloom needs, bound to one device. Create after torch has initialized CUDA."""

    def __init__(self, device: int = 0) -> None:
        self.cu = cu = driver()
        _call(cu, "cuInit", 0)
        self.dev = _call(cu, "cuDeviceGet", device)
        self.SM = cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        flags = cu.CUdevSmResourceSplitByCount_flags
        #: split flag for a remainder: treat its SMs one by one (see the module docstring)
        self.IGNORE_COSCHEDULING = int(flags.CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING)

    def device_resource(self) -> Any:
        """The SM resource of the whole device."""
        return _call(self.cu, "cuDeviceGetDevResource", self.dev, self.SM)

    def split(self, resource: Any, groups: int, sms: int, flags: int = 0) -> tuple[list[Any], Any]:
        """Split ``groups`` groups of ``sms`` SMs off ``resource``: (the groups made, remainder)."""
        result, n, remainder = _call(self.cu, "cuDevSmResourceSplitByCount", groups, resource, flags, sms)
        return list(result)[: int(n)], remainder

    def workqueue_config(self, scope: str = "balanced", share: int = 1) -> Any:
        """A workqueue configuration resource to create green contexts with. ``"balanced"``: when
        possible, workqueues not shared with other balanced green contexts, each of ``share``
        contexts asking for its part of the device's connections (the driver guarantees no overlap
        only while the limits add up to at most that many); ``"shared"``: the driver's default, every
        context on the device's workqueues. ``DriverError`` where the bindings or the driver have no
        workqueue resources (before CUDA 13.1)."""
        cu = self.cu
        kind = getattr(cu.CUdevResourceType, "CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG", None)
        scopes = getattr(cu, "CUdevWorkqueueConfigScope", None)
        if kind is None or scopes is None:
            raise DriverError("these cuda-bindings have no workqueue resources (cuda-bindings >= 13.1 needed)")
        if scope not in ("balanced", "shared"):
            raise ValueError(f"workqueue scope: expected 'balanced' or 'shared', got {scope!r}")
        res = _call(cu, "cuDeviceGetDevResource", self.dev, kind)
        res.wqConfig.sharingScope = (scopes.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED if scope == "balanced"
                                     else scopes.CU_WORKQUEUE_SCOPE_DEVICE_CTX)
        if scope == "balanced":  # the device's limit is CUDA_DEVICE_MAX_CONNECTIONS (8 unless set)
            res.wqConfig.wqConcurrencyLimit = max(1, int(res.wqConfig.wqConcurrencyLimit) // max(1, share))
        return res

    def create(self, resource: Any, workqueue: Any = None) -> Any:
        """A green context over ``resource`` (with its own default stream), and with ``workqueue``'s
        configuration (:meth:`workqueue_config`) if given."""
        resources = [resource] if workqueue is None else [resource, workqueue]
        desc = _call(self.cu, "cuDevResourceGenerateDesc", resources, len(resources))
        flag = self.cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        return _call(self.cu, "cuGreenCtxCreate", desc, self.dev, int(flag))

    def resource_of(self, ctx: Any) -> Any:
        return _call(self.cu, "cuGreenCtxGetDevResource", ctx, self.SM)

    def sm_count_of(self, ctx: Any) -> int:
        return int(self.resource_of(ctx).sm.smCount)

    def stream(self, ctx: Any, priority: int = 0) -> Any:
        """A non-blocking stream whose kernels run on ``ctx``'s SMs only."""
        flag = self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        return _call(self.cu, "cuGreenCtxStreamCreate", ctx, int(flag), priority)

    def sync_stream(self, stream: Any) -> None:
        _call(self.cu, "cuStreamSynchronize", stream)

    def destroy_stream(self, stream: Any) -> None:
        _call(self.cu, "cuStreamDestroy", stream)

    def destroy(self, ctx: Any) -> None:
        _call(self.cu, "cuGreenCtxDestroy", ctx)
