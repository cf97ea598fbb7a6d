"""How fast the simulator runs issue 4's benchmark: 60 s of the six-model mix at full load, dstack.

Two measures, for one checkout or several side by side (``--checkouts DIR ...``, e.g. git worktrees
of two commits):
- **CPU seconds** as ``tests/test_runtime.py`` takes them (``_simulate_mix6_60s_cpu_s``: the thread's
  CPU time of the simulation in a fresh interpreter, the smaller of two), ``--repeat`` times, the
  checkouts taking turns so that a busy moment of a shared VM hits them alike;
- **instructions** (valgrind's cachegrind ``I refs``, ``--instructions-s`` seconds of the same run,
  minus an empty run's): the same count every time, where wall and CPU time on the build VM swing
  by 15%. Skipped when valgrind is missing.

    .venv/bin/python scripts/sim_speed.py --checkouts /tmp/before . --repeat 3 --out /tmp/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

# the run, as tests/test_runtime.py's _simulate_mix6_60s_cpu_s writes it, for DURATION seconds
RUN = """
import json, sys, time
from gpuloom.bench.experiment import simulate
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import zoo
slos = {"resnet50": 25, "mobilenet_v2": 10, "inception_v3": 40, "efficientnet_b0": 20, "vgg16": 100, "bert_base": 60}
rates = {"resnet50": 400, "mobilenet_v2": 800, "inception_v3": 200, "efficientnet_b0": 600, "vgg16": 100,
         "bert_base": 150}
dur = float(sys.argv[1])
w = Workload(tuple(ModelSpec(m, slos[m], arrival=Arrival("poisson", rate=r)) for m, r in rates.items()),
             duration_s=max(dur, 1.0))
store = ProfileStore(profiles=zoo())
t0 = time.thread_time()
arrived = simulate(w, store, "dstack").metrics.arrived if dur > 0 else 0
print(json.dumps({"cpu": time.thread_time() - t0, "arrived": arrived}))
"""


def run_once(checkout: Path, duration_s: float, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"}
    return subprocess.run([*(prefix or []), sys.executable, "-c", RUN, str(duration_s)], cwd=checkout, env=env,
                          check=True, capture_output=True, text=True)


def cpu_s(checkout: Path) -> float:
    """The test's measure: the smaller CPU time of two fresh interpreters, 60 s of arrivals."""
    return min(json.loads(run_once(checkout, 60.0).stdout.strip().splitlines()[-1])["cpu"] for _ in range(2))


def instructions(checkout: Path, duration_s: float) -> int | None:
    """Instructions of ``duration_s`` s of the run beyond an empty run's (imports, start-up)."""
    if shutil.which("valgrind") is None:
        return None
    prefix = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]

    def refs(d: float) -> int:
        err = run_once(checkout, d, prefix).stderr
        return int(re.search(r"I\s+refs:\s+([\d,]+)", err).group(1).replace(",", ""))

    return refs(duration_s) - refs(0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkouts", nargs="+", default=["."], help="repository checkouts to measure (default: this one)")
    ap.add_argument("--repeat", type=int, default=3, help="CPU-time measures per checkout, taking turns (default 3)")
    ap.add_argument("--instructions-s", type=float, default=5.0, help="seconds of arrivals under valgrind (0: skip)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dirs = [Path(c).resolve() for c in a.checkouts]
    rows = {str(d): {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=d, capture_output=True,
                                              text=True).stdout.strip(), "cpu_s": []} for d in dirs}
    for i in range(a.repeat):
        for d in dirs:
            rows[str(d)]["cpu_s"].append(round(cpu_s(d), 3))
            print(f"round {i + 1}: {d} ({rows[str(d)]['commit']}): {rows[str(d)]['cpu_s'][-1]:.3f} s", flush=True)
    if a.instructions_s > 0:
        for d in dirs:
            n = instructions(d, a.instructions_s)
            rows[str(d)]["instructions"] = n
            print(f"{d} ({rows[str(d)]['commit']}): {n / 1e6:.0f} M instructions for {a.instructions_s:g} s"
                  if n else f"{d}: valgrind not found", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"method": __doc__.split("\n\n")[0], "python": platform.python_version(),
                                           "machine": platform.machine(), "cpus": os.cpu_count(),
                                           "instructions_s": a.instructions_s, "checkouts": rows}, indent=1) + "\n")
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
