#!/usr/bin/env python
"""Same-run comparisons from ``scripts/bench_protocol.py --repeat N`` JSON: in how many runs one server's
figure beat another's, run by run (servers measured in turn within a run share the machine's mood;
across runs this VM's p99 moves by several times).

    python scripts/protocol_pairs.py docs/results/serve/protocol_cpu_session26_*.json \\
        --pair gpuloom:http gpuloom --pair gpuloom:http kserve

For each pair ``A B`` and each run: p50 and p99 at the fixed rate (ms; lower wins), requests/s at each
closed-loop concurrency (higher wins); then the count of runs A won, per figure, with a one-sided
sign test's p (how unlikely that many wins would be if each run were a coin toss). ``--json`` prints
it as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.compare import sign_test  # noqa: E402


def runs_of(path: Path) -> list[dict]:
    """Every run of a bench_protocol JSON file (``runs``, or the single ``servers`` of one run)."""
    d = json.loads(path.read_text())
    return d.get("runs") or [d["servers"]]


def figures(result: dict) -> dict[str, float]:
    out = {"p50_ms": result["fixed_rate"]["p50_ms"], "p99_ms": result["fixed_rate"]["p99_ms"]}
    for key, val in result.items():
        if key.startswith("closed_c"):
            out[f"rps_c{key[len('closed_c'):]}"] = val["throughput"]
    return out


def compare(files: list[Path], a: str, b: str) -> dict:
    """Run by run, A's and B's figures and whether A won each; then the tallies."""
    rows, wins, counted = [], {}, {}
    for path in files:
        for i, run in enumerate(runs_of(path)):
            if a not in run or b not in run:
                continue
            fa, fb = figures(run[a]), figures(run[b])
            row = {"file": path.name, "run": i}
            for k in fa.keys() & fb.keys():
                lower_wins = k.endswith("_ms")
                won = fa[k] < fb[k] if lower_wins else fa[k] > fb[k]
                row[k] = [fa[k], fb[k]]
                wins[k] = wins.get(k, 0) + int(won)
                counted[k] = counted.get(k, 0) + 1
            rows.append(row)
    keys = sorted(counted, key=_figure_order)
    return {"a": a, "b": b, "runs": rows, "a_won": {k: f"{wins[k]} of {counted[k]}" for k in keys},
            "sign_test_p": {k: round(sign_test(wins[k], counted[k]), 4) for k in keys}}


def _figure_order(key: str) -> tuple:
    """Latencies first, then requests/s by concurrency as numbers (rps_c8 before rps_c32)."""
    head, _, num = key.rpartition("_c")
    return (key.startswith("rps"), head if num.isdigit() else key, int(num) if num.isdigit() else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--pair", nargs=2, action="append", metavar=("A", "B"), required=True,
                    help="two server names as the JSON has them (e.g. gpuloom:http kserve); repeatable")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    missing = [str(f) for f in args.files if not f.exists()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    out = [compare(args.files, a, b) for a, b in args.pair]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for c in out:
        if not c["runs"]:
            print(f"{c['a']} vs {c['b']}: no run has both")
            continue
        keys = list(c["a_won"])
        print(f"\n{c['a']} vs {c['b']} (each cell: A / B)")
        print(f"{'file':<48}{'run':>4}" + "".join(f"{k:>18}" for k in keys))
        for r in c["runs"]:
            cells = "".join(f"{r[k][0]:>8.2f} /{r[k][1]:>8.2f}" if k.endswith("_ms") else f"{r[k][0]:>8.0f} /{r[k][1]:>8.0f}"
                            for k in keys)
            print(f"{r['file']:<48}{r['run']:>4}{cells}")
        print(f"{c['a']} won: " + ", ".join(f"{k} {v} (sign test p = {c['sign_test_p'][k]:.4f})"
                                           for k, v in c["a_won"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
