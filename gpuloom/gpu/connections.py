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
    # "gpuloom" (set here), "user" (set before), "default" (unset), "late" (unset, CUDA already up),
    # "invalid" (set to something that is not a count: the driver's behaviour is unknown)
    source: str
    value: str = ""  # the variable as found, for "invalid"

    def as_meta(self) -> dict:
        return {"cuda_device_max_connections": self.count, "cuda_device_max_connections_source": self.source}

    @property
    def warning(self) -> str:
        """A line for the user where partitions may queue behind each other, else ""."""
        if self.source == "invalid":
            return (f"{ENV}={self.value!r} is not a number of hardware workqueues (1 to {WANTED}); gpuloom left it "
                    f"as it is. Set it to {WANTED}, or unset it and gpuloom will.")
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


def _parse(value: str) -> int | None:
    """The count the driver gets from ``value`` (it caps at 32), or None where it is not a count."""
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        return None
    return min(int(value), WANTED)


_set_value: str | None = None  # what prefer_all_connections put into os.environ, if it did


def prefer_all_connections(environ: MutableMapping[str, str] | None = None,
                           cuda_started: Callable[[], bool] = _cuda_started) -> Connections:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=32`` if unset and CUDA has not started; say what is in effect.

    Call it first thing: the command line does, and so do the GPU scripts and the CUDA device layer,
    which warns with :attr:`Connections.warning` when it comes too late. Never raises: a value that
    is not a count is left alone, with a warning.
    """
    global _set_value
    env = os.environ if environ is None else environ
    if (env.get(ENV) or "").strip():
        return connections_in_effect(env)
    if cuda_started():
        return Connections(DRIVER_DEFAULT, "late")
    env[ENV] = str(WANTED)
    if environ is None:
        _set_value = str(WANTED)
    return Connections(WANTED, "gpuloom")


def connections_in_effect(environ: MutableMapping[str, str] | None = None) -> Connections:
    """What the driver was asked for, without changing anything (for reports)."""
    env = os.environ if environ is None else environ
    value = (env.get(ENV) or "").strip()
    if not value:
        return Connections(DRIVER_DEFAULT, "default")
    n = _parse(value)
    if n is None:
        return Connections(DRIVER_DEFAULT, "invalid", value)
    return Connections(n, "gpuloom" if environ is None and value == _set_value else "user")
