"""scripts/bench_models.py --batches: device ms per batch compared across bench reports, cell by cell."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

bm = load_script("bench_models")


def _report(points: list[list[tuple[str, int, int, float, int]]], engine: dict | None = None) -> dict:
    """A bench report whose points carry ``profile_check`` rows (model, SMs, batch, ms, batches)."""
    return {"meta": {"engine": engine or {}}, "policies": {"dstack": {"points": [
        {"scale": 1.0, "slo_attainment": 1.0, "models": [],
         "profile_check": [{"model": m, "sms": s, "batch": b, "measured_ms": ms, "batches": n}
                           for m, s, b, ms, n in rows]} for rows in points]}}}


def test_a_cells_batches_are_pooled_over_points_weighted_by_their_counts():
    t = bm.batch_times(_report([[("a", 16, 1, 1.0, 30), ("b", 16, 1, 9.0, 5)], [("a", 16, 1, 2.0, 10)]]),
                       models=["a"])
    assert list(t) == [("a", 16, 1)]  # b left out
    ms, n = t[("a", 16, 1)]
    assert n == 40 and ms == pytest.approx((1.0 * 30 + 2.0 * 10) / 40)


def test_only_cells_every_report_served_often_enough_are_compared_each_against_the_others_mean():
    tables = [{("a", 16, 1): (1.0, 60), ("a", 16, 2): (2.0, 60), ("a", 24, 1): (0.5, 10)},
              {("a", 16, 1): (0.8, 60), ("a", 16, 2): (1.6, 60), ("a", 24, 1): (0.4, 80)},
              {("a", 16, 1): (1.2, 70), ("a", 16, 2): (2.4, 55)}]
    cells = bm.compare_batches(tables, min_batches=50)
    assert [(c["sms"], c["batch"]) for c in cells] == [(16, 1), (16, 2)]  # 24 SMs: too few in [0], none in [2]
    first = cells[0]
    assert first["ms"] == [1.0, 0.8, 1.2] and first["batches"] == [60, 60, 70]
    assert first["ratio_to_others"] == pytest.approx([1.0 / 1.0, 0.8 / 1.1, 1.2 / 0.9], abs=1e-4)
    with pytest.raises(ValueError, match="two or more"):
        bm.compare_batches(tables[:1], min_batches=1)


def test_the_command_prints_each_cell_and_writes_the_comparison(tmp_path, capsys):
    paths = []
    for i, (ms, engine) in enumerate([(1.0, {"fuse_epilogues": False}), (0.8, {}), (1.1, {"fuse_epilogues": False})]):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(_report([[("m", 16, 4, ms, 100)]], engine)))
        paths.append(str(p))
    out = tmp_path / "cells.json"
    assert bm.main([*paths, "--batches", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "[0] r0.json [fuse_epilogues=False]" in text and "[1] r1.json [defaults]" in text
    assert "m 16 SMs batch 4: [0] 1.000 ms" in text
    assert "[1] ratio to the others: median 0.762" in text and "lowest of all in 1 of 1 cells" in text
    assert json.loads(out.read_text())["cells"][0]["ms"] == [1.0, 0.8, 1.1]
    assert bm.main([paths[0], "--batches"]) == 2  # one report: nothing to compare
    assert "two or more" in capsys.readouterr().err
