"""Ask the driver for all 32 hardware workqueues before CUDA starts (``CUDA_DEVICE_MAX_CONNECTIONS``).

The driver gives each context a pool of hardware queues ("connections") that streams are mapped
onto: 8 unless ``CUDA_DEVICE_MAX_CONNECTIONS`` says otherwise, at most 32. Green contexts share the
pool of the device. With 8, kernels of different SM partitions, or of different branches of one
multi-stream graph, queue behind each other in hardware while their own SMs sit idle.

Measured on the H200 (driver 580, eleventh session; ``docs/results/runtime/``):
* ``scripts/diag_workqueues.py``: five partitions each replaying a graph of four branches take
  1.49x (at most 1.76x) their time alone when they run together with 8 connections, 1.10x with 32;
  graphs of one branch 1.07x either way (``diag_workqueues_h200_run28.json``).
* mix6 at x0.75, same run: dstack 0.960 -> 0.997 SLO attainment, x0.875 0.763 -> 0.986; the time a
  batch holds its partition beyond its device time 1.27 -> 0.68 ms; inception_v3's batch-1 graph
  2.9x its profile -> 0.97-1.03x (``bench_mix6_h200_run29_*.json``).

The variable is read when the process's CUDA context is created, so it must be set before torch (or
anything else) initialises CUDA. :func:`prefer_all_connections` sets it where it is unset and CUDA
has not started; a value the user set is kept (``CUDA_DEVICE_MAX_CONNECTIONS=8`` restores the
driver's default). No torch import here: torch is only asked whether CUDA has started if it is
already loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
DRIVER_DEFAULT = 8
WANTED = 32  # the most the driver gives


@dataclass(frozen=True)
class Connections:
    """The workqueues this process's CUDA context gets, and who decided."""

    count: int  # connections per context the driver was asked for (8: its default)
    source: str  # "gpuloom" (set here), "user" (set before), "default" (unset), "late" (unset, CUDA already up)

    def as_meta(self) -> dict:
        return {"cuda_device_max_connections": self.count, "cuda_device_max_connections_source": self.source}

    @property
    def warning(self) -> str:
        """A line for the user where partitions may queue behind each other, else ""."""
        if self.source != "late":
            return ""
        return (f"CUDA started before gpuloom could set {ENV}={WANTED}: this process has the driver's "
                f"{DRIVER_DEFAULT} hardware workqueues, and SM partitions may wait on each other through them "
                f"(measured on the H200: 0.96 vs 0.997 SLO attainment on mix6). Set {ENV}={WANTED} in the "
                f"environment, or call gpuloom.gpu.prefer_all_connections() before CUDA starts.")


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        return False


def _parse(value: str) -> int:
    """The count the driver gets from ``value`` (it caps at 32); a clear error for anything not a count."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV} must be a whole number of hardware workqueues (1 to {WANTED}), got {value!r}")
    return min(n, WANTED)


_set_here = False  # this process's value came from prefer_all_connections


def prefer_all_connections(environ: MutableMapping[str, str] | None = None,
                           cuda_started: Callable[[], bool] = _cuda_started) -> Connections:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=32`` if unset and CUDA has not started; say what is in effect.

    Call it first thing (the command line does, and so do the CUDA device layer and the partitioner,
    which warn with :attr:`Connections.warning` when it comes too late).
    """
    global _set_here
    env = os.environ if environ is None else environ
    if (env.get(ENV) or "").strip():
        return connections_in_effect(env)
    if cuda_started():
        return Connections(DRIVER_DEFAULT, "late")
    env[ENV] = str(WANTED)
    _set_here = environ is None
    return Connections(WANTED, "gpuloom")


def connections_in_effect(environ: MutableMapping[str, str] | None = None) -> Connections:
    """What the driver was asked for, without changing anything (for reports)."""
    env = os.environ if environ is None else environ
    value = (env.get(ENV) or "").strip()
    if not value:
        return Connections(DRIVER_DEFAULT, "default")
    n = _parse(value)
    return Connections(n, "gpuloom" if _set_here and environ is None and n == WANTED else "user")
