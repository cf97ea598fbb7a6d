#!/usr/bin/env python
"""How sensitive is the simulated overload to the host's time per dropped request? (issue 5, CPU)

Why: ``ContentionModel.host_drop_ms`` (the one host busy this long per request a decision drops, 0.04 ms
in ``--contention h100-fast-host``, fitted on H100 runs 173, 183, 186 and 187) brought nexus's
overloaded point within 3-8% on those hosts, but on the slow hosts of runs 194-196 (Python loop probe
3.1-5.8 ms) the same preset put nexus 42-123% above the measured. Nexus drops about ten requests for
each it serves at the overload, so the host term decides its goodput. This re-simulates each measured
point of ``--policy`` in the given bench reports with the ``h200`` and ``h100-fast-host`` presets at
each ``--host-drop-ms``, and prints the error against the measured goodput.

    python scripts/sim_host_drop_sweep.py docs/results/runtime/bench_overload_h100_run194_*.json \\
        --host-drop-ms 0.04,0.05,0.06,0.08 --out docs/results/runtime/sim_host_drop_sweep_session58.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sim_measured_hold import load_report, simulate_at  # noqa: E402

from gpuloom.bench.e2e import save_json  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.sim import FITTED_PRESETS as PRESETS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpuloom bench JSONs measured on the GPU")
    ap.add_argument("--policy", default="nexus")
    ap.add_argument("--host-drop-ms", default="0.04,0.05,0.06,0.08", help="comma-separated values to try")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    drops = [float(x) for x in a.host_drop_ms.split(",")]
    store = ProfileStore.builtin("h200")
    rows = []
    for path in a.reports:
        d, wl, profs = load_report(path, store, a.policy)
        machine = d["meta"].get("machine", {})
        probe = [machine.get(k, {}).get("python_loop_us") for k in ("start", "end")]
        for p in d["policies"][a.policy]["points"]:
            row = {"report": Path(path).name, "scale": p["scale"], "measured_goodput": round(p["goodput_rps"], 1),
                   "python_loop_us": probe, "errors": {}}
            for name, preset in PRESETS.items():
                for hd in drops:
                    got = simulate_at(d, wl, profs, a.policy, p["scale"],
                                      dataclasses.replace(preset(), host_drop_ms=hd)).goodput_rps
                    row["errors"][f"{name}/{hd:g}"] = round(got / p["goodput_rps"] - 1.0, 4) if p["goodput_rps"] else None
            rows.append(row)
            print(f"{row['report']} x{p['scale']:g}: measured {p['goodput_rps']:.0f}/s (probe {probe} us); "
                  + "; ".join(f"{k} {v:+.0%}" for k, v in row["errors"].items() if v is not None), flush=True)
    if a.out:
        save_json(a.out, {"method": __doc__.split("\n\n")[1].replace("\n", " "), "policy": a.policy,
                          "host_drop_ms": drops, "points": rows})
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
