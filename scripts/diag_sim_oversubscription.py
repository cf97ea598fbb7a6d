#!/usr/bin/env python
"""How far the simulator oversubscribes shared lanes at a bench report's points: the distribution of
``demand / (efficiency * SMs)`` each time the simulated shared batches' speed is set.

Why: a contention term that grows with oversubscription (``ContentionModel.shared_exponent``) can
only make triton collapse past its edge without hurting it below if the simulated oversubscription
differs a lot between the two. Pure Python (the simulator with the shipped H200 profiles, as
``gpuloom bench`` simulates each point); any machine.

    python scripts/diag_sim_oversubscription.py docs/results/runtime/bench_mix6_h100_run160_edge_fine.json \\
        --policy triton --out /tmp/oversub.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import ContentionModel  # noqa: E402
from sim_measured_hold import load_report, simulate_at  # noqa: E402

QUANTILES = (0.1, 0.5, 0.9, 0.99)


def oversubscription(report: dict, wl0: Any, profs: dict, policy: str, cm: ContentionModel) -> list[dict]:
    """Per point of ``policy`` in ``report`` (with its workload and profiles, :func:`load_report`):
    measured and simulated goodput, and the quantiles of the simulated shared lanes' oversubscription
    (``ContentionModel.shared_factor``'s argument)."""
    seen: list[float] = []

    class Recording(ContentionModel):
        def shared_factor(self, demand_sms: float, shared_sms: float) -> float:
            seen.append(demand_sms / (self.efficiency * shared_sms))
            return super().shared_factor(demand_sms, shared_sms)

    recording = Recording(**{f.name: getattr(cm, f.name) for f in dataclasses.fields(cm)})
    out = []
    for point in report["policies"][policy]["points"]:
        seen.clear()
        m = simulate_at(report, wl0, profs, policy, point["scale"], recording, point.get("plan"))
        s = sorted(seen)
        out.append({"scale": point["scale"], "measured_goodput": round(point["goodput_rps"], 1),
                    "simulated_goodput": round(m.goodput_rps, 1), "samples": len(s),
                    "oversubscription": {f"p{int(q * 100)}": round(s[int(q * (len(s) - 1))], 3) for q in QUANTILES}
                    if s else {}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a gpuloom bench JSON report")
    ap.add_argument("--policy", default="triton", help="the report's policy (variant spelling) to simulate")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    report, wl, profs = load_report(a.report, ProfileStore.builtin("h200"), a.policy)
    if a.policy not in report["policies"]:
        print(f"error: no policy {a.policy!r} in {a.report}; it has {sorted(report['policies'])}", file=sys.stderr)
        return 2
    rows = oversubscription(report, wl, profs, a.policy, ContentionModel.h200_runs())
    for r in rows:
        q = "  ".join(f"{k} {v:.2f}" for k, v in r["oversubscription"].items()) or "no shared batches"
        print(f"x{r['scale']:<8g} measured {r['measured_goodput']:7.0f}/s simulated {r['simulated_goodput']:7.0f}/s  "
              f"oversubscription {q}")
    if a.out:
        Path(a.out).write_text(json.dumps({"report": Path(a.report).name, "policy": a.policy,
                                           "contention": "h200", "points": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
