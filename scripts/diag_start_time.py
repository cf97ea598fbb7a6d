"""How long a server's start takes to load a repository's models: one at a time, or all with one layout.

Why: `gpuloom serve` loaded its models one by one, and every load set up a new layout, capturing
every loaded model's graphs again (on the H200, 4-7 s per load for three small models, run 113).
``ServeCore.load_all`` compiles each model in turn and sets up one layout for all. This times the
two in one process each, as a start does (the service, the repository's models, until all are
READY), and prints one JSON line. Profiles come from ``--profile-cache`` (fill it with a first run)
so that neither variant measures them. (Most of those 4-7 s were each build re-timing cuDNN on a
fresh thread; with the device's one builder thread the two ways tie, run 117.) A driver
(``scripts/gpu_start_ab.sh``) runs the variants A B B A::

    PYTHONPATH=. python3 scripts/diag_start_time.py --variant each --profile-cache /tmp/pc
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("each", "all"), required=True,
                    help="each: ServeCore.load per model (the start before); all: ServeCore.load_all")
    ap.add_argument("--repo", default="examples/repository")
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile-cache", default=None)
    ap.add_argument("--log", default="warning", choices=("warning", "info", "debug"),
                    help="log level on stderr (info: each layout's build time by phase)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    from gpuloom.runtime.service import InferenceService
    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.repository import load_repository

    logging.basicConfig(level=getattr(logging, a.log.upper()), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    repo = load_repository(a.repo)
    names = repo.names()
    svc = InferenceService(policy="dstack", device=a.device, profile_cache=a.profile_cache)
    svc.start()
    t_ready = time.perf_counter()
    core = ServeCore(svc, repo)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if a.variant == "each":
                for n in names:
                    core.load(n)
            else:
                core.load_all(names)
        t_loaded = time.perf_counter()
        states = {m["name"]: m["state"] for m in core.repository_index()}
        layouts = len(svc._runtime._layouts)
    finally:
        svc.close(drain=False)
    from gpuloom.engine import graph_cache

    print(json.dumps({"variant": a.variant, "models": names, "states": states, "layouts": layouts,
                      "graph_cache": {"hits": graph_cache.Stats.hits, "misses": graph_cache.Stats.misses},
                      "import_and_start_s": round(t_ready - t0, 2), "load_s": round(t_loaded - t_ready, 2),
                      "total_s": round(t_loaded - t0, 2), "device": svc.device.kind}), flush=True)
    return 0 if all(s == "READY" for s in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
