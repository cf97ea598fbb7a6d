#!/usr/bin/env python
"""Is an unloaded model's memory given back when loads and unloads follow each other? CPU.

Why: the soak (``scripts/soak_serve.py``, an unload and a load of one model every 20 s) saw the
server's resident memory climb only while it cycled; an in-process loop of 18 unload/load cycles,
counted after its last unload (nothing frozen then), had 112 FX graph modules alive, 4 with a full
collection after each unload. ``InferenceService(tune_gc=True)`` freezes what is alive after each load
and an unload thaws, leaving the unloaded model's cycles to the next full collection; a load that
came first froze them for good.

This loads a small model ``keep``, then ``--cycles`` times unloads and loads a second model
``cycled`` (a 16-2048-4 MLP) on a CPU service, each cycle ending with one full collection (what an
automatic one does sometime while the models are served). Per cycle: the objects frozen
(``gc.get_freeze_count()``), the process's resident memory, and how long the collection took.
(The results of this session's first runs also count the graph modules the collector could see
after that collection: always 0, as frozen objects are invisible to it; the count is gone.)

    .venv/bin/python scripts/diag_unload_memory.py --cycles 20 --out /tmp/unload.json
    python3 scripts/diag_unload_memory.py --device cuda --hidden 262144 --cycles 10   # on a GPU (20 MiB of weights)
    python3 scripts/diag_unload_memory.py --device cuda --tight --cycles 3          # the load after an unload, no room

``--no-collect``: no collection from outside after each cycle, as a served process sees reloads (its
own full collections are rare under ``tune_gc``): per cycle the resident memory and the unloads the
service collected at (``unload_collections``; smaller unloaded models add up to
``--unload-collect-mib``, forty-seventh session).

    .venv/bin/python scripts/diag_unload_memory.py --no-collect --hidden 838861 --cycles 12   # 64 MiB a copy

``--tight`` (CUDA): the cycled model holds 1 GiB of weights (a 16,384-wide linear layer), and after
the first load torch may use only 0.6 GiB more than it then holds
(``torch.cuda.set_per_process_memory_fraction``). Each cycle unloads it and loads it again with no
collection in between: the new copy fits only if the load frees the old one, which only a full
collection does. Per cycle: whether a plain 1 GiB allocation fails first (the old copy still held),
whether the load succeeds, how long it took, and the service's out-of-memory collections
(``oom_reclaims``).

To compare two versions of the code, run it in a worktree of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom


def rss_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=20, help="unload/load cycles (default 20)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: then also the device memory torch "
                   "holds before and after each cycle's full collection (what the unloaded model still held)")
    p.add_argument("--hidden", type=int, default=2048, help="width of the cycled MLP (default 2048)")
    p.add_argument("--tight", action="store_true", help="CUDA: reload a 1 GiB model with room for one copy only "
                   "(see above)")
    p.add_argument("--unload-collect-mib", type=float, default=256.0,
                   help="the service's unload_collect_mib (default 256, the service's: the 1 GiB --tight model is "
                        "collected at its unload; inf: as before the forty-sixth session, never)")
    p.add_argument("--no-collect", action="store_true", help="no full collection after each cycle: what reloads "
                   "keep when nothing outside the service collects (see above)")
    p.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = p.parse_args()
    if args.tight:
        if not args.device.startswith("cuda"):
            p.error("--tight needs --device cuda")
        return tight(args)

    import numpy as np
    import torch

    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    warnings.simplefilter("ignore")  # no profile on the CPU: a crude one is measured at each load
    torch.manual_seed(0)

    def config(name: str) -> ModelConfig:
        return ModelConfig(name, (TensorSpec("x", (16,), "float32"),), max_batch=8, slo_ms=1000)

    def mlp(hidden: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)).eval()

    svc = InferenceService(policy="dstack", device=args.device, unload_collect_mib=args.unload_collect_mib)
    cuda = args.device.startswith("cuda")

    def device_mib() -> float | None:
        if not cuda:
            return None
        torch.cuda.synchronize()
        return round(torch.cuda.memory_allocated() / 2**20, 1)

    svc.start()
    rows = []
    try:
        svc.load(config("keep"), mlp(64))
        svc.load(config("cycled"), mlp(args.hidden))
        for i in range(args.cycles + 1):
            if i:
                svc.unload("cycled")
                svc.load(config("cycled"), mlp(args.hidden))
            held = device_mib()
            t0 = time.perf_counter()
            if not args.no_collect:
                gc.collect()
            rows.append({"collect_ms": round((time.perf_counter() - t0) * 1e3, 1), "frozen": gc.get_freeze_count(),
                         "rss_mib": round(rss_mib(), 1), "unload_collections": svc.stats()["unload_collections"],
                         "device_mib_before_collect": held, "device_mib_after_collect": device_mib()})
        out = svc.infer("keep", {"x": np.ones((1, 16), np.float32)}, timeout_s=30)  # still served
    finally:
        svc.close()
    first, last = rows[1] if len(rows) > 1 else rows[0], rows[-1]  # from the first cycle on
    n = max(1, len(rows) - 2)
    report = {
        "cycles": args.cycles, "per_cycle": rows,
        "frozen_per_cycle": round((last["frozen"] - first["frozen"]) / n, 1),
        "rss_mib_per_cycle": round((last["rss_mib"] - first["rss_mib"]) / n, 3),
        "device": args.device, "hidden": args.hidden, "collect_each_cycle": not args.no_collect,
        "unload_collect_mib": args.unload_collect_mib, "rss_mib_max": max(r["rss_mib"] for r in rows),
        "collect_ms_median": sorted(r["collect_ms"] for r in rows[1:] or rows)[len(rows[1:] or rows) // 2],
        "keep_answer_shapes": {k: list(v.shape) for k, v in out.items()},
    }
    print(json.dumps({k: v for k, v in report.items() if k != "per_cycle"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


def tight(args: argparse.Namespace) -> int:
    """Unload a 1 GiB model and load it again where only one copy fits (``--tight``)."""
    import torch

    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    warnings.simplefilter("ignore")
    width = 16384  # 16,384 x 16,384 float32 weights: 1 GiB
    cfg = ModelConfig("cycled", (TensorSpec("x", (width,), "float32"),), max_batch=4, slo_ms=1000)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).eval()

    svc = InferenceService(policy="dstack", device=args.device, unload_collect_mib=args.unload_collect_mib)
    svc.start()
    rows, error, cap = [], None, None
    try:
        svc.load(cfg, model())
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        cap = torch.cuda.memory_reserved() + int(0.6 * 2**30)
        torch.cuda.set_per_process_memory_fraction(cap / total)
        for _ in range(args.cycles):
            svc.unload("cycled")
            try:  # is the unloaded copy still held? (a plain 1 GiB allocation, freed at once)
                probe = torch.empty(2**28, dtype=torch.float32, device="cuda")
                del probe
                probe_failed = False
            except torch.OutOfMemoryError:
                probe_failed = True
            before = getattr(svc.device, "oom_reclaims", 0)  # absent before this session
            t0 = time.perf_counter()
            try:
                svc.load(cfg, model())
                ok, why = True, None
            except Exception as e:  # noqa: BLE001 - reported: the load that failed is the finding
                ok, why = False, f"{type(e).__name__}: {str(e)[:300]}"
            rows.append({"probe_1gib_failed": probe_failed, "load_ok": ok, "load_error": why,
                         "load_s": round(time.perf_counter() - t0, 2),
                         "oom_reclaims": getattr(svc.device, "oom_reclaims", 0) - before,
                         "allocated_mib": round(torch.cuda.memory_allocated() / 2**20)})
            print(json.dumps(rows[-1]), flush=True)
            if not ok:
                break
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    finally:
        svc.close()
    report = {"mode": "tight", "cycles": args.cycles, "unload_collect_mib": args.unload_collect_mib, "cap_mib": round(cap / 2**20) if cap else None,
              "per_cycle": rows, "error": error, "loads_ok": sum(r["load_ok"] for r in rows)}
    print(json.dumps({k: v for k, v in report.items() if k != "per_cycle"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if rows and not error and all(r["load_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
