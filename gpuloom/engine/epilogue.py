"""A convolution's epilogue in one kernel: bias (+ residual) + activation (compile's ``fuse_epilogues``).

Why: PyTorch's cuDNN path adds a convolution's bias with a kernel of its own, and a folded BatchNorm
gives every convolution a bias. cuDNN's fused convolutions (``fold.fuse_convolutions``) end in a ReLU
only, so EfficientNet's SiLU and sigmoid, MobileNet's ReLU6 and the linear bottlenecks' residual adds
ran two or three small kernels after each convolution. On the H200 at batch 1 float32 (run 134,
``scripts/diag_op_breakdown.py``) efficientnet_b0's graph ran 260 kernels for 189 operators, a
quarter of them bias adds: 0.117 ms of its 0.646 ms of kernels, and a ~0.5 us gap before each.

:func:`bias_act` does ``act((y + bias) [+ residual])`` in one pass over ``y`` with a Triton kernel
on CUDA (one program per 1,024 elements; the channel of an element from its offset, for NCHW and
NHWC alike), rounding to the tensor's dtype after each add as eager does. Elsewhere (the CPU, a
layout the kernel does not take, no Triton) it runs the same ops as eager, one by one.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

ACTIVATIONS = ("none", "relu6", "silu", "sigmoid")
_ACT_CODE = {a: i for i, a in enumerate(ACTIVATIONS)}
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what gpuloom's Triton kernels take
_BLOCK = 1024


def reference(y: torch.Tensor, bias: torch.Tensor, act: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The eager ops: bias added per channel (dimension 1), then the residual, then the activation."""
    v = y + bias.view(1, -1, *([1] * (y.dim() - 2)))
    if residual is not None:
        v = v + residual
    if act == "relu6":
        return torch.nn.functional.hardtanh(v, 0.0, 6.0)
    if act == "silu":
        return torch.nn.functional.silu(v)
    if act == "sigmoid":
        return torch.sigmoid(v)
    return v


class KernelGuard:
    """Runs a fused kernel's launch, and eager's ops for good once it has failed.

    A GPU Triton cannot compile for (or any other failure to build or launch) must not stop a model:
    the first failure is logged and every later call runs eager's ops, at eager's speed. A failure
    inside a CUDA graph capture is raised (the warm-ups before it launched the same kernel)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failed = False

    def __call__(self, launch, eager, tensor: torch.Tensor):
        if not self.failed:
            try:
                return launch()
            except Exception as e:  # noqa: BLE001 - eager's ops compute the same
                if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                self.failed = True
                log.warning("gpuloom.engine: the fused %s kernel failed (%s: %s); eager's ops run instead "
                            "from now on", self.what, type(e).__name__, e)
        return eager()


_guard = KernelGuard("convolution epilogue")


def bias_act(y: torch.Tensor, bias: torch.Tensor, act: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act((y + bias) [+ residual])``: one kernel on CUDA where it applies (see the module), eager's
    ops elsewhere. A kernel that fails is logged once and eager's ops run from then on (:class:`KernelGuard`)."""
    if _on_gpu(y) and _fits(y, bias, residual):
        kernel = _kernel()
        if kernel is not None:
            return _guard(lambda: _launch(kernel, y, bias, act, residual), lambda: reference(y, bias, act, residual), y)
    return reference(y, bias, act, residual)


def _launch(kernel, y: torch.Tensor, bias: torch.Tensor, act: str, residual: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty_like(y)
    n = y.numel()
    kernel[(-(-n // _BLOCK),)](
        y, bias, residual if residual is not None else y, out, n, y.shape[1], y.stride(1),
        ACT=_ACT_CODE[act], HAS_RESIDUAL=residual is not None, BLOCK=_BLOCK, num_warps=4)
    return out


def _on_gpu(y: torch.Tensor) -> bool:
    return y.is_cuda


def available() -> bool:
    """Whether the one-kernel path exists here (Triton imports and CUDA is up)."""
    return torch.cuda.is_available() and _kernel() is not None


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _fits(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """The kernel's assumptions: a dense map of two or more dimensions, its channel dimension 1, one contiguous
    bias per channel, a residual laid out as ``y`` is, one dtype, offsets within int32."""
    if y.dtype not in KERNEL_DTYPES or y.dim() < 2 or y.numel() == 0 or y.numel() >= 2**31 or not _dense(y):
        return False
    if bias.dtype != y.dtype or bias.dim() != 1 or bias.numel() != y.shape[1] or not bias.is_contiguous():
        return False
    if bias.device != y.device:
        return False
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype
                                 or residual.stride() != y.stride() or residual.device != y.device):
        return False
    return True


@functools.cache
def _kernel():
    """The Triton kernel, built on first use; None where Triton does not import (a CPU-only torch)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: the eager ops run instead
        return None

    @triton.jit(do_not_specialize=["n", "channels", "channel_stride"])
    def _bias_act_kernel(y_ptr, b_ptr, r_ptr, out_ptr, n, channels, channel_stride,
                         ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(y_ptr + offs, mask=mask)
        c = (offs // channel_stride) % channels
        b = tl.load(b_ptr + c, mask=mask)
        # rounded to the tensor's dtype after each add, as eager's separate kernels store it
        v = (y.to(tl.float32) + b.to(tl.float32)).to(y.dtype)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + offs, mask=mask)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(y.dtype)
        w = v.to(tl.float32)
        if ACT == 1:
            w = tl.minimum(tl.maximum(w, 0.0), 6.0)
        elif ACT == 2:
            w = w / (1.0 + tl.exp(-w))
        elif ACT == 3:
            w = 1.0 / (1.0 + tl.exp(-w))
        tl.store(out_ptr + offs, w.to(y.dtype), mask=mask)

    return _bias_act_kernel
