"""A squeeze-and-excitation block's gate in two kernels (compile's ``fuse_gates``, ``fold.fuse_gates``).

Why: EfficientNet's and MobileNetV3's blocks scale their channels by a gate computed from the pooled
map: ``x * act2(conv2(act1(conv1(pool(x)))))``, both convolutions 1x1 on a ``[N, C, 1, 1]`` map (a
matrix-vector product per sample). Eager, and the graph after ``fuse_epilogues``, runs that as six
kernels per block (pool, GEMV, epilogue, GEMV, epilogue, multiply) of a few microseconds each with a
launch gap before each; efficientnet_b0 has sixteen such blocks (run 136, ``scripts/diag_op_breakdown.py``).

Here the pool stays ATen's, and two Triton kernels do the rest:

* :func:`hidden`: ``act1(conv1(pooled))``, one program per sample and pair of hidden channels, so the
  first weight (EfficientNet-B5's largest: 3072 x 128) is read by many SMs at once. (One program per
  sample computing the whole gate read it with one SM each: 0.81-0.93x slower than eager's GEMVs,
  engine run 139.)
* :func:`excite`: ``x * act2(conv2(h))``: one program per sample, block of channels and block of
  pixels, each computing its channels' gates from ``h`` (a few thousand multiply-adds) and scaling its
  tile of ``x``, NCHW or NHWC.

Values are rounded to the dtype after each step as eager's separate kernels store them. Elsewhere
(the CPU, a shape or layout the kernels do not take, no Triton) each runs eager's ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .epilogue import KERNEL_DTYPES, KernelGuard

HIDDEN_ACTIVATIONS = ("relu", "silu")
GATE_ACTIVATIONS = ("sigmoid", "hardsigmoid")
_CODE = {"relu": 0, "silu": 1, "sigmoid": 0, "hardsigmoid": 1}
_MAX_HIDDEN = 512  # excite's programs hold a [channels, hidden] tile of the second weight
_HIDDEN_ROWS, _HIDDEN_K = 2, 512  # hidden's tile: rows of the first weight x input channels per step
_EXCITE_C, _EXCITE_HW = 32, 64  # excite's tile of x: channels x pixels
_guard = KernelGuard("squeeze-excitation")


def _act(v: torch.Tensor, act: str) -> torch.Tensor:
    return {"relu": F.relu, "silu": F.silu, "sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}[act](v)


def hidden_reference(pooled: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, act1: str) -> torch.Tensor:
    """Eager's ops: the 1x1 convolution, then the hidden activation."""
    return _act(F.conv2d(pooled, w1, b1), act1)


def excite_reference(x: torch.Tensor, h: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, act2: str) -> torch.Tensor:
    """Eager's ops: the 1x1 convolution, the gate activation, then ``x`` scaled by the gate."""
    return x * _act(F.conv2d(h, w2, b2), act2)


def hidden(pooled: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, act1: str) -> torch.Tensor:
    """``act1(conv2d(pooled, w1, b1))`` for a pooled ``[N, C, 1, 1]`` map and a 1x1 weight: one kernel on
    CUDA where it applies (see the module), eager's ops elsewhere or once a kernel has failed."""
    if _on_gpu(pooled) and _pooled(pooled) and _weight_fits(w1, b1, pooled, pooled.shape[1]):
        kernels = _kernels()
        if kernels is not None:
            return _guard(lambda: _launch_hidden(kernels[0], pooled, w1, b1, act1),
                          lambda: hidden_reference(pooled, w1, b1, act1), pooled)
    return hidden_reference(pooled, w1, b1, act1)


