"""The knee of a model: measured from a latency profile, and predicted from its kernels' shapes.

Plain Python (no torch): the predicted knee is computed from ``KernelRecord`` lists, which the
profiler extracts from a torch.profiler (Kineto) trace on the GPU and which tests build by hand.

**Measured knee** (``measured_knee``): the fewest measured SMs whose latency is within ``(1+eps)`` of
the whole-GPU latency (``Profile.knee`` does the same on a stored profile).

**Predicted knee** (``predict_knee``): per kernel, the occupancy calculator gives the blocks one SM
holds at once (limited by threads, registers, shared memory and the block limit), so the kernel's
first wave fills ``F = blocks / blocks_per_sm`` SMs (``fillable_sms`` is ``ceil(F)`` capped at the
device). The kernels are then aggregated, weighted by their duration on the whole GPU:

* ``"latency"`` (default): a latency model. On ``s`` SMs a kernel of duration ``d`` (measured on
  all ``N`` SMs) takes ``d * max(1, F/s) / max(1, F/N)`` (with ``F`` from ``wave_sms``, optionally
  scaled by a ``saturation`` factor): it runs at full speed while its blocks
  fit in one wave on ``s`` SMs and slows down in proportion beyond. A constant ``overhead_ms`` (launch
  gaps, which do not shrink with SMs) is added. The knee is the smallest SM count of the grid whose
  modelled latency is within ``(1+eps)`` of the modelled latency on ``N`` -- the measured knee's own
  definition applied to the model.
* ``"mean"``: the duration-weighted mean of ``min(F, N)``, rounded up to the grid.
* ``"quantile"``: the duration-weighted ``q``-quantile of ``min(F, N)`` (``q=0.5``: the weighted
  median), rounded up to the grid.

``docs/reports/profiles.md`` reports how well each matches the measured knees on the H200 zoo.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

METHODS = ("latency", "mean", "quantile")


@dataclass(frozen=True)
class KernelRecord:
    """One kernel launch as the profiler saw it."""

    name: str  # kernel symbol (demangled when the trace has it)
    duration_us: float  # measured duration on the whole GPU, microseconds
    grid: tuple[int, int, int]  # blocks per dimension
    block: tuple[int, int, int]  # threads per dimension
    registers_per_thread: int = 0  # 0 when unknown
    shared_memory: int = 0  # bytes per block, static + dynamic

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True)
class OccupancyLimits:
    """Per-SM resource limits of a device (defaults: Hopper / H200, compute capability 9.0)."""

    sm_count: int = 132  # SMs on the device
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536  # 32-bit registers
    smem_per_sm: int = 228 * 1024  # bytes usable by resident blocks
    smem_reserved_per_block: int = 1024  # bytes the system reserves per block (8.0+)
    smem_granularity: int = 128  # bytes, allocation unit of shared memory
    reg_alloc_unit: int = 256  # registers, per-warp allocation unit
    warp_size: int = 32

    @classmethod
    def from_device(cls, facts: Any) -> "OccupancyLimits":
        """From a ``gpuloom.gpu.DeviceFacts`` (anything with the same attribute names)."""
        return cls(sm_count=facts.sm_count, max_threads_per_sm=facts.max_threads_per_sm,
                   max_blocks_per_sm=facts.max_blocks_per_sm, regs_per_sm=facts.regs_per_sm,
                   smem_per_sm=facts.smem_per_sm, warp_size=facts.warp_size)


def blocks_per_sm(k: KernelRecord, lim: OccupancyLimits = OccupancyLimits()) -> int:
    """Blocks of ``k`` one SM holds at once (at least 1: a kernel that launched ran somewhere)."""
    warps = max(1, math.ceil(k.threads_per_block / lim.warp_size))
    by_blocks = lim.max_blocks_per_sm
    by_threads = lim.max_threads_per_sm // (warps * lim.warp_size)
    by_regs = by_blocks
    if k.registers_per_thread > 0:
        per_warp = math.ceil(k.registers_per_thread * lim.warp_size / lim.reg_alloc_unit) * lim.reg_alloc_unit
        by_regs = (lim.regs_per_sm // per_warp) // warps
    by_smem = by_blocks
    if k.shared_memory > 0:
        per_block = math.ceil((k.shared_memory + lim.smem_reserved_per_block) / lim.smem_granularity)
        by_smem = lim.smem_per_sm // (per_block * lim.smem_granularity)
    return max(1, min(by_blocks, by_threads, by_regs, by_smem))


def wave_sms(k: KernelRecord, lim: OccupancyLimits = OccupancyLimits(), saturation: float = 1.0) -> float:
    """SMs the kernel's blocks keep busy, fractional: ``blocks / (blocks_per_sm * saturation)``.

    ``saturation`` (0 < x <= 1) is the fraction of the occupancy limit at which one SM is already
    running at full throughput: with 0.5, a kernel whose blocks would fit on 10 SMs at full
    occupancy still gets faster up to 20 SMs, because half-full SMs run each block faster.
    """
    if not (0.0 < saturation <= 1.0):
        raise ValueError(f"saturation: expected 0 < x <= 1, got {saturation}")
    return k.blocks / max(1.0, blocks_per_sm(k, lim) * saturation)


def fillable_sms(k: KernelRecord, lim: OccupancyLimits = OccupancyLimits()) -> int:
    """SMs the kernel can fill: ``ceil(blocks / blocks_per_sm)`` capped at the device's SMs."""
    return min(lim.sm_count, max(1, math.ceil(wave_sms(k, lim))))


