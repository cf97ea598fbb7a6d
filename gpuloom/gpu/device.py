"""Facts about one CUDA device that partitioning and the knee model need.

``device_facts()`` reads them from torch and the driver (torch is imported inside the function, so
importing this module stays cheap and torch-free). The pure helpers (``sm_granularity``,
``max_blocks_per_sm``, ``sm_grid``) work from the compute capability alone and run anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NoGpuError

# Per-SM resident block limit by compute capability (CUDA programming guide, "Compute capabilities").
_MAX_BLOCKS_PER_SM = {(7, 0): 32, (7, 2): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24,
                      (9, 0): 32, (10, 0): 32, (12, 0): 32}


def sm_granularity(compute_capability: tuple[int, int]) -> int:
    """SMs per green-context group step without ``IGNORE_SM_COSCHEDULING``: 8 on 9.0+, else 2.

    From the ``cuDevSmResourceSplitByCount`` documentation (CUDA 12.4+); on an H200 (9.0) it is 8.
    """
    return 8 if compute_capability[0] >= 9 else 2


def max_blocks_per_sm(compute_capability: tuple[int, int]) -> int:
    """Most thread blocks one SM holds at once (32 on Hopper)."""
    return _MAX_BLOCKS_PER_SM.get(tuple(compute_capability), 32)


def sm_grid(sm_count: int, granularity: int) -> tuple[int, ...]:
    """Partition sizes to profile: granularity steps up to the whole device (8, 16, ..., 128, 132)."""
    if sm_count < 1 or granularity < 1:
        raise ValueError(f"sm_grid: expected positive sm_count and granularity, got {sm_count}, {granularity}")
    steps = list(range(granularity, sm_count + 1, granularity))
    if not steps or steps[-1] != sm_count:
        steps.append(sm_count)
    return tuple(steps)


@dataclass(frozen=True)
class DeviceFacts:
    """One CUDA device, as partitioning and the occupancy model see it."""

    index: int  # CUDA device ordinal
    name: str  # e.g. "NVIDIA H200"
    compute_capability: tuple[int, int]  # e.g. (9, 0)
    sm_count: int  # SMs of the whole device (132 on an H200)
    sm_granularity: int  # partition sizes are multiples of this (8 on Hopper)
    max_threads_per_sm: int  # 2048 on Hopper
    max_blocks_per_sm: int  # 32 on Hopper
    regs_per_sm: int  # 32-bit registers per SM (65536)
    smem_per_sm: int  # bytes of shared memory per SM usable by blocks (228 KiB on Hopper)
    smem_per_block_optin: int  # bytes one block may opt in to (227 KiB on Hopper)
    warp_size: int  # 32
    total_memory: int  # bytes of device memory
    driver: str  # CUDA driver version as "13.0" (from cuDriverGetVersion) or "" if unknown
    torch: str  # torch version

    def grid(self) -> tuple[int, ...]:
        """The SM counts a profile sweeps on this device."""
        return sm_grid(self.sm_count, self.sm_granularity)


def device_facts(device: int = 0) -> DeviceFacts:
    """Read the facts of CUDA device ``device``. Raises ``NoGpuError`` without a usable GPU."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError("device_facts: no CUDA GPU is available (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(device)
    cc = (int(p.major), int(p.minor))
    smem_sm = int(getattr(p, "shared_memory_per_multiprocessor", 0) or 0)
    # The per-SM figure includes 1 KiB the system reserves per block on 8.0+; blocks see 228 KiB on 9.0.
    if cc >= (9, 0) and smem_sm:
        smem_sm = min(smem_sm, 228 * 1024)
    return DeviceFacts(
        index=device,
        name=str(p.name),
        compute_capability=cc,
        sm_count=int(p.multi_processor_count),
        sm_granularity=sm_granularity(cc),
        max_threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", 2048) or 2048),
        max_blocks_per_sm=max_blocks_per_sm(cc),
        regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 65536) or 65536),
        smem_per_sm=smem_sm or 228 * 1024,
        smem_per_block_optin=int(getattr(p, "shared_memory_per_block_optin", 0) or 227 * 1024),
        warp_size=int(getattr(p, "warp_size", 32) or 32),
        total_memory=int(p.total_memory),
        driver=_driver_version(),
        torch=str(torch.__version__),
    )


def _driver_version() -> str:
    """The CUDA driver API version (e.g. "13.0"), or the kernel module version if readable."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        for tok in line.split():
            if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
                return tok
    except OSError:
        pass
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        if int(err) == 0:
            return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # noqa: BLE001 - version is informational only
        pass
    return ""