def excite(x: torch.Tensor, h: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, act2: str) -> torch.Tensor:
    """``x * act2(conv2d(h, w2, b2))`` for a ``[N, C, H, W]`` map ``x``, the hidden ``[N, R, 1, 1]`` map
    ``h`` and a 1x1 weight ``[C, R, 1, 1]``: one kernel on CUDA where it applies (see the module),
    eager's ops elsewhere or once a kernel has failed."""
    if _on_gpu(x) and _excite_fits(x, h, w2, b2):
        kernels = _kernels()
        if kernels is not None:
            return _guard(lambda: _launch_excite(kernels[1], x, h, w2, b2, act2),
                          lambda: excite_reference(x, h, w2, b2, act2), x)
    return excite_reference(x, h, w2, b2, act2)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _launch_hidden(kernel, pooled, w1, b1, act1: str) -> torch.Tensor:
    n, c = pooled.shape[:2]
    rows = w1.shape[0]
    out = torch.empty((n, rows, 1, 1), dtype=pooled.dtype, device=pooled.device)
    kernel[(n, -(-rows // _HIDDEN_ROWS))](pooled, w1, b1, out, c, rows, pooled.stride(0),
                                          ACT=_CODE[act1], BLOCK_R=_HIDDEN_ROWS, BLOCK_K=_HIDDEN_K, num_warps=4)
    return out


def _launch_excite(kernel, x, h, w2, b2, act2: str) -> torch.Tensor:
    n, c, height, width = x.shape
    rows = w2.shape[1]
    out = torch.empty_like(x)  # x's layout (eager's multiply keeps it)
    hw = height * width
    grid = (n, -(-c // _EXCITE_C), -(-hw // _EXCITE_HW))
    kernel[grid](x, h, w2, b2, out, c, rows, hw, x.stride(0), x.stride(1), x.stride(3), h.stride(0),
                 ACT=_CODE[act2], HIDDEN_PAD=_pow2(rows), BLOCK_C=_EXCITE_C, BLOCK_HW=_EXCITE_HW, num_warps=4)
    return out


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _pooled(t: torch.Tensor) -> bool:
    """A ``[N, C, 1, 1]`` map of a kernel's dtype with its channels dense (NCHW and NHWC alike)."""
    return (t.dtype in KERNEL_DTYPES and t.dim() == 4 and tuple(t.shape[2:]) == (1, 1) and t.numel() > 0
            and (t.shape[1] == 1 or t.stride(1) == 1))


def _weight_fits(w: torch.Tensor, b: torch.Tensor, like: torch.Tensor, cols: int) -> bool:
    """``w`` a ``[rows, cols, 1, 1]`` weight with dense rows, ``b`` one contiguous bias per row, both
    of ``like``'s dtype and device."""
    if w.dim() != 4 or tuple(w.shape[1:]) != (cols, 1, 1):
        return False
    rows = w.shape[0]
    if not ((rows == 1 or w.stride(0) == cols) and (cols == 1 or w.stride(1) == 1)):
        return False
    if b.dim() != 1 or b.numel() != rows or not b.is_contiguous():
        return False
    return all(t.dtype == like.dtype and t.device == like.device for t in (w, b))


def _excite_fits(x, h, w2, b2) -> bool:
    """x a dense NCHW or NHWC 4-D map (int32 offsets), h its samples' pooled hidden map, w2 from the
    hidden width (at most 512) to x's channels."""
    if x.dtype not in KERNEL_DTYPES or x.dim() != 4 or x.numel() == 0 or x.numel() >= 2**31:
        return False
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return False
    if not _pooled(h) or h.shape[0] != x.shape[0] or h.shape[1] > _MAX_HIDDEN or h.dtype != x.dtype:
        return False
    return h.device == x.device and w2.dim() == 4 and w2.shape[0] == x.shape[1] and _weight_fits(w2, b2, x, h.shape[1])


@functools.cache
def _kernels():
    """(hidden's kernel, excite's kernel), built on first use; None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: the eager ops run instead
        return None

    @triton.jit(do_not_specialize=["channels", "rows", "sample_stride"])
    def _hidden_kernel(p_ptr, w_ptr, b_ptr, out_ptr, channels, rows, sample_stride,
                       ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        n = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, channels, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < channels
            p = tl.load(p_ptr + n * sample_stride + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + r[:, None] * channels + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * p[None, :], axis=1)
        b = tl.load(b_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        v = (acc.to(dtype).to(tl.float32) + b).to(dtype).to(tl.float32)
        if ACT == 0:
            v = tl.maximum(v, 0.0)
        else:
            v = v / (1.0 + tl.exp(-v))
        tl.store(out_ptr + n * rows + r, v.to(dtype), mask=r_ok)

    @triton.jit(do_not_specialize=["channels", "rows", "pixels", "h_stride"])
    def _excite_kernel(x_ptr, h_ptr, w_ptr, b_ptr, out_ptr, channels, rows, pixels,
                       stride_n, stride_c, stride_hw, h_stride,
                       ACT: tl.constexpr, HIDDEN_PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        n = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        r = tl.arange(0, HIDDEN_PAD)
        r_ok = r < rows
        hv = tl.load(h_ptr + n * h_stride + r, mask=r_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c[:, None] * rows + r[None, :], mask=c_ok[:, None] & r_ok[None, :], other=0.0)
        g = tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
        b = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        g = (g.to(dtype).to(tl.float32) + b).to(dtype).to(tl.float32)
        if ACT == 0:
            g = 1.0 / (1.0 + tl.exp(-g))
        else:
            g = tl.minimum(tl.maximum(g + 3.0, 0.0), 6.0) / 6.0
        g = g.to(dtype).to(tl.float32)
        hw = tl.program_id(2) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        offs = n * stride_n + c[:, None] * stride_c + hw[None, :] * stride_hw
        ok = c_ok[:, None] & (hw < pixels)[None, :]
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (xv * g[:, None]).to(dtype), mask=ok)

    return _hidden_kernel, _excite_kernel
