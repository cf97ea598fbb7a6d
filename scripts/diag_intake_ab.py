#!/usr/bin/env python
"""``diag_intake_cost.py`` on two checkouts of gpuloom, taking turns (ABAB...), one process a leg: the
runtime loop's CPU per HTTP request (intake and answers) of a change against its base, side by side
on one machine. The build VM's figures move by 10-20% between minutes, so only pairs run back to back
say anything.

    git worktree add /tmp/gpuloom-base <base commit>
    PYTHONPATH=. python scripts/diag_intake_ab.py --base /tmp/gpuloom-base --pairs 5 --burst 1 \\
        --out docs/results/serve/intake_ab.json

Both legs run this checkout's ``diag_intake_cost.py`` (so they measure alike) against the gpuloom of
``--base`` and of ``--new`` (default: this checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def leg(tree: Path, burst: int, requests: int) -> dict:
    """One run of the diagnostic against the gpuloom package of ``tree``, in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "leg.json"
        env = dict(os.environ, PYTHONPATH=str(tree))
        # run as a file outside both trees, so that its own folder puts neither gpuloom first
        script = Path(tmp) / "diag_intake_cost.py"
        script.write_text((ROOT / "scripts" / "diag_intake_cost.py").read_text())
        subprocess.run([sys.executable, str(script), "--workload", str(ROOT / "examples" / "mix6.yaml"), "--burst",
                        str(burst), "--repeat", "1", "--requests", str(requests), "--out", str(out)],
                       env=env, check=True, cwd=tmp,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the checkout to compare against (a git worktree)")
    ap.add_argument("--new", default=str(ROOT), help="the changed checkout (default: this one)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--burst", type=int, default=1)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    for name, tree in trees.items():
        if not (tree / "gpuloom" / "__init__.py").exists():
            ap.error(f"--{name}: no gpuloom package in {tree}")
    pairs = []
    for i in range(args.pairs):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        got = {name: leg(trees[name], args.burst, args.requests) for name in order}
        row = {name: {"intake_us": got[name]["intake_us_median"], "answer_us": got[name]["answer_us_median"]}
               for name in ("base", "new")}
        pairs.append(row)
        print(f"pair {i + 1} ({' then '.join(order)}): intake {row['base']['intake_us']:.1f} -> "
              f"{row['new']['intake_us']:.1f} us, answers {row['base']['answer_us']:.1f} -> "
              f"{row['new']['answer_us']:.1f} us")
    summary = {}
    for key in ("intake_us", "answer_us"):
        base = [p["base"][key] for p in pairs]
        new = [p["new"][key] for p in pairs]
        summary[key] = {"base_mean": statistics.mean(base), "new_mean": statistics.mean(new),
                        "new_lower_in": sum(n < b for b, n in zip(base, new)), "pairs": len(pairs)}
        print(f"{key}: mean {summary[key]['base_mean']:.1f} -> {summary[key]['new_mean']:.1f}, "
              f"new lower in {summary[key]['new_lower_in']} of {len(pairs)} pairs")
    if args.out:
        from gpuloom.bench.e2e import save_json

        save_json(args.out, {"schema": "gpuloom.diag_intake_ab/1", "burst": args.burst, "requests": args.requests,
                             "trees": {k: str(v) for k, v in trees.items()}, "pairs": pairs, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
