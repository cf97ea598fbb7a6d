"""Which step faults when gpuloom's graphs and torch.compile(mode="reduce-overhead") share a process?

Engine runs 26 and 27: nasnetalarge float16 in bench_engine died with an illegal memory access
(raised from CUDACachingAllocator insert_events) after torch.compile's warm-up calls, at the next
replay of a gpuloom graph. CUDA errors are asynchronous, so the step that reports one need not be the
step that caused it. Here every step ends in a synchronize, so the first step whose synchronize fails
is the one whose kernels faulted. Steps, in the order given by --steps:

- ``gpuloom``: gpuloom.compile (auto) + single- and multi-stream captures, each replayed and compared
  with eager;
- ``cuda_graph``: one torch.cuda.graph of the eager forward (bench_engine's baseline), checked;
- ``tc``: torch.compile(reduce-overhead), three calls per batch, checked;
- ``clear``: what torch.compile does to every graph made before it, without torch.compile: torch's
  map of cuBLAS workspaces cleared, the cache emptied, then 32 MiB sentinels on every stream take
  the memory given back (``replay`` then checks that no replay wrote into them);
- ``replay``: every graph made so far replayed again on fresh inputs and checked, one by one.

``--without-fix`` captures as before the fix (``capture.cublas_workspaces_in_pool`` made a no-op):
the before half of a before/after pair in one checkout.

Prints one JSON line per step (ok / error, the largest relative error) and writes them to --out.

    PYTHONPATH=. python3 scripts/diag_tc_interplay.py --steps tc
    PYTHONPATH=. python3 scripts/diag_tc_interplay.py --steps gpuloom,cuda_graph,tc,replay
    PYTHONPATH=. python3 scripts/diag_tc_interplay.py --model resnet50 --steps gpuloom,clear,replay --without-fix
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402  (build, eager_graph, graphset_call, rel_err)

import gpuloom  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nasnetalarge")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", default="gpuloom,cuda_graph,tc,replay")
    p.add_argument("--without-fix", action="store_true",
                   help="capture without cublas_workspaces_in_pool (the code before the fix)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.without_fix:
        from gpuloom.engine import capture
        capture.cublas_workspaces_in_pool = contextlib.nullcontext
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    torch.backends.cudnn.benchmark = True
    model, shape = bench_engine.build(args.model)
    model = model.eval().cuda().to(dtype)
    examples = {b: torch.randn(b, *shape, device="cuda", dtype=dtype) for b in batches}
    calls: dict[str, object] = {}  # name -> callable(x) made so far
    records: list[dict] = []

    def check(names: list[str]) -> float | None:
        """The worst relative error against eager; None where eager's output checked nothing (it
        overflowed, or it and the output vanished: ``bench_engine.rel_err``)."""
        errs = []
        with torch.no_grad():
            for name in names:
                b = int(name.rsplit("_b", 1)[1])
                fresh = torch.randn_like(examples[b])
                errs.append(bench_engine.rel_err(calls[name](fresh), model(fresh)))
        checked = [e for e in errs if e is not None]
        return max(checked) if checked else None

    def step_gpuloom() -> list[str]:
        cm = gpuloom.compile(model, (examples[batches[0]],), max_batch=max(batches), buckets=batches,
                             streams="auto", channels_last=False)
        single, multi = cm.capture(streams=1), cm.capture(streams="max")
        names = []
        for b in batches:
            calls[f"gpuloom_auto_b{b}"] = cm
            calls[f"gpuloom_single_b{b}"] = bench_engine.graphset_call(single, b)
            calls[f"gpuloom_multi_b{b}"] = bench_engine.graphset_call(multi, b)
            names += [f"gpuloom_auto_b{b}", f"gpuloom_single_b{b}", f"gpuloom_multi_b{b}"]
        calls["_keep"] = (cm, single, multi)
        return names

    def step_cuda_graph() -> list[str]:
        for b in batches:
            calls[f"cuda_graph_b{b}"] = bench_engine.eager_graph(model, examples[b])
        return [f"cuda_graph_b{b}" for b in batches]

    def step_tc() -> list[str]:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        for b in batches:
            for _ in range(3):
                compiled(examples[b])
            calls[f"torch_compile_b{b}"] = lambda v, c=compiled: c(v).clone()
        return [f"torch_compile_b{b}" for b in batches]

    sentinels: list[torch.Tensor] = []

    def step_clear() -> list[str]:
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        keep = calls.get("_keep")
        streams = [torch.cuda.current_stream()] + (list(keep[1].streams) if keep else [])
        for s in streams:
            with torch.cuda.stream(s):
                sentinels.extend(torch.full((2**23,), 7.0, device="cuda") for _ in range(4))
        return []

    def step_replay() -> list[str]:
        names = [n for n in calls if not n.startswith("_")]
        for n in names:  # one at a time: the first to fail names its graph
            try:
                check([n])
                torch.cuda.synchronize()
            except Exception as e:
                raise RuntimeError(f"replaying {n}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
        torch.cuda.synchronize()
        if not all(bool((t == 7.0).all()) for t in sentinels):
            raise RuntimeError("a replay wrote into the sentinels: memory its graph no longer owns")
        return names

    steps = {"gpuloom": step_gpuloom, "cuda_graph": step_cuda_graph, "tc": step_tc, "clear": step_clear,
             "replay": step_replay}
    rc = 0
    print(json.dumps({"without_fix": args.without_fix}), flush=True)
    for name in args.steps.split(","):
        t0 = time.perf_counter()
        rec: dict = {"step": name, "model": args.model, "dtype": args.dtype, "batches": batches}
        try:
            with torch.no_grad():
                names = steps[name]()
            torch.cuda.synchronize()
            rec["made_s"] = round(time.perf_counter() - t0, 1)
            rec["checked"] = names
            rec["max_rel_err"] = check(names)
            torch.cuda.synchronize()
            rec["ok"] = True
        except Exception as e:  # the first failing synchronize names the step that faulted
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            rc = 1
        rec["s"] = round(time.perf_counter() - t0, 1)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if args.out:  # after every step: a fault may abort the process on its way out
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"diag": "tc_interplay", "torch": torch.__version__,
                                                  "without_fix": args.without_fix,
                                                  "steps": records}, indent=1))
        if not rec["ok"]:
            break
    return rc


if __name__ == "__main__":
    sys.exit(main())