def _round_up(x: float, grid: Sequence[int]) -> int:
    for s in grid:
        if s >= x - 1e-9:
            return s
    return grid[-1]


def modelled_latency_us(records: Sequence[KernelRecord], sms: float, lim: OccupancyLimits = OccupancyLimits(),
                        overhead_us: float = 0.0, saturation: float = 1.0) -> float:
    """The ``"latency"`` model: sum over kernels of ``d * max(1, F/s) / max(1, F/N)``, plus overhead."""
    n = lim.sm_count
    total = overhead_us
    for k in records:
        f = wave_sms(k, lim, saturation)
        total += k.duration_us * max(1.0, f / sms) / max(1.0, f / n)
    return total


def predict_knee(records: Sequence[KernelRecord], sm_grid: Sequence[int], *, method: str = "latency",
                 eps: float = 0.1, q: float = 0.5, lim: OccupancyLimits = OccupancyLimits(),
                 overhead_us: float = 0.0, saturation: float = 1.0) -> int:
    """Predicted knee (SMs, a member of ``sm_grid``) of a model whose kernels are ``records``.

    ``sm_grid`` is the ascending list of partition sizes (8, 16, ..., 128, 132); its last entry is
    the whole device. ``saturation`` scales the blocks one SM needs to be busy (see ``wave_sms``;
    1.0 is the plain occupancy model). See the module docstring for the methods. Raises ``ValueError`` for an
    unknown method, an empty grid, or records with no positive duration.
    """
    if method not in METHODS:
        raise ValueError(f"predict_knee: method must be one of {METHODS}, got {method!r}")
    grid = sorted(int(s) for s in sm_grid)
    if not grid:
        raise ValueError("predict_knee: expected a non-empty SM grid")
    recs = [k for k in records if k.duration_us > 0]
    if not recs:
        raise ValueError("predict_knee: expected kernel records with positive durations, got none")
    lim = dataclasses.replace(lim, sm_count=grid[-1]) if lim.sm_count != grid[-1] else lim
    n = grid[-1]
    if method == "latency":
        full = modelled_latency_us(recs, n, lim, overhead_us, saturation)
        for s in grid:
            if modelled_latency_us(recs, s, lim, overhead_us, saturation) <= (1.0 + eps) * full:
                return s
        return n
    pairs = sorted((min(wave_sms(k, lim, saturation), n), k.duration_us) for k in recs)
    total = sum(d for _, d in pairs)
    if method == "mean":
        return _round_up(sum(f * d for f, d in pairs) / total, grid)
    if not (0.0 <= q <= 1.0):
        raise ValueError(f"predict_knee: quantile q must be in [0, 1], got {q}")
    acc = 0.0
    for f, d in pairs:
        acc += d
        if acc >= q * total - 1e-12:
            return _round_up(f, grid)
    return _round_up(pairs[-1][0], grid)


# -- measured ------------------------------------------------------------------------------------

