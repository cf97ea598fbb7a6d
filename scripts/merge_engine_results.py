"""Merge engine benchmark runs into docs/results/engine_h200.json and print the markdown tables.

    python scripts/merge_engine_results.py docs/results/engine_runs/run5_fp32.json ... \
        --out docs/results/engine_h200.json

Each (model, dtype) comes from exactly one run (the last file that has it), so every ratio in a row
is measured side by side in one process.

    ... --torch-compile docs/results/engine_runs/run8_fp32_tc.json ...

adds the torch.compile comparison: each (model, dtype, batch) with a ``torch_compile_ms`` from the last
of these runs that has one, against gpuloom auto timed in the same process (not the main table's run).

    ... --layouts docs/results/engine_runs/run18_fp32_b1_channels_last.json ...

adds the channels-last comparison the same way: each row with a ``gpuloom_cl_ms`` (``compile(channels_last=
True)``) against gpuloom auto and eager of its own process, with the geometric means over eager of auto,
channels-last and the faster of the two per row (what ``channels_last="auto"`` keeps where its
compile-time timing agrees), and the Nimble targets for each.

    ... --defaults docs/results/engine_runs/run102_fused.json ...

adds compile's default since the thirty-fourth session (the ``gpuloom_cl_auto_fused`` variant: both
layouts timed, the channels-last graph's convolutions fused) against its unfused predecessor
(``gpuloom_cl_auto``), gpuloom auto and eager of its own process, with the Nimble targets.

    ... --splits docs/results/engine_runs/run128_split_fp32.json ...

adds compile's default since the thirty-ninth session (the ``gpuloom_split`` variant: the fused
default with float32 linear layers splitting K where timed faster) against the fused default without
(``gpuloom_cl_auto_fused``) and eager of its own process, with the Nimble targets.

    ... --epilogues docs/results/engine_runs/run136_epilogue_fp32.json ...

adds compile's default since the fortieth session (the ``gpuloom_epilogue`` variant: the split default
with each convolution's bias (+ add) + SiLU / sigmoid / ReLU6 in one kernel) against the split
default without (``gpuloom_split``) and eager of its own process, with the Nimble targets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpuloom.bench.metrics import geomean  # noqa: E402  (torch-free: the merge runs anywhere)

NIMBLE_V100 = {"resnet50": 4.3, "resnet101": 4.6, "inception_v3": 5.2, "mobilenet_v2": 10.0,
               "efficientnet_b0": 9.0, "efficientnet_b5": 3.8, "nasnetalarge": 5.5}
BRANCHY = ("inception_v3", "googlenet", "nasnetalarge", "efficientnet_b0")
#: within this ratio either way a torch.compile row is a tie (the 2% the issue allows streams="auto")
TIE = 1.02


def main_summary(results: list[dict]) -> dict:
    """Per dtype and batch: the geometric mean of gpuloom auto over eager on every row, and the
    ratios to the single-stream CUDA graph of eager's forward on the rows whose run timed it (a row
    from a run without the ``cuda_graph`` variant is named under ``without_cuda_graph``)."""
    summary = {}
    for dtype in ("float32", "float16"):
        for b in (1, 8):
            rows = [(r["model"], row) for r in results if r["dtype"] == dtype for row in r["rows"] if row["batch"] == b]
            if not rows:
                continue
            graph = [(m, row) for m, row in rows if "multi_over_single_graph" in row]
            branchy = [row["multi_over_single_graph"] for m, row in graph if m in BRANCHY]
            summary[f"{dtype}_b{b}"] = {
                "models": len(rows),
                "geomean_speedup_auto_over_eager": round(geomean([row["speedup_gpuloom_auto"] for _, row in rows]), 3),
                "geomean_multi_over_cuda_graph_branchy": round(geomean(branchy), 3) if branchy else None,
                "auto_over_cuda_graph_worst": min(((round(row["auto_over_single_graph"], 3), m) for m, row in graph),
                                                  default=None),
                "auto_slower_than_cuda_graph_by_more_than_2pct": sorted(
                    m for m, row in graph if row["auto_over_single_graph"] < 0.98),
                **({"without_cuda_graph": sorted(m for m, row in rows if "multi_over_single_graph" not in row)}
                   if len(graph) < len(rows) else {}),
            }
    return summary


def last_rows(paths: list[str], make_row) -> list[dict]:
    """One row per (model, dtype, batch) that ``make_row(rec, row)`` makes (None: the row lacks what it
    needs), from the last run in ``paths`` that has it, tagged with that run; float32 first."""
    rows: dict[tuple[str, str, int], dict] = {}
    for path in paths:
        for rec in json.loads(Path(path).read_text())["results"]:
            for row in rec.get("rows", ()):
                made = make_row(rec, row)
                if made is not None:
                    rows[(rec["model"], rec["dtype"], row["batch"])] = {
                        "model": rec["model"], "dtype": rec["dtype"], "batch": row["batch"], **made,
                        "run": Path(path).name}
    return sorted(rows.values(), key=lambda r: (r["dtype"] != "float32", r["model"], r["batch"]))


def _winner(gl: float, tc: float) -> tuple[str, float]:
    """Who is faster, gpuloom (``gl`` ms) or torch.compile (``tc`` ms), and by what ratio; a tie within 2%."""
    ratio = tc / gl if gl <= tc else gl / tc
    return ("tie" if ratio < TIE else "gpuloom" if gl < tc else "torch_compile"), round(ratio, 3)


def torch_compile_rows(paths: list[str]) -> list[dict]:
    """One row per (model, dtype, batch) timed with torch.compile: the last run in ``paths`` that has it.
    ``winner`` is against gpuloom auto in the model's own layout (every run has it); ``winner_default``
    against compile's default where the run timed it, else None: the ``gpuloom_cl_auto_fused`` variant
    (the default since the thirty-fourth session), or in older runs ``gpuloom_cl_auto`` (the default
    of sessions 21-33), named in ``default_variant``."""
    def make_row(rec: dict, row: dict) -> dict | None:
        if not (row.get("torch_compile_ms") and row.get("gpuloom_auto_ms")):
            return None
        variant = next((v for v in ("gpuloom_cl_auto_fused", "gpuloom_cl_auto") if row.get(f"{v}_ms")), None)
        gl, tc, default = row["gpuloom_auto_ms"], row["torch_compile_ms"], row.get(f"{variant}_ms")
        winner, ratio = _winner(gl, tc)
        winner_default, ratio_default = _winner(default, tc) if default else (None, None)
        return {"eager_ms": row.get("eager_ms"), "gpuloom_auto_ms": gl, "gpuloom_cl_auto_ms": row.get("gpuloom_cl_auto_ms"),
                "default_variant": variant, "default_ms": default,
                "torch_compile_ms": tc, "torch_compile_s": row.get("torch_compile_s"),
                "winner": winner, "ratio": ratio, "winner_default": winner_default, "ratio_default": ratio_default}

    return last_rows(paths, make_row)


def torch_compile_summary(tc: list[dict], results: list[dict]) -> dict:
    """Who wins how many rows; which rows of the main table have no torch.compile figure yet."""
    have = {(r["model"], r["dtype"], r["batch"]) for r in tc}
    models = sorted({r["model"] for r in results})  # every model in both dtypes at batch 1 and 8 (issue 2)
    every = [(m, d, b) for d in ("float32", "float16") for m in models for b in (1, 8)]
    return {
        "rows": len(tc),
        "wins": {w: sum(r["winner"] == w for r in tc) for w in ("gpuloom", "torch_compile", "tie")},
        "geomean_torch_compile_over_gpuloom_auto": round(geomean(
            [r["torch_compile_ms"] / r["gpuloom_auto_ms"] for r in tc]), 3),
        # against compile's default, on the rows whose run timed it, counted per variant: the unfused
        # default of sessions 21-33 (gpuloom_cl_auto) and the fused one since (gpuloom_cl_auto_fused)
        "default_rows": sum(r["winner_default"] is not None for r in tc),
        "default_wins": {w: sum(r["winner_default"] == w for r in tc) for w in ("gpuloom", "torch_compile", "tie")},
        "default_wins_by_variant": {
            v: {w: sum(r["winner_default"] == w for r in tc if r.get("default_variant") == v)
                for w in ("gpuloom", "torch_compile", "tie")}
            for v in sorted({r["default_variant"] for r in tc if r.get("default_variant")})},
        "missing": [f"{m} {d} b{b}" for m, d, b in every if (m, d, b) not in have],
    }


def layout_rows(paths: list[str]) -> list[dict]:
    """One row per (model, dtype, batch) timed with channels-last weights: the last run in ``paths`` that has it."""
    def make_row(rec: dict, row: dict) -> dict | None:
        if not (row.get("gpuloom_cl_ms") and row.get("gpuloom_auto_ms") and row.get("eager_ms")):
            return None
        auto, cl = row["gpuloom_auto_ms"], row["gpuloom_cl_ms"]
        return {"eager_ms": row["eager_ms"], "gpuloom_auto_ms": auto, "gpuloom_cl_ms": cl,
                "gpuloom_cl_auto_ms": row.get("gpuloom_cl_auto_ms"), "cl_over_auto": round(auto / cl, 3)}

    return last_rows(paths, make_row)


def layout_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): geometric means over eager of auto, channels-last and the faster of the two,
    and, at float32 batch 1, each Nimble target met by which."""
    out = {}
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in rows}):
        sel = [r for r in rows if (r["dtype"], r["batch"]) == (dtype, batch)]
        speed = {k: {r["model"]: r["eager_ms"] / ms(r) for r in sel} for k, ms in (
            ("auto", lambda r: r["gpuloom_auto_ms"]), ("channels_last", lambda r: r["gpuloom_cl_ms"]),
            ("faster", lambda r: min(r["gpuloom_auto_ms"], r["gpuloom_cl_ms"])))}
        entry = {"models": len(sel), **{f"geomean_{k}_over_eager": round(geomean(v.values()), 3) for k, v in speed.items()},
                 "channels_last_faster": sorted(r["model"] for r in sel if r["cl_over_auto"] > TIE),  # beyond noise
                 "channels_last_slower": sorted(r["model"] for r in sel if r["cl_over_auto"] < 1 / TIE),
                 "geomean_cl_over_auto": round(geomean([r["cl_over_auto"] for r in sel]), 3)}
        both = [r for r in sel if r["gpuloom_cl_auto_ms"]]  # rows that also timed channels_last="auto"
        if both:  # does its compile-time choice keep the faster layout when timed again?
            entry["cl_auto"] = {
                "models": len(both),
                "geomean_over_eager": round(geomean([r["eager_ms"] / r["gpuloom_cl_auto_ms"] for r in both]), 3),
                "geomean_over_auto": round(geomean([r["gpuloom_auto_ms"] / r["gpuloom_cl_auto_ms"] for r in both]), 3),
                "worst_over_faster": min((round(min(r["gpuloom_auto_ms"], r["gpuloom_cl_ms"]) / r["gpuloom_cl_auto_ms"], 3),
                                          r["model"]) for r in both)}
        if (dtype, batch) == ("float32", 1):
            entry["nimble_targets"] = {m: {"target": t, **{k: round(v[m], 2) for k, v in speed.items()}}
                                       for m, t in NIMBLE_V100.items() if m in speed["auto"]}
        out[f"{dtype}_b{batch}"] = entry
    return out


