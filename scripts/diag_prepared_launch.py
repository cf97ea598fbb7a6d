"""Dispatch overhead at batch 1 with and without the device layer's prepared launches (or launch graphs), in one process.

Why: run 90 timed the prepared launch (``CudaDeviceLayer._launch_raw`` from a ``cuda_lane.Prepared``) against the
previous code in two processes, and the spread between processes (each captures its own graphs,
with its own cuDNN picks: resnet50's ``cuGraphLaunch`` cost 4.5 us of host time in one, 13.8 in the
other) was larger than the 5 us the change saves. Here the same services, graphs and host alternate
the two: "prepared" is the layer as it is; "looked_up" makes every batch take the full look-up path
(``_launch_general``: the code before the change, plus a look-up of the ``cuda_lane.Prepared`` entry it made
the first time; in run 92 it read the slot's four event handles and rebuilt that entry for every
batch, as the code before read the handles, since changed).

mix6 compiled at max batch 1 as ``gpu_runtime_check.py --only overhead`` does (x0.25, one unmeasured
point per policy first), then ``--rounds`` rounds of one point per variant, the order flipped each
round. Reported per point: host us per batch (``host_dispatch_ms / batches``), device us per batch,
the dispatch overhead and the launch phases.

``--compare launch_graphs`` alternates instead the layer's launch graphs (``launch_graphs=True``: a
batch is its input copies and one ``cuGraphLaunch``) with the same prepared launches made of separate
driver calls (four event records, the graph, the output copies), switched on the live layer: the
warm-up point runs with launch graphs, so every prepared launch has its graph. Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_prepared_launch.py --rounds 3 --out /tmp/prepared.json
    PYTHONPATH=. python3 scripts/diag_prepared_launch.py --compare launch_graphs --out /tmp/graphs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_runtime_check beside this script
import gpu_runtime_check as grc  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="dstack,dstack:lanes=partitions,triton")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=1.5, help="seconds per point")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--compare", choices=("prepared", "launch_graphs"), default="prepared")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("diag_prepared_launch needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpuloom.bench.e2e import run_point, save_json
    from gpuloom.bench.variants import parse_policy_spec
    from gpuloom.runtime.cuda_device import CudaDeviceLayer

    grc.RATE_SCALE_HINT = a.scale
    prepared = CudaDeviceLayer._launch

    def looked_up(self, lanes, index, model, rows):
        return self._launch_general(lanes.state["lanes"][index], model, rows)

    def use(launch, graphs):
        def setting(svc):
            CudaDeviceLayer._launch = launch
            svc.device.launch_graphs = graphs
        return setting

    if a.compare == "prepared":
        variants = {"prepared": use(prepared, False), "looked_up": use(looked_up, False)}
    else:
        variants = {"launch_graphs": use(prepared, True), "separate_calls": use(prepared, False)}
    first, second = variants
    models = grc.build(grc.MIX6, max_batch=1)
    wl = grc.workload(grc.MIX6, grc.MIX6_SLO, grc.MIX6_RATE, a.duration)
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "scale": a.scale,
           "duration_s": a.duration, "compare": a.compare, "policies": {}}
    for name in a.policies.split(","):
        pol, opts, service_opts = parse_policy_spec(name)
        svc = grc.service(pol, models, wl, policy_options=opts, **service_opts)
        points = []
        try:
            variants[first](svc)
            run_point(svc, wl, name, scale=a.scale, duration_s=a.duration)  # unmeasured warm-up
            for r in range(a.rounds):
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for v in order:
                    variants[v](svc)
                    be0 = svc.stats()["backend"]
                    p = run_point(svc, wl, name, scale=a.scale, duration_s=a.duration)
                    be = svc.stats()["backend"]
                    n = be["batches"] - be0["batches"]
                    if n == 0:
                        raise RuntimeError(f"{name}: no batch ran in a {a.duration} s point")
                    points.append({
                        "variant": v, "round": r, "batches": n, "dispatch_overhead": p.dispatch_overhead,
                        "slo_attainment": p.slo_attainment,
                        "host_us_per_batch": (be["host_dispatch_ms"] - be0["host_dispatch_ms"]) * 1e3 / n,
                        "device_us_per_batch": (be["device_ms"] - be0["device_ms"]) * 1e3 / n,
                        "launch_graph_batches": be["launch_graph_batches"] - be0["launch_graph_batches"],
                        "phases_us": {k: (be["launch_ms"][k] - be0["launch_ms"][k]) * 1e3 / n
                                      for k in ("inputs", "replay", "outputs")}})
        finally:
            CudaDeviceLayer._launch = prepared
            out.setdefault("launch_graph_failures", {})[name] = svc.stats()["backend"]["launch_graph_failures"]
            svc.close(drain=True, timeout_s=10)
        summary = {}
        for v in variants:
            mine = [q for q in points if q["variant"] == v]
            summary[v] = {k + "_median": statistics.median(q[k] for q in mine)
                          for k in ("host_us_per_batch", "device_us_per_batch", "dispatch_overhead")}
        summary[f"{first}_over_{second}"] = (summary[first]["host_us_per_batch_median"]
                                             / summary[second]["host_us_per_batch_median"])
        pairs = [(p, q) for p in points for q in points if p["round"] == q["round"]
                 and p["variant"] == first and q["variant"] == second]
        summary[f"pairs_{first}_cheaper"] = sum(p["host_us_per_batch"] < q["host_us_per_batch"] for p, q in pairs)
        summary["pairs"] = len(pairs)
        out["policies"][name] = {"points": points, "summary": summary}
        print(name, json.dumps(summary), flush=True)
        if a.out:
            save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
