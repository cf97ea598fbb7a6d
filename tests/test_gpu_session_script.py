"""scripts/gpu_runtime_session.sh's host gate (CPU: the GPU's tools are absent, the steps are echoes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, limit_us: int) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OUT": str(tmp_path / "out"), "STEPS": "diag serve", "DIAG_CMD": "echo diag-ran",
           "SERVE_CMD": "echo serve-ran", "HOST_MAX_LOOP_US": str(limit_us)}
    done = subprocess.run(["bash", "scripts/gpu_runtime_session.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert "=== done" in done.stdout, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("limit_us, serve_runs", [(1, False), (10**9, True)])
def test_a_slow_host_skips_the_gated_steps_and_runs_the_others(tmp_path, limit_us, serve_runs):
    out = _session(tmp_path, limit_us)
    assert "diag-ran" in out  # not gated (HOST_GATED's default: bench serve)
    assert ("serve-ran" in out) == serve_runs
    assert ("skipped serve: this host's Python loop probe" in out) == (not serve_runs)
    assert "python loop probe" in (tmp_path / "out" / "logs" / "gpu.txt").read_text()  # kept with the results