def default_rows(paths: list[str]) -> list[dict]:
    """One row per (model, dtype, batch) timed with compile's default and its unfused predecessor."""
    def make_row(rec: dict, row: dict) -> dict | None:
        keys = ("eager_ms", "gpuloom_auto_ms", "gpuloom_cl_auto_ms", "gpuloom_cl_auto_fused_ms")
        if not all(row.get(k) for k in keys):
            return None
        return {**{k: row[k] for k in keys},
                "kept": rec.get("auto_choice_cl_auto_fused", {}).get(str(row["batch"])),
                "fused_over_unfused": round(row["gpuloom_cl_auto_ms"] / row["gpuloom_cl_auto_fused_ms"], 3)}

    return last_rows(paths, make_row)


def default_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): geometric means over eager of gpuloom auto (NCHW), the unfused and the fused
    default, the fused default over the unfused one with its worst row, and at float32 batch 1 the
    Nimble targets."""
    return variant_summary(rows, (("auto", "gpuloom_auto"), ("cl_auto", "gpuloom_cl_auto"),
                                  ("default", "gpuloom_cl_auto_fused")), ratio="fused_over_unfused", target="default")


def variant_summary(rows: list[dict], columns: tuple[tuple[str, str], ...], *, ratio: str, target: str,
                    best: bool = False) -> dict:
    """Per (dtype, batch) of ``rows``: the geometric mean over eager of each ``(label, column)``, of the
    rows' ``ratio`` with its worst row (and its best, with ``best``), and at float32 batch 1 the Nimble
    targets met by the column labelled ``target``."""
    out = {}
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in rows}):
        sel = [r for r in rows if (r["dtype"], r["batch"]) == (dtype, batch)]
        over = {k: {r["model"]: r["eager_ms"] / r[f"{col}_ms"] for r in sel} for k, col in columns}
        entry = {"models": len(sel), **{f"geomean_{k}_over_eager": round(geomean(v.values()), 3) for k, v in over.items()},
                 f"geomean_{ratio}": round(geomean([r[ratio] for r in sel]), 3)}
        if best:
            entry[f"best_{ratio}"] = max((r[ratio], r["model"]) for r in sel)
        entry[f"worst_{ratio}"] = min((r[ratio], r["model"]) for r in sel)
        if (dtype, batch) == ("float32", 1):
            entry["nimble_targets"] = {m: {"target": t, target: round(over[target][m], 2),
                                           "met": over[target][m] >= t}
                                       for m, t in NIMBLE_V100.items() if m in over[target]}
        out[f"{dtype}_b{batch}"] = entry
    return out


def successor_rows(paths: list[str], before: str, after: str, count: str, ratio: str) -> list[dict]:
    """One row per (model, dtype, batch) timed with the default variant ``after`` and the default
    ``before`` it (``gpuloom_<name>`` columns), with its ``count`` (what the new default changed),
    the layout it kept, and the speedup of ``after`` over ``before`` as ``ratio``."""
    old, new = f"gpuloom_{before}_ms", f"gpuloom_{after}_ms"

    def make_row(rec: dict, row: dict) -> dict | None:
        keys = ("eager_ms", old, new)
        if not all(row.get(k) for k in keys):
            return None
        return {**{k: row[k] for k in keys}, count: rec.get(count, 0),
                "kept": rec.get(f"auto_choice_{after}", {}).get(str(row["batch"])),
                ratio: round(row[old] / row[new], 3)}

    return last_rows(paths, make_row)


def split_rows(paths: list[str]) -> list[dict]:
    """The split default against the fused one before it."""
    return successor_rows(paths, "cl_auto_fused", "split", "split_linears", "split_over_fused")


def split_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): geometric means over eager of the fused default and the split one, the split
    over the fused with its best and worst rows, and at float32 batch 1 the Nimble targets."""
    return variant_summary(rows, (("fused", "gpuloom_cl_auto_fused"), ("split", "gpuloom_split")),
                           ratio="split_over_fused", target="split", best=True)


