#!/usr/bin/env python
"""How much each model slows when others share the GPU with it, model by model (GPU).

Why: past triton's edge the card slowed the small CNNs 4.4-5.5x their profiles and bert 2.0-2.7x
(`scripts/diag_sim_per_model.py`, runs 164/167), while the simulator slows every shared batch by one
factor. This measures it without a scheduler in the way: each model's captured graph (compiled as
the service compiles it) replayed back to back on a stream of its own, alone, then beside one other
model, then all together; per model its time per replay together over alone. One factor for all
would give every set a spread (largest slowdown over smallest) of 1.

    PYTHONPATH=. python3 scripts/diag_pair_slowdown.py --batches 2,8 --rounds 2 --out /tmp/pairs.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = ("resnet50", "mobilenet_v2", "inception_v3", "efficientnet_b0", "vgg16", "bert_base")
PAIRS = (("bert_base", "mobilenet_v2"), ("bert_base", "efficientnet_b0"), ("bert_base", "resnet50"),
         ("bert_base", "vgg16"), ("bert_base", "inception_v3"), ("mobilenet_v2", "vgg16"),
         ("mobilenet_v2", "resnet50"))


def slowdowns(alone_ms: dict[str, float], together_ms: dict[str, float]) -> dict:
    """Each model's time per replay together over alone, and the set's spread (largest over smallest)."""
    per = {m: together_ms[m] / alone_ms[m] for m in together_ms if alone_ms.get(m)}
    return {"slowdown": per, "spread": max(per.values()) / min(per.values()) if per else None}


def run_together(entries: list[tuple], seconds: float, warmup_s: float, depth: int = 2) -> dict[str, float]:
    """Replay each entry's graph (``(name, graphset, bucket, stream)``) back to back on its own stream,
    ``depth`` replays in flight per stream, for ``warmup_s`` and then ``seconds``; ms per replay of
    each over the measured window (completions counted when seen: a poll's granularity, microseconds,
    against replays of 0.3 ms and more)."""
    import torch

    inflight = {e[0]: collections.deque() for e in entries}
    done = {e[0]: 0 for e in entries}
    start = time.perf_counter()
    measure_from, end = start + warmup_s, start + warmup_s + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        for name, gs, bucket, stream in entries:
            q = inflight[name]
            while q and q[0].query():
                q.popleft()
                if now >= measure_from:
                    done[name] += 1
            while len(q) < depth:
                gs.replay(bucket, stream=stream)
                ev = torch.cuda.Event()
                ev.record(stream)
                q.append(ev)
    torch.cuda.synchronize()
    return {name: seconds * 1000.0 / n if n else float("inf") for name, n in done.items()}


def main() -> int:
    import torch

    from gpuloom.bench.e2e import build_models, save_json
    from gpuloom.bench.workload import load_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="examples/mix6.yaml")
    ap.add_argument("--batches", default="2,8")
    ap.add_argument("--seconds", type=float, default=0.5, help="measured window per set")
    ap.add_argument("--warmup", type=float, default=0.15)
    ap.add_argument("--rounds", type=int, default=2, help="every set this many times, in reversed order each other round")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    wl = load_workload(a.workload)
    t0 = time.perf_counter()
    built = build_models(wl, tiny=False, device="cuda", max_batch=max(batches),
                         progress=lambda s: print(s, flush=True))
    print(f"compiled {len(built)} models in {time.perf_counter() - t0:.0f} s", flush=True)
    graphs = {m: cm._graphs for m, (_, cm) in built.items()}
    for m, gs in list(graphs.items()):  # a model with no graph of some batch (eager, or left out) is left out
        missing = [b for b in batches if gs is None or b not in gs.buckets]
        if missing:
            print(f"{m}: no captured graph for batch {missing}; left out", flush=True)
            del graphs[m], built[m]
    streams = {m: torch.cuda.Stream() for m in built}
    sets = [(m,) for m in MODELS if m in built] + [p for p in PAIRS if all(m in built for m in p)]
    sets.append(tuple(m for m in MODELS if m in built))
    rows = []
    for r in range(a.rounds):
        order = sets if r % 2 == 0 else sets[::-1]
        for b in batches:
            for s in order:
                ms = run_together([(m, graphs[m], b, streams[m]) for m in s], a.seconds, a.warmup)
                rows.append({"round": r, "batch": b, "models": list(s), "ms_per_replay": ms})
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": a.seconds,
           "batches": batches, "rows": rows, "sets": []}
    for b in batches:
        alone = {m: statistics.median(x["ms_per_replay"][m] for x in rows if x["batch"] == b and x["models"] == [m])
                 for m in built}
        for s in sets:
            if len(s) == 1:
                continue
            together = {m: statistics.median(x["ms_per_replay"][m] for x in rows
                                             if x["batch"] == b and x["models"] == list(s)) for m in s}
            res = slowdowns(alone, together)
            out["sets"].append({"batch": b, "models": list(s), "alone_ms": {m: round(alone[m], 4) for m in s},
                                "together_ms": {m: round(v, 4) for m, v in together.items()},
                                "slowdown": {m: round(v, 3) for m, v in res["slowdown"].items()},
                                "spread": round(res["spread"], 3)})
            print(f"batch {b:2d} " + " + ".join(s) + ": " + ", ".join(
                f"{m} {alone[m]:.2f} -> {together[m]:.2f} ms ({res['slowdown'][m]:.2f}x)" for m in s)
                + f"; spread {res['spread']:.2f}", flush=True)
    if a.out:
        save_json(a.out, out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
