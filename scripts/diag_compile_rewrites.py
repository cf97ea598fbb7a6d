#!/usr/bin/env python
"""Which of the engine's rewrites a model gets, compiled as the service compiles it, and why not.

Why: on an H100 with torch 2.11 (run 149) the example repository's mobilenet_v3_small (64x64) was
profiled at load as plain ``engine`` graphs, though its config asks for gpuloom's kernels and the
build VM (torch 2.14, CPU) fuses its 9 squeeze-excitation gates. ``capture_graph`` falls back to
``torch.fx`` when export or any rewrite raises, and then no rewrite applies. This compiles each model
with ``ModelConfig.compile_options`` for the device and prints the capture method, the rewrites (a
pass that matched nothing is absent) and, after a fallback, the step that raised (``fx_because``).

Found (run 151, forty-eighth session): on the H100 the compile fused 9 gates and 6 epilogues at both
resolutions; the repository's parser had turned the kernels off (its engine keys' defaults).

    python3 scripts/diag_compile_rewrites.py --device cuda mobilenet_v3_small:64 mobilenet_v3_small:224
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="torchvision NAME:RESOLUTION (num_classes=10, random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None, help="write the findings here (JSON)")
    args = p.parse_args()

    import torch
    import torchvision

    import gpuloom
    from gpuloom.runtime.model_config import ModelConfig, TensorSpec

    rows = []
    for item in args.models:
        name, res = item.split(":")
        res = int(res)
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, num_classes=10).eval().to(args.device)
        x = torch.randn(1, 3, res, res, device=args.device)
        opts = ModelConfig(name, (TensorSpec("input", (3, res, res), "float32"),), max_batch=8).compile_options(
            torch.device(args.device).type)
        row = {"model": name, "resolution": res, "options": opts, "torch": torch.__version__}
        try:
            cm = gpuloom.compile(model, (x,), max_batch=8, device=args.device, input_names=["input"], **opts)
            row.update(method=cm.graph.method, rewrites=cm.rewrites, fx_because=cm.graph.fx_because)
        except Exception as e:  # noqa: BLE001 - the finding
            row.update(compile_error=f"{type(e).__name__}: {e}"[:500])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
