"""scripts/bench_engine.py's CPU-side plumbing: children run in parallel, each answered in order."""

from __future__ import annotations

import sys
import time

from script_loader import load_script


def test_prewarm_children_run_in_parallel_in_order_and_a_hung_one_is_killed():
    eng = load_script("bench_engine")
    sleep = [sys.executable, "-c", "import time; time.sleep(0.6); print('done')"]
    fail = [sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"]
    hang = [sys.executable, "-c", "import time; time.sleep(30)"]
    t0 = time.perf_counter()
    res = eng.run_parallel([sleep, sleep, fail, sleep, hang], jobs=3, timeout_s=2.0)
    wall = time.perf_counter() - t0
    assert [r["rc"] for r in res] == [0, 0, 3, 0, None]  # in the order given; None: killed at the timeout
    assert "done" in res[0]["tail"] and "bad" in res[2]["tail"]
    # three at a time: the fourth sleep starts when the failing child ends and runs beside the first two,
    # and the hang starts when they end: the first sleep plus the hang in all (2.7 s here, 2.8 s on two
    # busy cores). Held against the children's own times, which include their start-up (longer on a busy
    # host): less than the first sleep, the fourth and the hang one after another (3.4 s here)
    s = [r["seconds"] for r in res]
    assert wall < s[0] + s[3] + s[4], (wall, s)
    assert 1.9 <= res[4]["seconds"] < 4.0


def test_ratios_skip_variants_that_were_not_timed():
    """A torch.compile-only call (`--variants eager,gpuloom,torch_compile`) has no CUDA graph column:
    its rows keep their timings and speedups instead of failing after the timing (run 15 lost six)."""
    eng = load_script("bench_engine")
    row = {"batch": 1, "eager_ms": 8.0, "gpuloom_single_ms": 2.0, "gpuloom_multi_ms": 1.0,
           "gpuloom_auto_ms": 1.0, "torch_compile_ms": 4.0}
    eng.add_ratios(row)
    assert row["speedup_torch_compile"] == 2.0 and row["speedup_gpuloom_auto"] == 8.0
    assert "multi_over_single_graph" not in row and "auto_over_single_graph" not in row
    row = {"batch": 8, "eager_ms": 6.0, "cuda_graph_ms": 3.0, "gpuloom_multi_ms": 2.0, "gpuloom_auto_ms": 1.5,
           "critical_path_ms": 1.0}
    eng.add_ratios(row)
    assert (row["multi_over_single_graph"], row["auto_over_single_graph"], row["multi_over_critical_path"]) == (
        1.5, 2.0, 2.0)
    assert "speedup_critical_path" not in row


def test_torch_compile_rows_merge_last_run_first_and_name_the_rows_still_missing(tmp_path):
    import json

    merge = load_script("merge_engine_results")

    def run(name, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"results": [
            {"model": m, "dtype": "float32", "rows": [{"batch": b, "eager_ms": 5.0, "gpuloom_auto_ms": g,
                                                       "torch_compile_ms": t}]} for m, b, g, t in rows]}))
        return str(path)

    old = run("old.json", [("resnet50", 1, 1.0, 0.5), ("googlenet", 1, 1.0, 2.0)])
    new = run("new.json", [("resnet50", 1, 1.0, 1.01), ("resnet50", 8, 2.0, 1.0)])
    tc = merge.torch_compile_rows([old, new])
    got = {(r["model"], r["batch"]): (r["winner"], r["ratio"], r["run"]) for r in tc}
    assert got == {("resnet50", 1): ("tie", 1.01, "new.json"),  # the later run's figure, within 2%
                   ("resnet50", 8): ("torch_compile", 2.0, "new.json"),
                   ("googlenet", 1): ("gpuloom", 2.0, "old.json")}
    results = [{"model": m, "dtype": "float32", "rows": [{"batch": 1}, {"batch": 8}]} for m in ("resnet50", "googlenet")]
    s = merge.torch_compile_summary(tc, results)
    assert s["wins"] == {"gpuloom": 1, "torch_compile": 1, "tie": 1}
    assert "googlenet float32 b8" in s["missing"] and "resnet50 float16 b1" in s["missing"]
    assert "resnet50 float32 b8" not in s["missing"] and len(s["missing"]) == 8 - 3


