"""Engine benchmark (issue 2): eager vs torch.compile vs CUDA graph vs gpuloom single/multi/auto.

    PYTHONPATH=. python scripts/bench_engine.py --out docs/results/engine_h200.json

All variants of one (model, dtype, batch) are timed in the same process, interleaved
(``gpuloom.gpu.timing.median_ms_interleaved``): each gets 50 warm-up calls, then 10 rounds in which
every variant in turn makes 20 timed calls (the order rotating from round to round); each call is
timed with CUDA events and the median of a variant's 200 calls is reported. Interleaving makes a
drift of the host or GPU (seen on the shared H200 host: eager moved 2x between runs) hit every
variant alike instead of whichever was timed during it. Every variant is timed as a user calls
it (copy the input in, run, hand back a fresh output): eager ``model(x)``; ``torch.compile(mode=
"reduce-overhead")``; a single-stream ``torch.cuda.graph`` of the eager forward (static input copy +
replay + output clone); gpuloom ``cm(x)`` with graphs captured single-stream, multi-stream (Nimble's
plan) and ``streams="auto"``. The JSON is written after every model, so a cut-short run keeps what
it measured. ``--torch-compile-batches`` limits the (slow) torch.compile variant to some batches;
drop ``torch_compile`` from ``--variants`` to skip it for a whole invocation, e.g.

    PYTHONPATH=. python scripts/bench_engine.py --dtypes float32 \
        --models resnet50,mobilenet_v2,efficientnet_b0,inception_v3 --out run_fp32_tc.json
    PYTHONPATH=. python scripts/bench_engine.py --dtypes float32 --variants eager,cuda_graph,gpuloom \
        --models resnet101,googlenet,efficientnet_b5,densenet121,nasnetalarge,bert_base --out run_fp32.json
    python scripts/merge_engine_results.py run_fp32_tc.json run_fp32.json --out docs/results/engine_h200.json

With ``--prewarm-jobs 4`` the torch.compile graphs of every row are first compiled by four children
at once into a shared Inductor cache; the rows are then timed one at a time as above, their
torch.compile loading from the cache (``torch_compile_s`` is then that warm time; each row's cold
compile time is under ``prewarm``). Every row with torch.compile in fewer device calls:

    PYTHONPATH=. python scripts/bench_engine.py --prewarm-jobs 4 --out run_all_tc.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpuloom  # noqa: E402
from gpuloom.bench.metrics import geomean  # noqa: E402
from gpuloom.engine.critical import lower_bound_ms  # noqa: E402
from gpuloom.gpu.connections import prefer_all_connections  # noqa: E402
from gpuloom.gpu.timing import median_ms_interleaved  # noqa: E402

BRANCHY = ("inception_v3", "googlenet", "nasnetalarge", "efficientnet_b0")


def bert_base() -> nn.Module:
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True, activation="gelu")
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Model with random weights and its per-sample input shape."""
    import torchvision.models as tv

    if name == "bert_base":
        return bert_base(), (128, 768)
    if name == "nasnetalarge":
        import timm

        return timm.create_model("nasnetalarge", pretrained=False), (3, 331, 331)
    if name in ("inception_v3", "googlenet"):
        m = getattr(tv, name)(weights=None, aux_logits=False, init_weights=False)
        return m, (3, 299, 299) if name == "inception_v3" else (3, 224, 224)
    size = {"efficientnet_b5": 456}.get(name, 224)
    return getattr(tv, name)(weights=None), (3, size, size)


def eager_graph(model: nn.Module, example: torch.Tensor):
    """The plain baseline: one torch.cuda.graph of the eager forward, single stream."""
    static_in = example.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_in)

    def call(x):
        static_in.copy_(x)
        g.replay()
        return static_out.clone()

    return call


