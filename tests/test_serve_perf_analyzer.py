"""Triton's perf_analyzer, unmodified, against ``gpuloom serve`` (issue 6): HTTP and gRPC, synchronous
and asynchronous, streaming, concurrency and request-rate modes, batches of several rows. Each run must finish
(perf_analyzer exits non-zero on anything it cannot read, e.g. statistics whose compute counts
differ) and the server's books must count every request it sent.

perf_analyzer is a binary from tritonclient's manylinux wheel: ``scripts/get_perf_analyzer.sh``
fetches it into ``.perf_analyzer/`` (``.ci/run`` tries to); ``GPULOOM_PERF_ANALYZER`` names another.
Without one these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _perf_analyzer() -> str | None:
    for candidate in (os.environ.get("GPULOOM_PERF_ANALYZER"), str(ROOT / ".perf_analyzer" / "perf_analyzer"),
                      shutil.which("perf_analyzer")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


PERF_ANALYZER = _perf_analyzer()
pytestmark = pytest.mark.skipif(PERF_ANALYZER is None, reason="no perf_analyzer (bash scripts/get_perf_analyzer.sh)")


@pytest.fixture(scope="module")
def server():
    """``gpuloom serve`` on the CPU with tiny_mlp, HTTP and gRPC on free ports: (http port, grpc port)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "gpuloom", "serve", str(ROOT / "examples" / "repository" / "tiny_mlp.yaml"),
                             "--device", "cpu", "--http-port", "0", "--grpc-port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"HTTP on http://127\.0\.0\.1:(\d+).*gRPC on 127\.0\.0\.1:(\d+)", line)
            if m:
                break
        else:
            raise AssertionError("server did not start:\n" + "".join(lines))
        yield int(m.group(1)), int(m.group(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def _successes(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/tiny_mlp/stats", timeout=10) as r:
        return int(json.loads(r.read())["model_stats"][0]["inference_stats"]["success"]["count"])


#: perf_analyzer reports only once three windows in a row agree on latency and throughput within this
#: many percent (its default 10). On CI's two shared cores a request-rate run at 100 req/s (50 requests
#: per 500 ms window, each after an idle gap) missed that in about one run of ten and exited 2 ("Failed
#: to obtain stable measurement"). These tests check that perf_analyzer can drive and read gpuloom,
#: not how steady the machine is, so they allow 50% (and 20 windows before giving up).
STABILITY_PERCENT = "50"


def _run(*args: str) -> str:
    out = subprocess.run([PERF_ANALYZER, "-m", "tiny_mlp", "--measurement-interval", "500",
                          "--stability-percentage", STABILITY_PERCENT, "--max-trials", "20", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("args", [
    ["-i", "http", "--concurrency-range", "1:4:3"],
    ["-i", "http", "-b", "4", "--concurrency-range", "2"],
    ["-i", "http", "--request-rate-range", "100"],
    ["-i", "grpc", "--concurrency-range", "4"],
    ["-i", "grpc", "--async", "--concurrency-range", "8"],
    ["-i", "grpc", "--streaming", "--concurrency-range", "4"],
], ids=["http-concurrency", "http-batch-4", "http-request-rate", "grpc", "grpc-async", "grpc-streaming"])
def test_perf_analyzer_measures_gpuloom_and_every_request_is_booked(server, args):
    http_port, grpc_port = server
    url = f"127.0.0.1:{grpc_port if args[1] == 'grpc' else http_port}"
    before = _successes(http_port)
    out = _run("-u", url, *args)
    sent = sum(int(n) for n in re.findall(r"Request count: (\d+)", out))
    assert sent > 0 and "Throughput:" in out, out
    # perf_analyzer's own statistics read back (its Server section) and gpuloom's books agree on
    # at least what the measured windows sent (warm-up and stabilizing windows send more)
    assert "Server:" in out and "Avg request latency" in out, out
    assert _successes(http_port) - before >= sent