def test_layout_rows_take_the_last_run_and_the_summary_keeps_the_faster_layout_per_row(tmp_path):
    import json
    import math

    merge = load_script("merge_engine_results")

    def run(name, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"results": [
            {"model": m, "dtype": "float32", "rows": [{"batch": 1, "eager_ms": e, "gpuloom_auto_ms": a,
                                                       "gpuloom_cl_ms": c}]} for m, e, a, c in rows]}))
        return str(path)

    old = run("old.json", [("resnet50", 8.0, 1.0, 0.5)])
    new = run("new.json", [("resnet50", 8.0, 1.0, 0.8), ("mobilenet_v2", 4.0, 0.4, 0.5),
                           ("googlenet", 4.0, 0.5, None)])  # no channels-last figure: not a row
    rows = merge.layout_rows([old, new])
    assert [(r["model"], r["gpuloom_cl_ms"], r["run"]) for r in rows] == [
        ("mobilenet_v2", 0.5, "new.json"), ("resnet50", 0.8, "new.json")]
    s = merge.layout_summary(rows)["float32_b1"]
    assert s["channels_last_faster"] == ["resnet50"] and s["channels_last_slower"] == ["mobilenet_v2"]
    assert s["models"] == 2
    assert math.isclose(s["geomean_auto_over_eager"], math.sqrt(8.0 * 10.0), rel_tol=1e-3)
    assert math.isclose(s["geomean_channels_last_over_eager"], math.sqrt(10.0 * 8.0), rel_tol=1e-3)
    assert math.isclose(s["geomean_faster_over_eager"], math.sqrt(10.0 * 10.0), rel_tol=1e-3)
    assert s["nimble_targets"]["resnet50"] == {"target": 4.3, "auto": 8.0, "channels_last": 10.0, "faster": 10.0}
    assert "cl_auto" not in s  # no row timed channels_last="auto"


def test_layout_summary_checks_channels_last_auto_against_the_faster_layout_of_its_row(tmp_path):
    """Rows that also timed ``channels_last="auto"``: its geomeans, and the row where it is furthest
    behind the faster of the two layouts timed beside it (does its compile-time choice hold?)."""
    import json
    import math

    merge = load_script("merge_engine_results")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": [
        {"model": m, "dtype": "float32", "rows": [{"batch": 1, "eager_ms": e, "gpuloom_auto_ms": a,
                                                   "gpuloom_cl_ms": c, "gpuloom_cl_auto_ms": ca}]}
        for m, e, a, c, ca in [("resnet50", 8.0, 1.0, 0.8, 0.8), ("mobilenet_v2", 4.0, 0.4, 0.5, 0.5)]]}))
    s = merge.layout_summary(merge.layout_rows([str(path)]))["float32_b1"]["cl_auto"]
    assert s["models"] == 2 and s["worst_over_faster"] == (0.8, "mobilenet_v2")  # it kept the slower layout
    assert math.isclose(s["geomean_over_eager"], math.sqrt(10.0 * 8.0), rel_tol=1e-3)
    assert math.isclose(s["geomean_over_auto"], math.sqrt(1.25 * 0.8), rel_tol=1e-3)


def test_torch_compile_rows_also_judge_compiles_default_where_the_run_timed_it(tmp_path):
    """Runs that timed ``gpuloom_cl_auto`` (compile's default, channels_last="auto") get a second
    verdict against it; older runs keep only the NCHW one, and the summary counts them apart."""
    import json

    merge = load_script("merge_engine_results")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": [
        {"model": "resnet101", "dtype": "float16", "rows": [
            {"batch": 1, "eager_ms": 7.0, "gpuloom_auto_ms": 1.6, "gpuloom_cl_auto_ms": 1.0, "torch_compile_ms": 1.1},
            {"batch": 8, "eager_ms": 7.0, "gpuloom_auto_ms": 2.4, "torch_compile_ms": 1.4}]}]}))
    tc = merge.torch_compile_rows([str(path)])
    by = {r["batch"]: r for r in tc}
    assert (by[1]["winner"], by[1]["winner_default"], by[1]["ratio_default"]) == ("torch_compile", "gpuloom", 1.1)
    assert by[8]["winner_default"] is None and by[8]["gpuloom_cl_auto_ms"] is None
    summary = merge.torch_compile_summary(tc, [{"model": "resnet101", "dtype": "float16", "rows": []}])
    assert summary["default_rows"] == 1 and summary["default_wins"]["gpuloom"] == 1
    assert summary["wins"]["torch_compile"] == 2



