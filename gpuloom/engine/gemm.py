"""Split-K float32 linear layers, chosen per shape by timing (compile's ``split_gemms``).

Why: a linear layer at a small batch has few output rows (bert_base at batch 1: 128 tokens), so
cuBLAS's output tiles cover a fraction of the GPU's SMs and a float32 GEMM runs at 6-22 TFLOPS on
an H200 that does ~60. Splitting the reduction (K) in ``s`` parts gives ``s`` times the tiles: one
batched GEMM of the ``s`` slices (``bmm``, no copy: the slices are views of the input and of the
weight), then their sum and the bias. On the H200 (engine run 127, ``scripts/diag_fp32_gemm.py``)
this ran bert's output projection (768 -> 768) 1.89x and its second FFN layer (3072 -> 768) 1.95x
faster at 128 tokens; at 1024 tokens only the FFN's second layer gained (1.25x), the others lost.

So the split is a measured choice, per shape: the first time :func:`linear` meets a shape outside a
graph capture (a capture's warm-ups), it times cuBLAS's own call and every split of K into 2, 3, 4,
6 or 8 parts of at least 64, and keeps a split only where it was at least ``MARGIN`` faster. Timing:
the kernels are queued behind a GPU sleep longer than their launch (``torch.cuda._sleep``), so the
events measure the GPU's time back to back, as in a graph replay, not the host's launches. Under
capture an unknown shape runs cuBLAS's call (a capture cannot time). The choices are kept per process
(:func:`choices`); they depend on what else the GPU runs while timing, so compile alone.

A split that wins on the whole GPU may lose on a partition of 16 SMs, where cuBLAS's few tiles
already fill it. So a capture confined to a partition runs inside :func:`scope` with the partition's
SM count (the runtime and the profiler do): its shapes are timed again there, on the partition's
own stream, and keep choices of their own.

Float32 only. In half precision the tensor cores already run these GEMMs in 4-10 us and every split
was 2-3x slower (run 131, ``diag_fp32_gemm.py --dtype float16``: 8.5-18 us at 128 tokens), with
partial sums either rounded to half before their sum (twice cuBLAS's error) or kept in float32
(``aten.bmm.dtype``: cuBLAS's error, three more kernels).

Results differ from eager's only by the order of the reduction's sums (the engine's GPU test checks
every element against eager; the split's error against float64 was at or below cuBLAS's in run 127).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch

#: a split is kept only where it was at least this much faster than cuBLAS's own call
MARGIN = 0.05
#: parts K may be split in (each at least MIN_PART long and K a multiple of the count)
SPLITS = (2, 3, 4, 6, 8)
MIN_PART = 64
_REPS = 10  # calls per timing
_ROUNDS = 3  # timings per candidate, the candidates in turn (the median is kept)

_ATEN_LINEAR = torch.ops.aten.linear.default
_lock = threading.Lock()
_choices: dict[tuple, int] = {}  # shape key -> parts (1: cuBLAS's own call)
_scope = threading.local()  # .tag: what the current thread's choices are kept under (None: the whole GPU)


@contextlib.contextmanager
def scope(tag: Any) -> Iterator[None]:
    """Within, this thread's choices are made and looked up under ``tag`` (hashable; the SM count of
    the partition a capture is confined to), apart from the whole GPU's (``None``)."""
    previous = getattr(_scope, "tag", None)
    _scope.tag = tag
    try:
        yield
    finally:
        _scope.tag = previous


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear`` with K split in the parts timed fastest for this shape (see the module)."""
    key = _key(x, weight, bias)
    parts = _choices.get(key)
    if parts is None:
        if key is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            parts = 1
        else:
            parts = _tune(key, x, weight, bias)
    return linear_with(x, weight, bias, parts)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``linear(x, weight, bias)`` as one batched GEMM over ``parts`` slices of K, summed."""
    k = x.shape[-1]
    n = weight.shape[0]
    if k % parts:
        raise ValueError(f"split_k_linear: K={k} is not a multiple of parts={parts}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) != k:
        rows = rows.contiguous()
    xs = rows.view(rows.shape[0], parts, k // parts).transpose(0, 1)  # (parts, M, K/parts)
    ws = weight.view(n, parts, k // parts).permute(1, 2, 0)  # (parts, K/parts, N), views of the weight
    out = torch.bmm(xs, ws).sum(0)
    if bias is not None:
        out = out.add_(bias)
    return out.view(*x.shape[:-1], n)


def choices() -> dict[tuple, int]:
    """The choices made so far: ``(input shape, input strides, out features, bias, device, scope) -> parts``."""
    with _lock:
        return dict(_choices)


def clear() -> None:
    """Forget every choice (the next call of each shape times again)."""
    with _lock:
        _choices.clear()


def candidates(k: int) -> list[int]:
    """Parts K may be split in: 1 (no split) and each of SPLITS that divides K in parts >= MIN_PART."""
    return [1] + [s for s in SPLITS if k % s == 0 and k // s >= MIN_PART]


def _key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple | None:
    """The choice's key, or None where no split applies: not on the GPU, not float32, a 1-D input,
    a weight that is not a plain matrix, or a K that no split divides."""
    if not _on_gpu(x) or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() < 2:
        return None
    if weight.dim() != 2 or not weight.is_contiguous() or len(candidates(x.shape[-1])) == 1:
        return None
    return (tuple(x.shape), tuple(x.stride()), weight.shape[0], bias is not None, x.device.index,
            getattr(_scope, "tag", None))


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _tune(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Time each candidate on the current stream, the candidates in turn in each of ``_ROUNDS`` rounds
    (a clock still ramping up then costs every candidate alike); remember and return the parts of the
    fastest by its median."""
    calls = {s: functools.partial(linear_with, x, weight, bias, s) for s in candidates(x.shape[-1])}
    for call in calls.values():
        call()  # lazy initializations (cuBLAS handles, workspaces) outside the timing
    samples: dict[int, list[float]] = {s: [] for s in calls}
    for _ in range(_ROUNDS):
        for s, call in calls.items():
            samples[s].append(_time(call))
    times = {s: sorted(v)[len(v) // 2] for s, v in samples.items()}
    best = min(times, key=times.__getitem__)
    parts = best if times[best] <= (1.0 - MARGIN) * times[1] else 1
    with _lock:
        _choices.setdefault(key, parts)
        return _choices[key]


def linear_with(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``linear`` with a given number of parts (1: cuBLAS's own call)."""
    return _ATEN_LINEAR(x, weight, bias) if parts == 1 else split_k_linear(x, weight, bias, parts)


def _time(fn) -> float:
    """GPU ms per call of ``_REPS`` calls of ``fn`` queued behind a sleep (so launches do not count)."""
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()  # (the device: other streams' work would share the GPU with the timing)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_SLEEP_CYCLES)
    start.record(stream)
    for _ in range(_REPS):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / _REPS


# about 1 ms at the H200's ~2 GHz: longer than the host takes to queue _REPS calls of a split
_SLEEP_CYCLES = 2_000_000
