#!/usr/bin/env python
"""Where a CUDA layout build's time goes, function by function (cProfile).

Why: on the H200 a layout of the example repository's three small models took 5-6.6 s to build,
99% of it in captures (run 115's "built ... captures 5.3 s" log line); mobilenet_v3_small alone on
one 16-SM partition took 4.9 s. This compiles the repository's models as the server does, then
builds a one-partition layout of each alone, then all of them on their own partitions, under
cProfile, and prints each build's time and its top functions by cumulative and by own time. Run 116:
0.17 s for mobilenet_v3_small alone, 0.36 s for all three, on the thread that had compiled them, where
the server's builds (each on a fresh thread) took 5.0-6.6 s: PyTorch keeps cuDNN's autotuning per
thread (``device.Builder``). ``--threads`` times that directly: the layout of all three built on a
fresh thread and on the layer's builder thread, A B B A. Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_build_profile.py --out /tmp/build_profile.txt
    PYTHONPATH=. python3 scripts/diag_build_profile.py --threads --out /tmp/build_threads.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gpuloom


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default="examples/repository")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", action="store_true",
                    help="instead: the all-models layout built on a fresh thread, on the layer's builder "
                         "thread (where the models were compiled), twice, and on a fresh thread again")
    ap.add_argument("--compile", action="store_true",
                    help="also profile each model's compile (cProfile, top functions by cumulative time)")
    args = ap.parse_args()

    from gpuloom.policy.types import Layout
    from gpuloom.runtime.cuda_device import CudaDeviceLayer
    from gpuloom.runtime.service import InferenceService
    from gpuloom.serve.repository import load_repository

    repo = load_repository(args.repo)
    svc = InferenceService(policy="triton", device="cuda", profile_cache=None, measure_profiles=False)
    layer = CudaDeviceLayer(0)
    compiled = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in repo.names():
            config, module = repo.models[name].build()
            t0 = time.perf_counter()
            prof = cProfile.Profile() if args.compile else None

            def compile_it(config=config, module=module, prof=prof):
                if prof is not None:
                    prof.enable()
                try:  # on the layer's builder thread, as the service compiles (cuDNN's timings are per thread)
                    return svc._compile(config, module)
                finally:
                    if prof is not None:
                        prof.disable()

            cm, _ = layer.builder.call(compile_it)
            compiled[name] = cm
            print(f"compiled {name} in {time.perf_counter() - t0:.1f} s; buckets {cm.buckets}", flush=True)
            if prof is not None:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
                print(f"-- compile of {name} by cumulative\n" + "\n".join(s.getvalue().splitlines()[6:]), flush=True)
    out = io.StringIO()
    for name, cm in compiled.items():
        layer.add_model(name, cm)
    if args.threads:
        return _threads(layer, compiled, args.out)
    layouts = [(f"{n} alone", Layout.exclusive(layer.gpu_sms, [(16, n)]), [n]) for n in compiled]
    layouts.append(("all", Layout.exclusive(layer.gpu_sms, [(16, n) for n in compiled]), list(compiled)))
    for what, layout, models in layouts:
        for n in list(layer.models):
            if n not in models:
                layer.remove_model(n)
        for n in models:
            if n not in layer.models:
                layer.add_model(n, compiled[n])
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        lanes = layer.build(layout)
        prof.disable()
        took = time.perf_counter() - t0
        line = f"== {what}: built in {took:.2f} s; phases {({k: round(v, 2) for k, v in layer.build_phases.items()})}"
        print(line, flush=True)
        out.write(line + "\n")
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            out.write(f"-- by {key}\n" + "\n".join(s.getvalue().splitlines()[6:]) + "\n")
        layer.release(lanes)
        layer.trim()
    layer.close()
    svc.close()
    text = out.getvalue()
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _threads(layer, compiled, out_path) -> int:
    """The same layout built on a fresh thread and on the builder thread, in turn (A B B A)."""
    import json
    import threading

    from gpuloom.policy.types import Layout

    layout = Layout.exclusive(layer.gpu_sms, [(16, n) for n in compiled])
    rows = []
    for where in ("fresh thread", "builder thread", "builder thread", "fresh thread"):
        box = {}

        def build() -> None:
            t0 = time.perf_counter()
            box["lanes"] = layer.build(layout)
            box["s"] = time.perf_counter() - t0

        if where == "fresh thread":
            th = threading.Thread(target=build)
            th.start()
            th.join()
        else:
            layer.builder.call(build)
        rows.append({"where": where, "build_s": round(box["s"], 3),
                     "phases": {k: round(v, 3) for k, v in layer.build_phases.items()}})
        print(json.dumps(rows[-1]), flush=True)
        layer.release(box["lanes"])
        layer.trim()  # the next build captures again instead of taking this one from the cache
    layer.close()
    if out_path:
        Path(out_path).write_text(json.dumps({"models": list(compiled), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
