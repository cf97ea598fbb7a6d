"""scripts/protocol_pairs.py: same-run win counts between two servers of bench_protocol JSON."""

from __future__ import annotations

import json

from script_loader import load_script


def _result(p50, p99, c1, c8):
    return {"fixed_rate": {"p50_ms": p50, "p99_ms": p99}, "closed_c1": {"throughput": c1},
            "closed_c8": {"throughput": c8}}


def test_wins_are_counted_run_by_run_lower_latency_and_higher_throughput_winning(tmp_path):
    pairs = load_script("protocol_pairs")
    runs = [{"a": _result(1.0, 3.0, 100, 900), "b": _result(2.0, 2.0, 90, 1000)},
            {"a": _result(2.5, 1.0, 80, 950), "b": _result(2.0, 4.0, 90, 900)},
            {"b": _result(1.0, 1.0, 1, 1)}]  # a run without A is not counted
    (tmp_path / "set1.json").write_text(json.dumps({"runs": runs}))
    (tmp_path / "one.json").write_text(json.dumps({"servers": runs[0]}))  # a file of one run (no --repeat)
    out = pairs.compare([tmp_path / "set1.json", tmp_path / "one.json"], "a", "b")
    assert out["a_won"] == {"p50_ms": "2 of 3", "p99_ms": "1 of 3", "rps_c1": "2 of 3", "rps_c8": "1 of 3"}
    assert out["sign_test_p"] == {"p50_ms": 0.5, "p99_ms": 0.875, "rps_c1": 0.5, "rps_c8": 0.875}
    assert [(r["file"], r["run"]) for r in out["runs"]] == [("set1.json", 0), ("set1.json", 1), ("one.json", 0)]
    assert out["runs"][1]["p99_ms"] == [1.0, 4.0]


def test_figures_are_listed_latencies_first_then_by_concurrency_as_numbers():
    pairs = load_script("protocol_pairs")
    keys = ["rps_c32", "p99_ms", "rps_c8", "p50_ms", "rps_c1"]
    assert sorted(keys, key=pairs._figure_order) == ["p50_ms", "p99_ms", "rps_c1", "rps_c8", "rps_c32"]