def test_pairs_time_the_rows_named_in_order_and_refuse_a_bad_item():
    eng = load_script("bench_engine")
    assert eng.pairs_from("a,b", "float32,float16", None) == [
        ("a", "float32"), ("b", "float32"), ("a", "float16"), ("b", "float16")]
    assert eng.pairs_from("ignored", "float32", "densenet121:float32,efficientnet_b5:float16") == [
        ("densenet121", "float32"), ("efficientnet_b5", "float16")]
    import pytest

    for bad in ("densenet121", "densenet121:fp16", ":float32"):
        with pytest.raises(ValueError, match="MODEL:DTYPE"):
            eng.pairs_from("a", "float32", bad)


def test_a_child_that_aborts_keeps_its_error_message_past_the_cpp_stack_frames(monkeypatch):
    """Run 26: torch's SIGABRT printed the error, then ~30 C++ frames that filled the kept tail."""
    import subprocess
    import types

    eng = load_script("bench_engine")
    said = ("timing nasnetalarge\nRuntimeError: CUDA error: operation not permitted when stream is capturing\n"
            "Exception raised from insert_events at CUDACachingAllocator.cpp:3726 (most recent call first):\n"
            + "".join(f"frame #{i}: /opt/lib/libtorch_python.so(+0x{i:06x}) [0x7f{i:010x}]\n" for i in range(120)))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a[0], -6, "", said))
    args = types.SimpleNamespace(batches="1,8", variants={"eager"}, torch_compile_batches={1}, warmup=1, iters=1,
                                 rounds=1, lower_bound=False, model_timeout=5)
    res = eng.run_child("nasnetalarge", "float16", args)
    assert res["error"].startswith("child exited with -6")
    assert "operation not permitted when stream is capturing" in res["error"]
    assert "frame #" not in res["error"]


def test_a_row_without_the_cuda_graph_variant_counts_over_eager_and_is_named_apart():
    """Run 26b timed nasnetalarge float16 without the eager CUDA graph: its row joins the geometric
    mean over eager, stays out of the ratios to the graph, and the summary says so."""
    merge = load_script("merge_engine_results")

    def rec(model, speedup, graph=None):
        row = {"batch": 1, "speedup_gpuloom_auto": speedup}
        if graph is not None:
            row.update(multi_over_single_graph=graph, auto_over_single_graph=graph)
        return {"model": model, "dtype": "float16", "rows": [row]}

    s = merge.main_summary([rec("googlenet", 4.0, 1.5), rec("resnet50", 2.0, 0.97), rec("nasnetalarge", 16.0)])
    b1 = s["float16_b1"]
    assert b1["models"] == 3 and abs(b1["geomean_speedup_auto_over_eager"] - 5.04) < 0.01  # (4*2*16)^(1/3)
    assert b1["geomean_multi_over_cuda_graph_branchy"] == 1.5  # googlenet only
    assert b1["auto_over_cuda_graph_worst"] == (0.97, "resnet50")
    assert b1["auto_slower_than_cuda_graph_by_more_than_2pct"] == ["resnet50"]
    assert b1["without_cuda_graph"] == ["nasnetalarge"]
    alone = merge.main_summary([rec("nasnetalarge", 16.0)])["float16_b1"]
    assert alone["geomean_multi_over_cuda_graph_branchy"] is None and alone["auto_over_cuda_graph_worst"] is None


def test_defaults_rows_compare_the_fused_default_with_the_unfused_one_and_torch_compile_judges_the_newer(tmp_path):
    """``--defaults``: rows that timed compile's default fused (since the thirty-fourth session) and
    unfused; the geomeans over eager, fused over unfused with its worst row, the Nimble targets. The
    torch.compile verdict "vs default" takes the fused variant where a run timed it."""
    import json
    import math

    merge = load_script("merge_engine_results")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": [
        {"model": m, "dtype": "float32", "auto_choice_cl_auto_fused": {"1": kept},
         "rows": [{"batch": 1, "eager_ms": e, "gpuloom_auto_ms": a, "gpuloom_cl_auto_ms": u,
                   "gpuloom_cl_auto_fused_ms": f, "torch_compile_ms": 0.6}]}
        for m, e, a, u, f, kept in [("resnet50", 4.0, 1.0, 0.8, 0.5, "multi_cl"),
                                    ("googlenet", 4.0, 0.5, 0.5, 0.52, "multi")]]}))
    rows = merge.default_rows([str(path)])
    by = {r["model"]: r for r in rows}
    assert by["resnet50"]["kept"] == "multi_cl" and by["resnet50"]["fused_over_unfused"] == 1.6
    s = merge.default_summary(rows)["float32_b1"]
    assert s["models"] == 2 and s["worst_fused_over_unfused"] == (0.962, "googlenet")
    assert math.isclose(s["geomean_default_over_eager"], math.sqrt(8.0 * 4.0 / 0.52), rel_tol=1e-3)
    assert math.isclose(s["geomean_cl_auto_over_eager"], math.sqrt(5.0 * 8.0), rel_tol=1e-3)
    assert s["nimble_targets"] == {"resnet50": {"target": 4.3, "default": 8.0, "met": True}}
    tc = {r["model"]: r for r in merge.torch_compile_rows([str(path)])}
    assert tc["resnet50"]["default_variant"] == "gpuloom_cl_auto_fused" and tc["resnet50"]["default_ms"] == 0.5
    assert tc["resnet50"]["winner_default"] == "gpuloom" and tc["googlenet"]["winner_default"] == "gpuloom"
    assert tc["resnet50"]["winner"] == "torch_compile"  # against NCHW-only auto, 1.0 ms
    summary = merge.torch_compile_summary(list(tc.values()), [])
    assert summary["default_wins_by_variant"] == {"gpuloom_cl_auto_fused": {"gpuloom": 2, "torch_compile": 0, "tie": 0}}


