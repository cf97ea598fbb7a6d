"""Legend names of scripts/plot_bench.py."""

from __future__ import annotations

from script_loader import load_script

plot = load_script("plot_bench")


def test_an_option_naming_a_report_shows_the_run_it_came_from_not_its_path():
    p = "docs/results/runtime/bench_overload_h200_run54_warmup.json"
    assert plot.short_name(f"dstack:holds={p}:slowdowns={p}") == "dstack:holds=run54:slowdowns=run54"
    assert plot.short_name("dstack:holds=/tmp/my_holds.json") == "dstack:holds=my_holds"
    assert plot.short_name("dstack:adapt=true:batch_overhead_ms=1") == "dstack:adapt=true:batch_overhead_ms=1"
    assert plot.short_name("triton") == "triton"
    assert plot.short_name(f"dstack:holds={p}#2") == "dstack:holds=run54#2"  # a repeat stays told apart