def graphset_call(gs, bucket):
    """A bare call of one bucket's graph: what ``cm(x)`` does after its input check (copy in, launch
    on the current stream, clone out), so gpuloom_single/multi vs gpuloom_auto shows that check's cost."""
    entry = gs.buckets[bucket]

    def call(x):
        entry.inputs[0].copy_(x)
        entry.graph.replay()  # launches on the current stream, as GraphSet.replay(b, current stream) does
        return entry.outputs.clone()

    return call


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """||got - want|| / ||want||, where eager's output ``want`` can be the reference. None where it
    checks nothing: not finite (float16 overflow; the error read NaN before the thirty-fourth session),
    or all zero with ``got`` all zero too (float16 underflow; it read 0.0, a perfect match in looks).
    An all-zero ``want`` beside a nonzero ``got`` is a mismatch: inf."""
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(want).all()):
        return None
    if not bool((want != 0).any()):
        return None if not bool((got != 0).any()) else float("inf")
    return float((got - want).norm() / want.norm())


def bench_model(name: str, dtype: torch.dtype, batches: list[int], args) -> dict:
    model, shape = build(name)
    model = model.eval().cuda().to(dtype)
    rec: dict = {"model": name, "dtype": str(dtype).removeprefix("torch."), "input_shape": list(shape), "rows": []}
    examples = {b: torch.randn(b, *shape, device="cuda", dtype=dtype) for b in batches}

    def compiled_with(**option):
        """gpuloom auto for this row's batches, with an experimental option if one is given. Without
        one, in the model's own layout and unfused (channels_last=False, fuse_convolutions=False), as
        every table since the first run timed it; compile's default since the thirty-fourth session
        is the gpuloom_cl_auto_fused variant (gpuloom_cl_auto, the default of sessions 21-33, stays
        unfused)."""
        return gpuloom.compile(model, (examples[batches[0]],), max_batch=max(batches), buckets=batches,
                               streams="auto", **compile_options(option))

    t0 = time.perf_counter()
    cm = compiled_with()
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    # since the thirty-eighth session a compile takes export's functional graph from the graph cache when
    # this very graph was exported before (GPULOOM_GRAPH_CACHE=0 for the cold time every run)
    rec["graph_from_cache"] = cm.graph.graph_from_cache
    rec["ops"] = len(cm.graph.ops)
    rec["capture_method"] = cm.graph.method
    rec["streams"] = cm.plan.num_streams
    rec["syncs"] = cm.plan.num_syncs
    rec["graph_memory_mib"] = round(cm.memory_bytes / 2**20, 1)
    rec["auto_choice"] = {str(b): k for b, k in cm.stream_choice.items()}
    gs_single = cm.capture(streams=1)
    gs_multi = cm.capture(streams="max")
    rec["graph_memory_mib_single"] = round(gs_single.memory_bytes / 2**20, 1)
    rec["graph_memory_mib_multi"] = round(gs_multi.memory_bytes / 2**20, 1)
    experiments = {}  # variant -> gpuloom auto compiled with that experiment's option
    for key, option in EXPERIMENTS.items():
        if key in args.variants:
            t1 = time.perf_counter()
            experiments[key] = compiled_with(**option)
            suffix = key.removeprefix("gpuloom_")
            rec[f"compile_s_{suffix}"] = round(time.perf_counter() - t1, 2)
            rec[f"auto_choice_{suffix}"] = {str(b): k for b, k in experiments[key].stream_choice.items()}
            if experiments[key].fused_epilogues:  # (fewer with the gates, which take some convolutions)
                rec["fused_epilogues" if key == "gpuloom_epilogue" else f"fused_epilogues_{suffix}"] = \
                    experiments[key].fused_epilogues
            if experiments[key].fused_gates:
                rec["fused_gates"] = experiments[key].fused_gates
            if experiments[key].split_linears:
                from gpuloom.engine import gemm

                rec["split_linears"] = experiments[key].split_linears
                # (input shape, out features) -> parts K was split in (1: cuBLAS's own call)
                rec["gemm_choices"] = {f"{list(k[0])}x{k[2]}": p for k, p in gemm.choices().items()}
    compiled = None
    rec["torch_compile_batches"] = sorted(args.torch_compile_batches & set(batches)) \
        if "torch_compile" in args.variants else []
    if rec["torch_compile_batches"]:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    for b in batches:
        x = examples[b]
        row: dict = {"batch": b}
        variants = {
            "eager": lambda v: model(v),
            "cuda_graph": eager_graph(model, x),
            "gpuloom_single": graphset_call(gs_single, b),
            "gpuloom_multi": graphset_call(gs_multi, b),
            "gpuloom_auto": lambda v: cm(v),
        }
        variants.update(experiments)
        if compiled is not None and b in args.torch_compile_batches:
            tc = time.perf_counter()
            for _ in range(3):
                compiled(x)
            torch.cuda.synchronize()
            row["torch_compile_s"] = round(time.perf_counter() - tc, 1)
            variants["torch_compile"] = lambda v: compiled(v).clone()
        with torch.no_grad():
            fresh = torch.randn_like(x)
            want = model(fresh)
            for key in [k for k in variants if k.startswith("gpuloom")]:
                row[f"rel_err_{key}"] = rel_err(variants[key](fresh), want)
            timed = {key: (lambda fn=fn: fn(x)) for key, fn in variants.items()
                     if key in args.variants or key.startswith("gpuloom") or key == "eager"}
            medians = median_ms_interleaved(timed, warmup=args.warmup, iters=args.iters, rounds=args.rounds, cuda=True)
            for key, ms in medians.items():
                row[f"{key}_ms"] = round(ms, 4)
        if args.lower_bound:
            with torch.no_grad():
                cp, total = lower_bound_ms(cm, b)
            row["critical_path_ms"] = round(cp, 4)
            row["kernel_sum_ms"] = round(total, 4)
        add_ratios(row)
        rec["rows"].append(row)
        print(f"  {name} {rec['dtype']} b{b}: " + ", ".join(
            f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    del cm, gs_single, gs_multi, compiled, experiments
    return rec


#: experimental variants: gpuloom auto compiled with one more option each
EXPERIMENTS = {
    "gpuloom_reinplace": {"reinplace": True},  # in-place ReLU/add on single-reader inputs
    "gpuloom_cl": {"channels_last": True},  # convolution weights NHWC (torch.compile's layout)
    # both layouts timed, the faster kept per bucket, unfused: compile's default in sessions 21-33
    # (gpuloom_auto stays in the model's own layout, as it always ran)
    "gpuloom_cl_auto": {"channels_last": "auto"},
    # compile's default since the thirty-fourth session: gpuloom_cl_auto with the channels-last
    # candidate's convolutions fused with their bias and ReLU (engine runs 100-104); CUDA only
    "gpuloom_cl_auto_fused": {"channels_last": "auto", "fuse_convolutions": "channels_last"},
    # compile's default since the thirty-ninth session: gpuloom_cl_auto_fused with float32 linear layers
    # splitting their GEMM's reduction where that was timed faster per shape (gpuloom.engine.gemm)
    "gpuloom_split": {"channels_last": "auto", "fuse_convolutions": "channels_last", "split_gemms": True},
    # compile's default since the fortieth session: the above, and each convolution's bias (+ add) +
    # SiLU / sigmoid / ReLU6 in one kernel (gpuloom.engine.epilogue)
    "gpuloom_epilogue": {"channels_last": "auto", "fuse_convolutions": "channels_last", "split_gemms": True,
                         "fuse_epilogues": True},
    # compile's default since the forty-first session: the above, and each squeeze-excitation gate in
    # one kernel (gpuloom.engine.excitation)
    "gpuloom_gates": {"channels_last": "auto", "fuse_convolutions": "channels_last", "split_gemms": True,
                      "fuse_epilogues": True, "fuse_gates": True},
}


def compile_options(option: dict) -> dict:
    """gpuloom.compile's layout and fusion options for a variant: the model's own layout, unfused,
    unless the variant's ``option`` (an ``EXPERIMENTS`` entry, or {} for gpuloom auto) says otherwise,
    so that each column keeps the meaning it had in every earlier run."""
    return {"channels_last": False, "fuse_convolutions": False, "split_gemms": False, "fuse_epilogues": False,
            "fuse_gates": False, **option}


def add_ratios(row: dict) -> None:
    """Speedups over eager and the graph ratios, each only where both of its variants were timed.

    `--variants` may leave out eager or the CUDA graph (the torch.compile-only calls do); a ratio with a
    missing side is left out rather than failing the row after its timing is done.
    """
    def put(key: str, num: str, den: str) -> None:
        if row.get(num) and row.get(den):
            row[key] = round(row[num] / row[den], 3)

    for key in list(row):
        if key.endswith("_ms") and key not in ("eager_ms", "critical_path_ms", "kernel_sum_ms"):
            put(f"speedup_{key[:-3]}", "eager_ms", key)
    put("multi_over_single_graph", "cuda_graph_ms", "gpuloom_multi_ms")
    put("auto_over_single_graph", "cuda_graph_ms", "gpuloom_auto_ms")
    put("multi_over_critical_path", "gpuloom_multi_ms", "critical_path_ms")


def summarize(results: list[dict]) -> dict:
    def pick(dtype, batch, key, models=None):
        out = {}
        for r in results:
            if r.get("dtype") != dtype or "rows" not in r or (models and r["model"] not in models):
                continue
            for row in r["rows"]:
                if row["batch"] == batch and key in row:
                    out[r["model"]] = row[key]
        return out

    s = {}
    for dtype in ("float32", "float16"):
        for b in (1, 8):
            sp = pick(dtype, b, "speedup_gpuloom_auto")
            ms = pick(dtype, b, "multi_over_single_graph", BRANCHY)
            au = pick(dtype, b, "auto_over_single_graph")
            if sp:
                s[f"{dtype}_b{b}"] = {
                    "geomean_speedup_auto_over_eager": round(geomean(list(sp.values())), 3),
                    "geomean_multi_over_graph_branchy": round(geomean(list(ms.values())), 3) if ms else None,
                    "worst_auto_over_graph": round(min(au.values()), 3) if au else None,
                }
    return s


_CPP_FRAME = re.compile(r"^frame #\d+: ")


def run_child(name: str, dtype_name: str, args: argparse.Namespace) -> dict:
    """One (model, dtype) in a child process; its result, or an error entry with the child's last words.

    On the H200 a CUDA error in one model (bert_base, run 8: ``unspecified launch failure``) left the
    process's context unusable and the remaining models unmeasured.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_engine.") as tmp:
        child_out = Path(tmp) / "one.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--no-isolate", "--models", name, "--dtypes", dtype_name,
               "--batches", args.batches, "--variants", ",".join(sorted(args.variants)),
               "--torch-compile-batches", ",".join(str(b) for b in sorted(args.torch_compile_batches)),
               "--warmup", str(args.warmup), "--iters", str(args.iters), "--rounds", str(args.rounds),
               "--out", str(child_out)] + ([] if args.lower_bound else ["--no-lower-bound"])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.model_timeout)
            # C++ stack frames ("frame #7: ...") would fill the tail and push out the error's own message
            said = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not _CPP_FRAME.match(line))
            tail, rc = said[-3000:], proc.returncode
        except subprocess.TimeoutExpired as e:
            tail, rc = f"timed out after {args.model_timeout:.0f} s: {str(e.stdout or '')[-2000:]}", None
        print(tail if rc else "\n".join(l for l in tail.splitlines() if l.startswith("  ")), flush=True)
        try:
            (res,) = json.loads(child_out.read_text())["results"]
        except (OSError, ValueError):
            res = {"model": name, "dtype": dtype_name, "error": f"child exited with {rc}: {tail[-1500:]}"}
        return res


def run_parallel(cmds: list[list[str]], jobs: int, timeout_s: float, env: dict | None = None) -> list[dict]:
    """Run ``cmds`` as child processes, at most ``jobs`` at once; per command, in order: its return code
    (None: killed at ``timeout_s``), wall seconds and the tail of its output."""
    import subprocess

    results: list[dict | None] = [None] * len(cmds)
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    pending = list(range(len(cmds)))
    while pending or running:
        while pending and len(running) < max(1, jobs):
            i = pending.pop(0)
            running[i] = (subprocess.Popen(cmds[i], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=env), time.perf_counter())
        time.sleep(0.05)
        for i, (proc, t0) in list(running.items()):
            over = time.perf_counter() - t0 > timeout_s
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0] or ""
            results[i] = {"rc": None if over else proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                          "tail": out[-1500:]}
            del running[i]
    return results  # type: ignore[return-value]


def prewarm_torch_compile(pairs: list[tuple[str, str]], args: argparse.Namespace) -> list[dict]:
    """Compile torch.compile's graphs of every (model, dtype) in ``args.prewarm_jobs`` parallel children
    into the shared Inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so the timed children, one at a time,
    load them instead of compiling: each build took 13-24 s on the H200 host (fourth session), 40
    rows' worth more than three 10-minute device calls. Returns what each child took (its cold
    compile time)."""
    cmds = [[sys.executable, str(Path(__file__).resolve()), "--no-isolate", "--prewarm-only", "--models", name,
             "--dtypes", dtype_name, "--batches", args.batches,
             "--torch-compile-batches", ",".join(str(b) for b in sorted(args.torch_compile_batches))]
            for name, dtype_name in pairs]
    done = run_parallel(cmds, args.prewarm_jobs, args.model_timeout)
    return [{"model": n, "dtype": d, "rc": r["rc"], "seconds": r["seconds"],
             **({"tail": r["tail"]} if r["rc"] != 0 else {})} for (n, d), r in zip(pairs, done)]


def compile_only(name: str, dtype: torch.dtype, batches: list[int], args) -> None:
    """``--prewarm-only``: torch.compile the model for each of its batches and call it 3 times (what
    fills the Inductor cache); nothing timed."""
    model, shape = build(name)
    model = model.eval().cuda().to(dtype)
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    for b in sorted(args.torch_compile_batches & set(batches)):
        x = torch.randn(b, *shape, device="cuda", dtype=dtype)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
        torch.cuda.synchronize()
        print(f"  prewarmed {name} {dtype} batch {b} in {time.perf_counter() - t0:.1f} s", flush=True)


def pairs_from(models: str, dtypes: str, pairs: str | None) -> list[tuple[str, str]]:
    """The (model, dtype) rows of a run in timing order: ``--pairs resnet50:float16,...`` as given, else
    every model for each dtype. Pairs let one call time rows missing from earlier runs without timing
    again the ones they have (densenet121 in float32 but not float16)."""
    if not pairs:
        return [(n, d) for d in dtypes.split(",") for n in models.split(",")]
    out = []
    for item in pairs.split(","):
        name, sep, dtype_name = item.strip().partition(":")
        if not sep or not name or dtype_name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"--pairs wants MODEL:DTYPE items (DTYPE float32, float16 or bfloat16), got {item!r}")
        out.append((name, dtype_name))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,resnet101,inception_v3,googlenet,mobilenet_v2,efficientnet_b0,"
                                       "efficientnet_b5,densenet121,nasnetalarge,bert_base")
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--pairs", default=None,
                   help="MODEL:DTYPE,... rows to time, in this order, instead of every --models for each --dtypes")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default="eager,torch_compile,cuda_graph,gpuloom,gpuloom_cl_auto,gpuloom_cl_auto_fused",
                   help="drop torch_compile to save its compile time; gpuloom_cl_auto_fused is compile's default "
                        "since the thirty-fourth session (both layouts timed, the faster kept per bucket, the "
                        "channels-last graph's convolutions fused), gpuloom_cl_auto the same unfused (the default "
                        "of sessions 21-33); gpuloom auto itself stays in the model's own layout, unfused, as every "
                        "earlier run timed it; add gpuloom_reinplace or gpuloom_cl (convolution weights "
                        "channels-last) for those experiments")
    p.add_argument("--torch-compile-batches", default="1,8",
                   help="batches on which the torch_compile variant runs (it compiles once per batch size)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls per variant before timing")
    p.add_argument("--iters", type=int, default=200, help="timed calls per variant (the median is reported)")
    p.add_argument("--rounds", type=int, default=10,
                   help="the variants take turns this many times, each timing iters/rounds calls a turn")
    p.add_argument("--no-lower-bound", dest="lower_bound", action="store_false")
    p.add_argument("--out", default="docs/results/engine_h200.json")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every (model, dtype) in this process (default: each in a child process, so a CUDA "
                        "error -- which poisons the process's context -- loses only that model)")
    p.add_argument("--model-timeout", type=float, default=900.0, help="seconds per (model, dtype) child (default 900)")
    p.add_argument("--prewarm-jobs", type=int, default=0,
                   help="first compile every row's torch.compile graphs in this many parallel children into the "
                        "shared Inductor cache, then time the rows one at a time (default 0: no prewarm)")
    p.add_argument("--inductor-cache", default="/tmp/gpuloom_inductor_cache",
                   help="TORCHINDUCTOR_CACHE_DIR for this run and its children (with --prewarm-jobs)")
    p.add_argument("--prewarm-only", action="store_true", help=argparse.SUPPRESS)  # a prewarm child
    args = p.parse_args()
    args.variants = set(args.variants.split(","))
    try:
        pairs = pairs_from(args.models, args.dtypes, args.pairs)
    except ValueError as e:
        p.error(str(e))
    batches = [int(b) for b in args.batches.split(",")]
    args.torch_compile_batches = {int(b) for b in args.torch_compile_batches.split(",") if b.strip()}
    if not 1 <= args.rounds <= args.iters:
        p.error(f"--rounds must be between 1 and --iters={args.iters}, got {args.rounds}")
    # as gpuloom's command line does, before CUDA starts (children inherit it): multi-stream graphs get
    # all 32 hardware workqueues unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise (gpuloom/gpu/connections.py)
    connections = prefer_all_connections()
    torch.backends.cudnn.benchmark = True
    if args.prewarm_only:
        for name, dtype_name in pairs:
            compile_only(name, getattr(torch, dtype_name), batches, args)
        return 0
    prewarm = None
    if args.prewarm_jobs > 0 and args.isolate and "torch_compile" in args.variants:
        import os

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache  # the children inherit it
        t0 = time.perf_counter()
        prewarm = {"jobs": args.prewarm_jobs, "cache": args.inductor_cache, "children": prewarm_torch_compile(pairs, args)}
        prewarm["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"prewarmed {len(pairs)} (model, dtype) in {prewarm['seconds']} s, {args.prewarm_jobs} at once", flush=True)
    out = {
        "benchmark": "engine",
        **connections.as_meta(),
        "gpu": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "method": ("interleaved: variants of one (model, dtype, batch) take turns in %d rounds (order rotated "
                   "each round) of %d timed calls (after one untimed call) per turn, after %d warm-up calls per "
                   "variant; CUDA events per call, "
                   "median of %d per variant, per call incl. input copy + output clone" % (
                       args.rounds, args.iters // args.rounds, args.warmup, args.iters)),
        "results": [],
        **({"prewarm": prewarm} if prewarm else {}),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, dtype_name in pairs:
        print(f"{name} {dtype_name}", flush=True)
        if args.isolate:
            out["results"].append(run_child(name, dtype_name, args))
        else:
            try:
                out["results"].append(bench_model(name, getattr(torch, dtype_name), batches, args))
            except Exception as e:  # keep going: one model's failure is a result too
                traceback.print_exc()
                out["results"].append({"model": name, "dtype": dtype_name, "error": f"{type(e).__name__}: {e}"[:2000]})
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        out["summary"] = summarize(out["results"])
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
