"""Synthetic latency profiles with the shape real ones have, for tests and planning without a GPU.

Latency model: ``L(b, s) = overhead + work(b) / min(s, knee(b))`` with ``work(b) = per_item * b`` and
``knee(b) = min(sm_count, knee1 * b ** knee_growth)``: a model stops speeding up past its knee, and
bigger batches can use more SMs. Plain Python.
"""

from __future__ import annotations

from .store import GpuInfo, Profile

H200 = GpuInfo(name="NVIDIA H200 (synthetic)", sm_count=132, sm_granularity=8)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)


def sm_grid(gpu: GpuInfo) -> tuple[int, ...]:
    """Granularity steps up to the whole device: 8, 16, ..., 128, 132 on an H200."""
    steps = list(range(gpu.sm_granularity, gpu.sm_count + 1, gpu.sm_granularity))
    if steps[-1] != gpu.sm_count:
        steps.append(gpu.sm_count)
    return tuple(steps)


def synthetic_profile(
    model: str,
    *,
    per_item_sm_ms: float,
    overhead_ms: float = 0.1,
    knee1: int = 32,
    knee_growth: float = 0.5,
    gpu: GpuInfo = H200,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    input_shapes: tuple[tuple[int, ...], ...] = ((3, 224, 224),),
    dtype: str = "float32",
) -> Profile:
    """A profile whose batch-1 latency on ``s >= knee1`` SMs is ``overhead + per_item_sm_ms / knee1``.

    ``per_item_sm_ms`` is the work of one item in SM-milliseconds.
    """
    sms = sm_grid(gpu)
    rows = []
    for b in batches:
        knee = min(gpu.sm_count, knee1 * b**knee_growth)
        rows.append(tuple(overhead_ms + per_item_sm_ms * b / min(s, knee) for s in sms))
    return Profile(
        model=model,
        input_shapes=input_shapes,
        dtype=dtype,
        gpu=gpu,
        batches=batches,
        sms=sms,
        latency_ms=tuple(rows),
        source="synthetic",
    )


def zoo() -> list[Profile]:
    """Six synthetic models loosely shaped like the example mix (resnet50 ... bert-base)."""
    return [
        synthetic_profile("resnet50", per_item_sm_ms=60.0, knee1=64, knee_growth=0.35),
        synthetic_profile("mobilenet_v2", per_item_sm_ms=15.0, knee1=48, knee_growth=0.4),
        synthetic_profile("inception_v3", per_item_sm_ms=90.0, knee1=56, knee_growth=0.35, input_shapes=((3, 299, 299),)),
        synthetic_profile("efficientnet_b0", per_item_sm_ms=25.0, knee1=48, knee_growth=0.4),
        synthetic_profile("vgg16", per_item_sm_ms=200.0, knee1=96, knee_growth=0.2),
        synthetic_profile("bert_base", per_item_sm_ms=80.0, knee1=96, knee_growth=0.2, input_shapes=((128,),), dtype="int64"),
    ]
