"""scripts/soak_serve.py: a short soak of the real server (both models, HTTP and gRPC, bad inputs,
cut connections, an unload/load cycle) ends with every answer as expected, the books balanced and a
clean SIGTERM; and its resource trend reads a growth that is there."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script

soak = load_script("soak_serve")


def test_the_trend_reads_growth_in_the_second_half_and_none_in_a_flat_series():
    flat = [{"t": float(t), "fds": 40} for t in range(0, 61, 2)]
    growing = [{"t": float(t), "fds": 40 + max(0, t - 30) // 2} for t in range(0, 61, 2)]
    assert soak.trend(flat, "fds")["second_half_slope_per_min"] == pytest.approx(0.0, abs=1e-9)
    g = soak.trend(growing, "fds")
    assert g["second_half_slope_per_min"] == pytest.approx(30.0, rel=0.05)  # one descriptor per 2 s
    assert (g["at_20pct"], g["end"], g["max"]) == (40, 55, 55)
    assert soak.growing(growing, "fds") and not soak.growing(flat, "fds")
    wavy = [{"t": float(t), "fds": 40 + (t // 2) % 5} for t in range(0, 61, 2)]  # connections come and go
    assert not soak.growing(wavy, "fds")


def test_the_collections_during_the_traffic_leave_out_start_ups():
    """The metrics keep running totals and the longest pause so far: start-up's collections (a load's
    full collection of the whole heap, 168-171 ms on the build VM) must not read as the traffic's."""
    start = {"collections": {"0": 762.0, "1": 70.0, "2": 4.0}, "pause_ms": 348.8, "max_pause_ms": 168.0}
    quiet = {"collections": {"0": 1136.0, "1": 104.0, "2": 4.0}, "pause_ms": 559.2, "max_pause_ms": 168.0}
    d = soak.gc_between(start, quiet)
    assert d["collections"] == {"0": 374.0, "1": 34.0, "2": 0.0}
    assert d["pause_ms"] == pytest.approx(210.4) and d["max_pause_ms"] is None and d["max_pause_ms_at_start"] == 168.0
    spiky = dict(quiet, max_pause_ms=200.0)
    assert soak.gc_between(start, spiky)["max_pause_ms"] == 200.0
    assert soak.gc_between(None, quiet) is None


@pytest.mark.slow
def test_a_short_soak_of_the_real_server_answers_everything_as_expected(tmp_path):
    out = tmp_path / "soak.json"
    soak.main(["--duration", "8", "--rate", "40", "--cycle-s", "3", "--sample-s", "0.5", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["unexpected"] == [] and r["unexpected_n"] == 0, r["unexpected"]
    assert r["answer_mismatches"] == 0
    assert r["cycles"] >= 1 and r["outcomes"]["cycle"] == {"reloaded": r["cycles"]}
    assert r["outcomes"]["http"].get("200", 0) > 50 and r["outcomes"]["grpc"].get("OK", 0) > 25
    assert sum(r["outcomes"]["bad"].values()) > 10 and sum(r["outcomes"]["cut"].values()) > 5
    assert r["books_balanced"] and set(r["books"]) >= {"tiny_mlp", "tiny_cnn"}
    assert r["server_alive_at_end"] and r["sigterm_exit_code"] == 0
    assert r["gc_during_traffic"] is not None and r["gc_during_traffic"]["pause_ms"] >= 0
