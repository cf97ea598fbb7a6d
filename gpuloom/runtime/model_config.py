"""What the service is told about a model: its tensors, batch, SLO, weight and engine options.

Frozen dataclasses checked once, at construction, with errors that say what was expected: the
repository (``gpuloom serve``) builds them from YAML, ``gpuloom bench`` from a workload, a user from
Python. :mod:`gpuloom.runtime.service` serves them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..engine.options import ENGINE_DEFAULTS, ENGINE_KEYS, is_engine_value

#: the longest SLO a model may have, ms (an hour): the planner's cycle grows with the longest SLO, and
#: 1e12 ms built slots until memory ran out (a review, sixty-fourth session)
MAX_SLO_MS = 3_600_000.0
#: the largest max_batch a model may have, rows (2**16): a load compiles the model with example inputs
#: of max_batch rows, captures a graph per power-of-two bucket up to it and tables the bucket of every
#: batch size; max_batch 1e8 of a 16-float MLP took 28 s and 9.3 GB on the CPU before it served (a
#: review, sixty-fourth session), and an image model's example alone would not fit any memory
MAX_BATCH = 65536
#: the tensor dtypes the service takes (numpy / torch names)
DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
#: what each engine option of ModelConfig takes, as its errors say it (ENGINE_CHOICES in YAML's spelling)
_PYTHON_CHOICES = {"channels_last": "false, true or 'auto'", "fuse_convolutions": "false, true or 'channels_last'",
                   "split_gemms": "true or false", "fuse_epilogues": "true or false"}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a model, per sample (no batch dimension)."""

    name: str
    shape: tuple[int, ...]  # per sample; every dimension >= 1 (no -1: graphs have static shapes)
    dtype: str  # numpy/torch dtype name: "float32", "float16", "int64", ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty string, got {self.name!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: shape must be positive ints per sample (no batch, no -1), "
                             f"got {self.shape}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TensorSpec {self.name!r}: dtype must be one of {DTYPES}, got {self.dtype!r}")

    def describe(self) -> str:
        return f"{self.name}: {self.dtype}[n, {', '.join(map(str, self.shape))}]".replace("[n, ]", "[n]")


@dataclass(frozen=True)
class ModelConfig:
    """A model as the service serves it."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = ()  # filled in by load() from the compiled model when empty
    max_batch: int = 32  # rows per batch (and per request) at most
    slo_ms: float = 100.0  # latency objective of a request, ms (its default deadline)
    weight: float = 1.0  # fairness weight when the GPU is short
    rate_hint: float = 50.0  # expected requests/s, for the first plan
    # gpuloom.compile's channels_last for this model: False, True (convolutions NHWC) or "auto" (both
    # layouts timed per bucket on the GPU). The planner's profile stays the one looked up by name (the
    # shipped ones were timed without it; `gpuloom profile --channels-last` times one with it)
    channels_last: bool | str = ENGINE_DEFAULTS["channels_last"]
    # gpuloom.compile's fuse_convolutions: False, True (CUDA only) or "channels_last" (the channels-last
    # graph only: 1.27-1.74x faster there on the H200, engine runs 100-101; nothing on the CPU). False
    # here on purpose, where compile's own default is "channels_last": as with channels_last, the
    # shipped profiles were timed unfused (`gpuloom profile --fuse-convolutions` times one fused)
    fuse_convolutions: bool | str = ENGINE_DEFAULTS["fuse_convolutions"]
    # gpuloom.compile's split_gemms: float32 linear layers split their GEMM's reduction where timed
    # faster per shape (bert_base 1.30x at batch 1 on the whole H200, engine runs 128-132), chosen again
    # on each partition the model is captured on. False here, where compile's own default is on for
    # CUDA: the shipped profiles were timed without it (a model served with it is profiled so at load)
    split_gemms: bool = ENGINE_DEFAULTS["split_gemms"]
    # gpuloom.compile's fuse_epilogues and fuse_gates, gpuloom's own Triton kernels: each convolution's
    # bias (+ residual add) + SiLU / sigmoid / ReLU6 as one kernel (efficientnet_b0 1.15x, mobilenet_v2
    # 1.11x at batch 1 on the whole H200, engine runs 136-138), and each squeeze-excitation gate as two
    # (efficientnet_b0 a further 1.24x, run 140). On by default since the forty-fourth session: served on
    # mix6 (run 148, A/B/A, dstack at x1) the two models they change computed 14-29% faster and the mix
    # held 0.962 of its SLOs against 0.925 / 0.835. CUDA only (compile_options). The shipped profiles
    # timed the models without them, so a model they change is profiled at its load (about 7 s, cached)
    fuse_epilogues: bool = ENGINE_DEFAULTS["fuse_epilogues"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"model name must be a non-empty string without '/', got {self.name!r}")
        if not self.inputs:
            raise ValueError(f"model {self.name!r}: needs at least one input TensorSpec")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: input names must be unique, got {names}")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"model {self.name!r}: max_batch must be a positive int, got {self.max_batch!r}")
        if self.max_batch > MAX_BATCH:
            raise ValueError(f"model {self.name!r}: max_batch must be at most {MAX_BATCH} rows, got {self.max_batch!r}")
        for what, v in (("slo_ms", self.slo_ms), ("weight", self.weight)):
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"model {self.name!r}: {what} must be a positive number, got {v!r}")
        if self.slo_ms > MAX_SLO_MS:
            raise ValueError(f"model {self.name!r}: slo_ms must be at most {MAX_SLO_MS:.0f} (an hour), got {self.slo_ms!r}")
        if not (isinstance(self.rate_hint, (int, float)) and self.rate_hint >= 0 and math.isfinite(self.rate_hint)):
            raise ValueError(f"model {self.name!r}: rate_hint must be a finite number >= 0 requests/s, got {self.rate_hint!r}")
        for key in ENGINE_KEYS:  # the repository's check, said in Python's spellings
            value = getattr(self, key)
            if not is_engine_value(key, value):
                raise ValueError(f"model {self.name!r}: {key} must be {_PYTHON_CHOICES[key]}, got {value!r}")

    def compile_options(self, device_type: str) -> dict:
        """``gpuloom.compile``'s keyword options for this model on ``device_type`` ("cuda" or "cpu"):
        the layout, fusion and GEMMs its profile was made with. Whoever compiles a model for the service
        (the service at a load, ``gpuloom bench``) uses these, as the service refuses a compiled model
        that differs (compile's own defaults split float32 GEMMs on CUDA, the service's not)."""
        return {"channels_last": self.channels_last, "fuse_convolutions": self.fuse_convolutions,
                "split_gemms": self.split_gemms and device_type == "cuda",
                "fuse_epilogues": self.fuse_epilogues and device_type == "cuda",
                "fuse_gates": self.fuse_epilogues and device_type == "cuda"}

    @functools.cached_property
    def input_names(self) -> frozenset[str]:
        """The input names as a set, made once: every submit checks a request's names against it."""
        return frozenset(t.name for t in self.inputs)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        """The output names in order, made once: every answer is keyed by them."""
        return tuple(t.name for t in self.outputs)



__all__ = ["DTYPES", "ModelConfig", "TensorSpec"]
