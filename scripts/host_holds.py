#!/usr/bin/env python
"""How long each host's lanes held a batch beyond its GPU time, per ``gpuloom bench`` report.

Why: the simulator's batch overhead (``ContentionModel.batch_overhead_ms``) stands for that hold, and
it is the host's (``gpuloom.bench.host_hold``; ``gpuloom bench`` reports it as ``host_lane_hold``).
Per report: the median, over every lane of every point held at the target attainment (any policy), of
the lane's median hold (``layouts[].hold_p50_ms``), with its range. Pure Python; any machine.

    python scripts/host_holds.py docs/results/runtime/bench_*_h100_run17*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuloom.bench.host_hold import lane_holds  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", nargs="+", help="gpuloom bench JSON files")
    ap.add_argument("--target", type=float, default=0.99, help="points at or above this attainment count")
    a = ap.parse_args()
    for path in a.bench:
        holds = lane_holds(json.loads(Path(path).read_text()), a.target)
        if holds:
            print(f"{Path(path).name}: median {statistics.median(holds):.3f} ms over {len(holds)} lanes "
                  f"({min(holds):.2f}-{max(holds):.2f})")
        else:
            print(f"{Path(path).name}: no lane holds recorded at points held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
