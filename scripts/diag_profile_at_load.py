#!/usr/bin/env python
"""What profiling a model at its load costs, and what it finds: a CUDA service loads a torchvision
model under a name no shipped profile has, three ways in turn, each in a service of its own:

- ``crude``: ``measure_profiles=False`` (batch 1 and max batch timed on the whole GPU, latency
  assumed to scale with 1/SMs: the knee is always the whole GPU);
- ``measure``: profiled on the device's SM grid at load, kept in a fresh cache directory;
- ``cached``: the same again, the profile taken from that cache.

Per way: the load's wall time, and per batch the knee (SMs within 10% of the whole GPU's latency)
and the whole-GPU latency the plan would use.

    python3 scripts/diag_profile_at_load.py --model resnet50 --max-batch 32 --out /tmp/profile_at_load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="torchvision name (random weights)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args()

    import torch
    import torchvision

    from gpuloom.profile.store import ProfileStore
    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    module = getattr(torchvision.models, args.model)(weights=None).eval()
    name = f"my_{args.model}"  # no shipped profile has it
    config = ModelConfig(name, (TensorSpec("x", (3, 224, 224), "float32"),), max_batch=args.max_batch)
    cache = Path(tempfile.mkdtemp(prefix="gpuloom-profile-cache-"))
    rows = []
    for way in ("crude", "measure", "cached"):
        svc = InferenceService(policy="dstack", device="cuda", profiles=ProfileStore(cache / "none"),
                               measure_profiles=way != "crude", profile_cache=cache)
        svc.start()
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                svc.load(config, module)
            load_s = time.perf_counter() - t0
            prof = svc._models[name].profile
            row = {"way": way, "load_s": round(load_s, 2), "source": prof.source, "sms": list(prof.sms),
                   "knee": {b: prof.knee(b) for b in prof.batches},
                   "full_gpu_ms": {b: round(prof.full_latency(b), 3) for b in prof.batches},
                   "smallest_sms_ms": {b: round(prof.latency(b, prof.sms[0]), 3) for b in prof.batches}}
        finally:
            svc.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"model": args.model, "max_batch": args.max_batch, "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