def measured_knee(sms: Sequence[int], latency_ms: Sequence[float], eps: float = 0.1) -> int:
    """Fewest SMs whose latency is within ``(1+eps)`` of the latency on the most SMs (last entry).

    Latencies are first made non-increasing in SMs (running minimum), as the profile store does.

    >>> measured_knee([8, 16, 32], [4.0, 2.1, 2.0])
    16
    """
    if len(sms) != len(latency_ms) or not sms:
        raise ValueError(f"measured_knee: expected equal, non-empty sms and latencies, got {len(sms)}, "
                         f"{len(latency_ms)}")
    if eps < 0:
        raise ValueError(f"measured_knee: eps must be >= 0, got {eps}")
    mono, cur = [], float("inf")
    for v in latency_ms:
        cur = min(cur, float(v))
        mono.append(cur)
    full = mono[-1]
    for s, v in zip(sms, mono):
        if v <= (1.0 + eps) * full:
            return int(s)
    return int(sms[-1])


def throughput_per_sm(sms: Sequence[int], latency_ms: Sequence[float], batch: int) -> list[tuple[int, float]]:
    """(SMs, requests per second per SM) for back-to-back batches of ``batch``."""
    return [(int(s), batch * 1000.0 / float(v) / int(s)) for s, v in zip(sms, latency_ms)]


# -- Kineto traces -------------------------------------------------------------------------------

def parse_chrome_trace(trace: dict | str, *, min_duration_us: float = 0.0) -> list[KernelRecord]:
    """Kernel records from a torch.profiler chrome trace (a dict, a JSON string or a file path).

    Reads events with ``cat == "kernel"`` and their args ``grid``, ``block``, ``registers per
    thread`` and ``shared memory`` (bytes per block); events without a grid are skipped.
    """
    if isinstance(trace, str):
        if trace.lstrip().startswith("{"):
            trace = json.loads(trace)
        else:
            with open(trace) as f:
                trace = json.load(f)
    events: Iterable[dict] = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") not in (None, "X"):
            continue
        args = e.get("args", {}) or {}
        grid, block = args.get("grid"), args.get("block")
        if not grid or not block:
            continue
        dur = float(e.get("dur", 0.0))
        if dur < min_duration_us:
            continue
        out.append(KernelRecord(
            name=str(e.get("name", "")),
            duration_us=dur,
            grid=_dim3(grid),
            block=_dim3(block),
            registers_per_thread=int(args.get("registers per thread", 0) or 0),
            shared_memory=int(args.get("shared memory", 0) or 0),
        ))
    return out


def _dim3(v: Any) -> tuple[int, int, int]:
    xs = [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])] + [1, 1, 1]
    return (max(1, xs[0]), max(1, xs[1]), max(1, xs[2]))


# -- named variants ------------------------------------------------------------------------------

#: The variant the profiler stores as ``Profile.predicted_knee`` (chosen on the H200 zoo, see
#: ``docs/reports/profiles.md``).
DEFAULT_VARIANT = "latency_sat0.5"


def variants() -> dict[str, dict[str, Any]]:
    """Every aggregation compared on the zoo, by name: keyword arguments of ``predict_knee``.

    ``latency[_satX][+gaps]``: the latency model with saturation X (default 1); ``+gaps`` adds as a
    constant the launch gaps of the whole-GPU graph (its measured latency minus the kernels' summed
    durations), which do not shrink with SMs. ``mean``, ``median``, ``q75``: duration-weighted
    statistics of the SMs each kernel fills.
    """
    out: dict[str, dict[str, Any]] = {}
    for sat in (1.0, 0.5, 0.25, 0.125):
        for gaps in (False, True):
            name = "latency" + ("" if sat == 1.0 else f"_sat{sat}") + ("+gaps" if gaps else "")
            out[name] = dict(method="latency", saturation=sat, gaps=gaps)
    out["mean"] = dict(method="mean")
    out["median"] = dict(method="quantile", q=0.5)
    out["q75"] = dict(method="quantile", q=0.75)
    return out


def predict_variant(name: str, records: Sequence[KernelRecord], sm_grid: Sequence[int], *,
                    full_latency_us: float | None = None, eps: float = 0.1,
                    lim: OccupancyLimits = OccupancyLimits()) -> int:
    """``predict_knee`` by a named variant (see ``variants``). ``+gaps`` variants need ``full_latency_us``."""
    table = variants()
    if name not in table:
        raise ValueError(f"unknown knee variant {name!r}; known: {sorted(table)}")
    kw = dict(table[name])
    if kw.pop("gaps", False):
        if full_latency_us is None:
            raise ValueError(f"knee variant {name!r} needs the measured whole-GPU latency (full_latency_us)")
        kw["overhead_us"] = max(0.0, full_latency_us - sum(k.duration_us for k in records))
    return predict_knee(records, sm_grid, eps=eps, lim=lim, **kw)