def epilogue_rows(paths: list[str]) -> list[dict]:
    """The epilogue default against the split one before it."""
    return successor_rows(paths, "split", "epilogue", "fused_epilogues", "epilogue_over_split")


def epilogue_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): geometric means over eager of the split default and the epilogue one, the
    epilogue over the split with its best and worst rows, and at float32 batch 1 the Nimble targets."""
    return variant_summary(rows, (("split", "gpuloom_split"), ("epilogue", "gpuloom_epilogue")),
                           ratio="epilogue_over_split", target="epilogue", best=True)


def gate_rows(paths: list[str]) -> list[dict]:
    """The gates default against the epilogue one before it."""
    return successor_rows(paths, "epilogue", "gates", "fused_gates", "gates_over_epilogue")


def gate_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): geometric means over eager of the epilogue default and the gates one, the
    gates over the epilogues with its best and worst rows."""
    return variant_summary(rows, (("epilogue", "gpuloom_epilogue"), ("gates", "gpuloom_gates")),
                           ratio="gates_over_epilogue", target="gates", best=True)


def current_rows(paths: list[str]) -> list[dict]:
    """compile's current default (the ``gpuloom_gates`` column) against eager, timed side by side in
    one process per row: the model set's geometric mean and Nimble's targets as the default stands."""
    def make_row(rec: dict, row: dict) -> dict | None:
        if not (row.get("eager_ms") and row.get("gpuloom_gates_ms")):
            return None
        return {"eager_ms": row["eager_ms"], "gpuloom_gates_ms": row["gpuloom_gates_ms"],
                "default_over_eager": round(row["eager_ms"] / row["gpuloom_gates_ms"], 3),
                "kept": rec.get("auto_choice_gates", {}).get(str(row["batch"])),
                "rel_err": row.get("rel_err_gpuloom_gates")}

    return last_rows(paths, make_row)


