"""MPS mode: one worker process per partition, each limited by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.

For users who need process isolation (a crash in one model does not take down the others). The
SM share of an MPS client is fixed for the life of the process and is a *limit*, not a disjoint
set of SMs: clients may share SMs. A green context cannot be created inside an MPS client, so do
not mix the two modes in one process tree.

    with MpsDaemon():                        # nvidia-cuda-mps-control -d ... echo quit
        w = MpsWorker(fn, args, sms=32)      # a spawned process with ~32/132 of the SMs
        w.start(); w.join()

``MpsDaemon`` starts the daemon only if asked (and stops only a daemon it started).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
from typing import Any, Callable, Mapping

from .errors import GpuError, PartitionError

CONTROL = "nvidia-cuda-mps-control"


def mps_percentage(sms: int, sm_count: int) -> int:
    """The CUDA_MPS_ACTIVE_THREAD_PERCENTAGE that gives at least ``sms`` of ``sm_count`` SMs (1..100).

    >>> mps_percentage(33, 132)
    25
    """
    if not (0 < sms <= sm_count):
        raise PartitionError(f"MPS partition of {sms} SMs: expected 1..{sm_count} SMs")
    return max(1, min(100, math.ceil(100.0 * sms / sm_count)))


def mps_env(percentage: int, base: Mapping[str, str] | None = None, pipe_dir: str | None = None) -> dict[str, str]:
    """The environment of one MPS client process with ``percentage`` % of the SMs."""
    if not (1 <= int(percentage) <= 100):
        raise PartitionError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: expected 1..100, got {percentage}")
    env = dict(os.environ if base is None else base)
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(percentage))
    if pipe_dir:
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
    return env


class MpsDaemon:
    """Start (``nvidia-cuda-mps-control -d``) and stop (``echo quit | ...``) the MPS control daemon.

    Uses private pipe and log directories (under a temp dir unless given) so it never touches a
    daemon someone else runs. Raises ``GpuError`` when the control binary is missing or fails.
    """

    def __init__(self, pipe_dir: str | None = None, log_dir: str | None = None) -> None:
        root = None if pipe_dir and log_dir else tempfile.mkdtemp(prefix="gpuloom-mps-")
        self.pipe_dir = pipe_dir or os.path.join(root, "pipe")
        self.log_dir = log_dir or os.path.join(root, "log")
        self.running = False

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = self.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        return env

    def _binary(self) -> str:
        path = shutil.which(CONTROL)
        if path is None:
            raise GpuError(f"MPS mode needs {CONTROL} on PATH (part of the NVIDIA driver); it was not found")
        return path

    def start(self) -> "MpsDaemon":
        binary = self._binary()
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        r = subprocess.run([binary, "-d"], env=self._env(), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise GpuError(f"{CONTROL} -d failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
        self.running = True
        return self

    def stop(self) -> None:
        if not self.running:
            return
        r = subprocess.run([self._binary()], input="quit\n", env=self._env(), capture_output=True, text=True,
                           timeout=30)
        self.running = False
        if r.returncode != 0:
            raise GpuError(f"echo quit | {CONTROL} failed (exit {r.returncode}): {r.stderr.strip()}")

    def client_env(self, sms: int, sm_count: int) -> dict[str, str]:
        """Environment for a client process limited to about ``sms`` SMs of this daemon."""
        return mps_env(mps_percentage(sms, sm_count), pipe_dir=self.pipe_dir)

    def __enter__(self) -> "MpsDaemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class MpsWorker:
    """A spawned worker process running ``fn(*args)`` as an MPS client with a fixed SM share.

    The environment variable must be set before the child initializes CUDA, so the process is
    spawned (not forked) with the variable in its environment. ``exitcode`` after ``join()``.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple = (), *, sms: int, sm_count: int,
                 daemon: MpsDaemon | None = None) -> None:
        self.percentage = mps_percentage(sms, sm_count)
        self.sms = sms
        self.env = mps_env(self.percentage, pipe_dir=daemon.pipe_dir if daemon else None)
        self._proc = mp.get_context("spawn").Process(target=_run_with_env, args=(self.env, fn, args))

    def start(self) -> None:
        self._proc.start()

    def join(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def __repr__(self) -> str:
        return f"MpsWorker(sms={self.sms}, percentage={self.percentage}%, pid={self._proc.pid})"


def _run_with_env(env: dict[str, str], fn: Callable[..., Any], args: tuple) -> Any:
    os.environ.update({k: v for k, v in env.items() if k.startswith("CUDA_MPS_")})
    return fn(*args)
