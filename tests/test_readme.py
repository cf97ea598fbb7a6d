"""The README's engine example runs as written on this machine (CPU here, CUDA where there is one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_engine_example_runs_as_written():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using the engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "gpuloom.compile" in code
    out = subprocess.run([sys.executable, "-c", code + "\nprint('OUT', tuple(y.shape))\n"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OUT (5, 1000)" in out.stdout and "stream 0" in out.stdout, out.stdout[-2000:]
