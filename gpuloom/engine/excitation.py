"""A squeeze-and-excitation gate in one kernel (compile's ``fuse_gates``, ``fold.fuse_gates``).

Why: EfficientNet's and MobileNetV3's blocks scale their channels by a gate computed from the pooled
map: ``act2(conv2(act1(conv1(pooled))))`` where ``pooled`` is ``[N, C, 1, 1]`` and both convolutions
are 1x1, so each is a small matrix-vector product. Eager (and the graph after ``fuse_epilogues``)
runs them as four kernels per block, two GEMVs and two epilogues of a few microseconds each with a
launch gap before each; efficientnet_b0 has sixteen such blocks, 64 of its 205 kernels at batch 1
on the H200 (run 136, ``scripts/diag_op_breakdown.py``).

:func:`gate` computes the same in one Triton kernel: one program per (sample, block of output
channels) computes the hidden vector from the pooled one (a few thousand multiply-adds, recomputed by
each program rather than synchronising the grid) and then its block of gates. Values are rounded to
the dtype after each step as eager's separate kernels store them. Elsewhere (the CPU, a shape or
layout the kernel does not take, no Triton) it runs eager's ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .epilogue import KernelGuard

HIDDEN_ACTIVATIONS = ("relu", "silu")
GATE_ACTIVATIONS = ("sigmoid", "hardsigmoid")
_CODE = {"relu": 0, "silu": 1, "sigmoid": 0, "hardsigmoid": 1}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 512  # hidden widths up to this fit one program's registers (EfficientNet-B7's widest is 160)
_TILE = 8192  # elements of a weight tile per program step
_guard = KernelGuard("squeeze-excitation gate")


def _act(v: torch.Tensor, act: str) -> torch.Tensor:
    return {"relu": F.relu, "silu": F.silu, "sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}[act](v)


def reference(pooled: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
              act1: str, act2: str) -> torch.Tensor:
    """Eager's ops: 1x1 convolution, hidden activation, 1x1 convolution, gate activation."""
    return _act(F.conv2d(_act(F.conv2d(pooled, w1, b1), act1), w2, b2), act2)


def gate(pooled: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
         act1: str, act2: str) -> torch.Tensor:
    """``act2(conv2d(act1(conv2d(pooled, w1, b1)), w2, b2))`` for a pooled ``[N, C, 1, 1]`` map and 1x1
    weights: one kernel on CUDA where it applies (see the module), eager's ops elsewhere. A kernel that
    fails is logged once and eager's ops run from then on (``epilogue.KernelGuard``)."""
    if _on_gpu(pooled) and _fits(pooled, w1, b1, w2, b2):
        kernel = _kernel()
        if kernel is not None:
            return _guard(lambda: _launch(kernel, pooled, w1, b1, w2, b2, act1, act2),
                          lambda: reference(pooled, w1, b1, w2, b2, act1, act2), pooled)
    return reference(pooled, w1, b1, w2, b2, act1, act2)


def _blocks(hidden: int) -> tuple[int, int, int]:
    """(hidden padded to a power of two, input channels per step, output channels per program)."""
    hidden_pad = max(16, 1 << (hidden - 1).bit_length())
    block = max(16, min(128, _TILE // hidden_pad))
    return hidden_pad, block, block


def _launch(kernel, pooled, w1, b1, w2, b2, act1: str, act2: str) -> torch.Tensor:
    n, c = pooled.shape[:2]
    hidden, out_channels = w1.shape[0], w2.shape[0]
    out = torch.empty((n, out_channels, 1, 1), dtype=pooled.dtype, device=pooled.device)
    hidden_pad, block_k, block_o = _blocks(hidden)
    grid = (n, -(-out_channels // block_o))
    kernel[grid](pooled, w1, b1, w2, b2, out, c, hidden, out_channels, pooled.stride(0),
                 ACT1=_CODE[act1], ACT2=_CODE[act2], HIDDEN_PAD=hidden_pad, BLOCK_K=block_k, BLOCK_O=block_o,
                 num_warps=4)
    return out


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _rows(w: torch.Tensor, rows: int, cols: int) -> bool:
    """``w`` is a ``[rows, cols, 1, 1]`` weight whose rows are dense (NCHW and NHWC alike)."""
    return (w.dim() == 4 and tuple(w.shape) == (rows, cols, 1, 1)
            and (rows == 1 or w.stride(0) == cols) and (cols == 1 or w.stride(1) == 1))


def _fits(pooled, w1, b1, w2, b2) -> bool:
    """The kernel's assumptions: a ``[N, C, 1, 1]`` map with dense channels, 1x1 weights with dense
    rows and contiguous biases that chain (C -> hidden -> C'), one dtype and device, hidden <= 512."""
    if pooled.dtype not in _DTYPES or pooled.dim() != 4 or tuple(pooled.shape[2:]) != (1, 1) or pooled.numel() == 0:
        return False
    c, hidden = pooled.shape[1], w1.shape[0] if w1.dim() == 4 else -1
    if hidden < 1 or hidden > _MAX_HIDDEN or (c > 1 and pooled.stride(1) != 1) or w2.dim() != 4:
        return False
    if not (_rows(w1, hidden, c) and _rows(w2, w2.shape[0], hidden)):
        return False
    for b, size in ((b1, hidden), (b2, w2.shape[0])):
        if b.dim() != 1 or b.numel() != size or not b.is_contiguous():
            return False
    return all(t.dtype == pooled.dtype and t.device == pooled.device for t in (w1, b1, w2, b2))


@functools.cache
def _kernel():
    """The Triton kernel, built on first use; None where Triton does not import (a CPU-only torch)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: the eager ops run instead
        return None

    @triton.jit(do_not_specialize=["channels", "hidden", "out_channels", "sample_stride"])
    def _gate_kernel(p_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, channels, hidden, out_channels, sample_stride,
                     ACT1: tl.constexpr, ACT2: tl.constexpr, HIDDEN_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_O: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        n = tl.program_id(0)
        r = tl.arange(0, HIDDEN_PAD)
        r_ok = r < hidden
        acc = tl.zeros([HIDDEN_PAD], dtype=tl.float32)
        for k0 in range(0, channels, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < channels
            p = tl.load(p_ptr + n * sample_stride + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w1_ptr + r[:, None] * channels + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * p[None, :], axis=1)
        b1 = tl.load(b1_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        h = (acc.to(dtype).to(tl.float32) + b1).to(dtype).to(tl.float32)
        if ACT1 == 0:
            h = tl.maximum(h, 0.0)
        else:
            h = h / (1.0 + tl.exp(-h))
        h = tl.where(r_ok, h.to(dtype).to(tl.float32), 0.0)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = o < out_channels
        w2 = tl.load(w2_ptr + o[:, None] * hidden + r[None, :], mask=o_ok[:, None] & r_ok[None, :], other=0.0)
        g = tl.sum(w2.to(tl.float32) * h[None, :], axis=1)
        b2 = tl.load(b2_ptr + o, mask=o_ok, other=0.0).to(tl.float32)
        g = (g.to(dtype).to(tl.float32) + b2).to(dtype).to(tl.float32)
        if ACT2 == 0:
            g = 1.0 / (1.0 + tl.exp(-g))
        else:
            g = tl.minimum(tl.maximum(g + 3.0, 0.0), 6.0) / 6.0
        tl.store(out_ptr + n * out_channels + o, g.to(dtype), mask=o_ok)

    return _gate_kernel