def test_rel_err_refuses_a_reference_that_overflowed_or_vanished():
    """A float16 eager output that overflowed (inf / NaN) or vanished (all zero) is no reference: the
    row says None rather than 0.0, which read as a perfect match in runs 100-104."""
    import torch

    bench = load_script("bench_engine")
    want = torch.tensor([3.0, 4.0])
    assert bench.rel_err(torch.tensor([3.0, 4.0]), want) == 0.0
    assert abs(bench.rel_err(torch.tensor([3.0, 4.5]), want) - 0.1) < 1e-12
    for bad in (torch.tensor([float("inf"), 1.0]), torch.tensor([float("nan"), 1.0])):
        assert bench.rel_err(torch.zeros(2), bad) is None and bench.rel_err(want, bad) is None
    assert bench.rel_err(torch.zeros(2), torch.zeros(2)) is None  # both vanished: nothing checked
    assert bench.rel_err(want, torch.zeros(2)) == float("inf")  # eager vanished, the graph did not


def test_only_the_fused_variant_compiles_fused_and_every_other_column_keeps_its_meaning():
    """compile's default fuses the channels-last candidate since the thirty-fourth session, splits
    float32 GEMMs since the thirty-ninth, fuses convolution epilogues since the fortieth and
    squeeze-excitation gates since the forty-first; the bench's gpuloom, gpuloom_cl, gpuloom_cl_auto,
    gpuloom_reinplace, gpuloom_cl_auto_fused, gpuloom_split and gpuloom_epilogue columns must stay what
    earlier runs timed (unfused, unsplit and eager's epilogues and gates where they were, gpuloom's in
    the model's own layout), and gpuloom_gates is the default."""
    import inspect

    import gpuloom

    bench = load_script("bench_engine")
    resolved = {k: bench.compile_options(o) for k, o in {"gpuloom": {}, **bench.EXPERIMENTS}.items()}
    assert {k for k, o in resolved.items() if o["fuse_convolutions"] is not False} == {
        "gpuloom_cl_auto_fused", "gpuloom_split", "gpuloom_epilogue", "gpuloom_gates"}
    assert {k for k, o in resolved.items() if o["split_gemms"]} == {"gpuloom_split", "gpuloom_epilogue", "gpuloom_gates"}
    assert {k for k, o in resolved.items() if o["fuse_epilogues"]} == {"gpuloom_epilogue", "gpuloom_gates"}
    assert {k for k, o in resolved.items() if o["fuse_gates"]} == {"gpuloom_gates"}
    off = {"channels_last": False, "fuse_convolutions": False, "split_gemms": False, "fuse_epilogues": False,
           "fuse_gates": False}
    assert resolved["gpuloom"] == off
    default = {k: p.default for k, p in inspect.signature(gpuloom.compile).parameters.items()}
    # None: channels_last "auto", fuse_convolutions "channels_last", the rest on for CUDA
    assert {k: default[k] for k in off} == dict.fromkeys(off)
    fused = {"channels_last": "auto", "fuse_convolutions": "channels_last"}
    assert resolved["gpuloom_cl_auto_fused"] == {**off, **fused}
    assert resolved["gpuloom_split"] == {**off, **fused, "split_gemms": True}
    assert resolved["gpuloom_epilogue"] == {**off, **fused, "split_gemms": True, "fuse_epilogues": True}
    assert resolved["gpuloom_gates"] == {**fused, "split_gemms": True, "fuse_epilogues": True, "fuse_gates": True}