def current_summary(rows: list[dict]) -> dict:
    """Per (dtype, batch): the geometric mean of the current default over eager, its best and worst
    rows, and at float32 batch 1 Nimble's targets."""
    return variant_summary(rows, (("default", "gpuloom_gates"),), ratio="default_over_eager", target="default",
                           best=True)


def successor_table(rows: list[dict], before: str, after: str, ratio: str, count: str, labels: tuple) -> None:
    """Print ``successor_rows``' rows: eager, the default ``before`` and the new one ``after``, ratios, count.
    ``labels``: (the old default's column, what the new one does, the ratio's column, the count's column)."""
    old, new = f"gpuloom_{before}_ms", f"gpuloom_{after}_ms"
    table(["model", "dtype", "batch", "eager", labels[0], f"**default** ({labels[1]})", labels[2],
           "default vs eager", labels[3], "kept", "run"],
          [[r["model"], r["dtype"].replace("float", "fp"), r["batch"], f"{r['eager_ms']:.3f}", f"{r[old]:.3f}",
            f"**{r[new]:.3f}**", f"{r[ratio]:.2f}x", f"{r['eager_ms'] / r[new]:.2f}x", r[count], r["kept"] or "-",
            r["run"]] for r in rows])


def table(header: list[str], rows: list[list]) -> None:
    """Print a markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="docs/results/engine_h200.json")
    p.add_argument("--torch-compile", nargs="*", default=[], metavar="RUN",
                   help="runs with a torch.compile column, merged row by row into the torch.compile comparison")
    p.add_argument("--layouts", nargs="*", default=[], metavar="RUN",
                   help="runs with a gpuloom_cl column, merged row by row into the channels-last comparison")
    p.add_argument("--defaults", nargs="*", default=[], metavar="RUN",
                   help="runs with gpuloom_cl_auto and gpuloom_cl_auto_fused columns: compile's default, fused and not")
    p.add_argument("--splits", nargs="*", default=[], metavar="RUN",
                   help="runs with gpuloom_cl_auto_fused and gpuloom_split columns: compile's default, split and not")
    p.add_argument("--epilogues", nargs="*", default=[], metavar="RUN",
                   help="runs with gpuloom_split and gpuloom_epilogue columns: compile's default, epilogues fused and not")
    p.add_argument("--gates", nargs="*", default=[], metavar="RUN",
                   help="runs with gpuloom_epilogue and gpuloom_gates columns: compile's default, gates fused and not")
    p.add_argument("--current", nargs="*", default=[], metavar="RUN",
                   help="runs with eager and gpuloom_gates columns: compile's current default over the model set")
    args = p.parse_args()
    merged: dict[tuple[str, str], dict] = {}
    meta = None
    for path in args.runs:
        data = json.loads(Path(path).read_text())
        meta = meta or {k: v for k, v in data.items() if k not in ("results", "summary")}
        for rec in data["results"]:
            if "rows" in rec and rec["rows"]:
                rec["run"] = Path(path).name
                merged[(rec["model"], rec["dtype"])] = rec
    results = sorted(merged.values(), key=lambda r: (r["dtype"] != "float32", r["model"]))
    summary = main_summary(results)
    # each comparison: its key (in the summary and the document), its rows, how its summary is made
    sections = [("torch_compile", torch_compile_rows(args.torch_compile), lambda rows: torch_compile_summary(rows, results)),
                ("channels_last", layout_rows(args.layouts), layout_summary),
                ("compile_default", default_rows(args.defaults), default_summary),
                ("split_gemms", split_rows(args.splits), split_summary),
                ("fused_epilogues", epilogue_rows(args.epilogues), epilogue_summary),
                ("fused_gates", gate_rows(args.gates), gate_summary),
                ("current_default", current_rows(args.current), current_summary)]
    for key, rows, summarize in sections:
        if rows:
            summary[key] = summarize(rows)
    tc, layouts, defaults, splits, epilogues, gates, current = (rows for _, rows, _ in sections)
    out = {**meta, "runs": sorted({r["run"] for r in results}), "results": results, "summary": summary,
           **{key: rows for key, rows, _ in sections if rows}}
    Path(args.out).write_text(json.dumps(out, indent=1))

    fp = lambda dtype: dtype.replace("float", "fp")  # noqa: E731
    table(["model", "dtype", "batch", "eager", "cuda graph", "gpuloom 1 stream", "gpuloom multi", "gpuloom auto",
           "auto vs eager", "multi vs graph", "streams / syncs", "critical path", "multi / crit.", "compile s",
           "graph MiB"],
          [[r["model"], fp(r["dtype"]), row["batch"], f"{row['eager_ms']:.3f}",
            f"{row['cuda_graph_ms']:.3f}" if "cuda_graph_ms" in row else "-",
            f"{row['gpuloom_single_ms']:.3f}", f"{row['gpuloom_multi_ms']:.3f}", f"{row['gpuloom_auto_ms']:.3f}",
            f"{row['speedup_gpuloom_auto']:.2f}x",
            f"{row['multi_over_single_graph']:.2f}x" if "multi_over_single_graph" in row else "-",
            f"{r['streams']} / {r['syncs']}",
            *((f"{row['critical_path_ms']:.3f}", f"{row['multi_over_critical_path']:.2f}")
              if row.get("critical_path_ms") else ("-", "-")),
            f"{r['compile_s']:.1f}", f"{r['graph_memory_mib']:.0f}"]
           for r in results for row in r["rows"]])
    print()
    nimble = []
    for r in results:
        if r["dtype"] == "float32" and r["model"] in NIMBLE_V100:
            row = next(row for row in r["rows"] if row["batch"] == 1)
            ok = "met" if row["speedup_gpuloom_auto"] >= NIMBLE_V100[r["model"]] else "missed"
            nimble.append([r["model"], f"{NIMBLE_V100[r['model']]}x", f"{row['speedup_gpuloom_auto']:.2f}x ({ok})"])
    table(["model (fp32, batch 1)", "Nimble V100 target", "gpuloom auto vs eager, H200"], nimble)
    if tc:
        def win(w, ratio):
            return "-" if w is None else "tie" if w == "tie" else f"{w.replace('_', '.')} {ratio:.2f}x"

        print()
        table(["model", "dtype", "batch", "eager", "gpuloom auto", "torch.compile", "winner",
               'gpuloom default (channels_last="auto", fused where timed)', "winner vs default", "run"],
              [[r["model"], fp(r["dtype"]), r["batch"], f"{r['eager_ms']:.3f}" if r["eager_ms"] else "-",
                f"{r['gpuloom_auto_ms']:.3f}", f"{r['torch_compile_ms']:.3f}", win(r["winner"], r["ratio"]),
                f"{r['default_ms']:.3f}" if r.get("default_ms") else "-",
                win(r.get("winner_default"), r.get("ratio_default")), r["run"]] for r in tc])
    if layouts:
        print()
        table(["model", "dtype", "batch", "eager", "gpuloom auto", "channels-last", "channels-last vs auto",
               'channels_last="auto"', "run"],
              [[r["model"], fp(r["dtype"]), r["batch"], f"{r['eager_ms']:.3f}", f"{r['gpuloom_auto_ms']:.3f}",
                f"{r['gpuloom_cl_ms']:.3f}", f"{r['cl_over_auto']:.2f}x",
                f"{r['gpuloom_cl_auto_ms']:.3f}" if r["gpuloom_cl_auto_ms"] else "-", r["run"]] for r in layouts])
    if defaults:
        print()
        table(["model", "dtype", "batch", "eager", "gpuloom auto (NCHW)", "default unfused", "**default** (fused)",
               "fused vs unfused", "default vs eager", "kept", "run"],
              [[r["model"], fp(r["dtype"]), r["batch"], f"{r['eager_ms']:.3f}", f"{r['gpuloom_auto_ms']:.3f}",
                f"{r['gpuloom_cl_auto_ms']:.3f}", f"**{r['gpuloom_cl_auto_fused_ms']:.3f}**",
                f"{r['fused_over_unfused']:.2f}x", f"{r['eager_ms'] / r['gpuloom_cl_auto_fused_ms']:.2f}x",
                r["kept"] or "-", r["run"]] for r in defaults])
    for rows, before, after, ratio, count, labels in (
            (splits, "cl_auto_fused", "split", "split_over_fused", "split_linears",
             ("fused default", "split GEMMs", "split vs fused", "split linears")),
            (epilogues, "split", "epilogue", "epilogue_over_split", "fused_epilogues",
             ("split default", "fused epilogues", "epilogues vs split", "fused epilogues")),
            (gates, "epilogue", "gates", "gates_over_epilogue", "fused_gates",
             ("epilogue default", "fused gates", "gates vs epilogues", "fused gates"))):
        if rows:
            print()
            successor_table(rows, before, after, ratio, count, labels)
    if current:
        print()
        table(["model", "dtype", "batch", "eager", "**default**", "default vs eager", "Nimble V100", "kept", "run"],
              [[r["model"], fp(r["dtype"]), r["batch"], f"{r['eager_ms']:.3f}", f"**{r['gpuloom_gates_ms']:.3f}**",
                f"{r['default_over_eager']:.2f}x",
                f"{NIMBLE_V100[r['model']]}x" if r["model"] in NIMBLE_V100 and r["batch"] == 1 else "-",
                r["kept"] or "-", r["run"]] for r in current])
    print()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
