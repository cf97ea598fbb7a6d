"""The GPU runtime on the real device (issue 5): one script, one JSON.

    PYTHONPATH=. timeout 590 python3 scripts/gpu_runtime_check.py --out $OUT

Checks, each recorded (errors too) in ``$OUT/runtime_gpu_check.json`` after every step, so a
timeout still leaves what was measured:

1. ``serve``: every policy (dstack, triton, clipper, nexus, gslice, temporal) serves a short open-loop
   mix of three zoo models (light3 models, scaled down) through ``InferenceService`` on CUDA; goodput,
   attainment, p99, SM utilization, GPU idle ratio, dispatch overhead per policy; outputs of a
   sample of requests compared with the eager model (relative max error).
2. ``disjoint``: while a dstack service is live (between load points), the exclusive partitions'
   driver SM counts add up within the device, and a bf16 matmul graph captured on two of its lanes
   takes about as long on both at once as on one alone (overlapping lanes would take ~2x).
3. ``failure``: one model made to fail (``inject_fault``) fails only its own requests; the others
   keep their attainment.
4. ``memory``: a graph-memory budget too small for a model gives ``ModelNotReady`` naming graph
   memory (no OOM, the service stays live).
4b. ``loadwhile``: a fourth model (googlenet) is compiled, captured and loaded while dstack serves
   three, answers a request, and is unloaded; the others see no failures (a capture racing the
   serving threads would show up here).
5. ``overhead``: the 6-model mix (examples/mix6.yaml models) compiled at max_batch 1 under dstack (its
   default lanes, and on partitions) and triton: dispatch overhead (host dispatch ms / device ms;
   target < 5%) and GPU idle ratio with work queued; ``--overhead-outputs views,copies`` runs each
   for both ways of handing outputs back (runs named ``dstack:outputs=views`` and so on).

``--only serve,failure`` runs a subset; ``--quick`` shortens the points.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpuloom.gpu.connections import prefer_all_connections  # noqa: E402
from gpuloom.gpu.timing import replay_alone_and_together  # noqa: E402

R: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
OUT: Path = Path(".")
POLICIES = ["dstack", "triton", "clipper", "nexus", "gslice", "temporal"]
DEV = "cuda"  # --cpu-dry-run: "cpu" with tiny models and low rates (checks this script's plumbing only)
RATE_SCALE = 1.0
RATE_SCALE_HINT = 1.0  # rate hints x this (the overhead check runs at a fraction of the mix's rates)


def save() -> None:
    (OUT / "runtime_gpu_check.json").write_text(json.dumps(R, indent=1, default=str) + "\n")


def step(name: str, fn, *args, **kw):
    t = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        R[name] = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - record and go on
        R[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(R[name]["trace"], flush=True)
    R.setdefault("_seconds", {})[name] = round(time.perf_counter() - t, 1)
    save()
    print(f"   {name}: {json.dumps(R[name], default=str)[:1500]}", flush=True)


# -- models ---------------------------------------------------------------------------------------
def build(names, max_batch):
    """{name: (ModelConfig, CompiledModel, eager module)} on cuda:0."""
    import gpuloom
    from gpuloom.profile.profiler import load_model
    from gpuloom.runtime.service import ModelConfig, TensorSpec

    out = {}
    for name in names:
        t = time.perf_counter()
        if DEV == "cpu":
            from gpuloom.bench.e2e import TINY_DIM, tiny_module
            from gpuloom.profile.profiler import ModelSpec

            ms = ModelSpec(name, tiny_module(name), ((TINY_DIM,),), (torch.float32,))
        else:
            ms = load_model(name, device="cuda")
        ex = tuple(torch.randn((1, *s), device=DEV).to(dt) for s, dt in zip(ms.input_shapes, ms.input_dtypes))
        specs = tuple(TensorSpec(f"input{i}", tuple(s), str(dt).removeprefix("torch."))
                      for i, (s, dt) in enumerate(zip(ms.input_shapes, ms.input_dtypes)))
        cfg = ModelConfig(name, specs, max_batch=max_batch)
        cm = gpuloom.compile(ms.module, ex, max_batch=max_batch, device=DEV, input_names=[t.name for t in specs],
                             **cfg.compile_options(torch.device(DEV).type))  # as served
        out[name] = (cfg, cm, ms.module)
        print(f"   compiled {name} in {time.perf_counter() - t:.1f}s, graph memory {cm.memory_bytes / 2**20:.0f} MiB",
              flush=True)
    return out


def workload(names, slos, rates, duration):
    from gpuloom.bench.workload import Arrival, ModelSpec, Workload

    return Workload(tuple(ModelSpec(n, float(slos[n]) * (20 if DEV == "cpu" else 1), 1.0,
                                    Arrival("poisson", rate=float(rates[n]) * RATE_SCALE))
                          for n in names), duration_s=duration, seed=7)


def service(policy, models, wl, **kw):
    import dataclasses

    from gpuloom.profile.store import ProfileStore
    from gpuloom.runtime.service import InferenceService

    svc = InferenceService(policy=policy, device=DEV, profiles=ProfileStore.builtin("h200") if DEV == "cuda" else None,
                           **kw)
    svc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svc.load_many([(dataclasses.replace(cfg, slo_ms=wl.spec(name).slo_ms, rate_hint=wl.mean_rate(wl.spec(name))
                                            * RATE_SCALE_HINT), cm) for name, (cfg, cm, _) in models.items()])
    return svc


def compare_eager(svc, models, n=8):
    """Max relative error (max |y - ref| / max |ref|) of served outputs vs the eager module, per model."""
    rng = np.random.default_rng(1)
    errs = {}
    for name, (cfg, _, module) in models.items():
        worst = 0.0
        for i in range(n):
            rows = 1 + i % 3
            x = {t.name: rng.standard_normal((rows, *t.shape)).astype(t.dtype) for t in cfg.inputs}
            y = svc.submit(name, x, deadline_ms=60_000).result(60)
            with svc.device.exclusive(), torch.inference_mode():  # no capture may run meanwhile
                ref = module(*[torch.from_numpy(x[t.name]).to(DEV) for t in cfg.inputs])
            ref = (ref[0] if isinstance(ref, (tuple, list)) else ref).float().cpu().numpy()
            got = next(iter(y.values())).astype(np.float32)
            assert got.shape == ref.shape, (name, got.shape, ref.shape)
            worst = max(worst, float(np.abs(got - ref).max() / max(1e-6, np.abs(ref).max())))
        errs[name] = worst
    return errs


def point_json(p):
    import dataclasses

    d = dataclasses.asdict(p)
    d["models"] = {m["model"]: {k: m[k] for k in ("submitted", "served", "on_time", "dropped", "failed", "rejected",
                                                   "slo_attainment", "p99_ms", "errors")} for m in d["models"]}
    return d


# -- checks ---------------------------------------------------------------------------------------
LIGHT = ["mobilenet_v2", "efficientnet_b0", "resnet50"]
LIGHT_SLO = {"mobilenet_v2": 10, "efficientnet_b0": 15, "resnet50": 20}
LIGHT_RATE = {"mobilenet_v2": 300, "efficientnet_b0": 200, "resnet50": 150}


def check_serve(models, duration):
    from gpuloom.bench.e2e import run_point

    wl = workload(LIGHT, LIGHT_SLO, LIGHT_RATE, duration)
    out = {}
    for pol in POLICIES:
        t = time.perf_counter()
        try:
            svc = service(pol, models, wl)
            try:
                load_s = time.perf_counter() - t
                p = run_point(svc, wl, pol, scale=1.0, duration_s=duration)
                err = compare_eager(svc, models)
                st = svc.stats()
                out[pol] = {"load_s": round(load_s, 1), "point": point_json(p), "eager_rel_err": err,
                            "outputs_match": all(v < 2e-2 for v in err.values()),
                            "totals": st["totals"], "backend": st["backend"]}
            finally:
                svc.close(drain=True, timeout_s=10)
        except Exception as e:  # noqa: BLE001
            out[pol] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        R["serve_partial"] = out
        save()
        print(f"   {pol}: {json.dumps(out[pol], default=str)[:600]}", flush=True)
    R.pop("serve_partial", None)
    return out


def _matmul_on(stream, n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.matmul(a, b, out=c)  # warm-up (cuBLAS handle in this context)
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        torch.matmul(a, b, out=c)
    return g, (a, b, c)


def check_disjoint(models, duration):
    from gpuloom.bench.e2e import run_point

    wl = workload(LIGHT, LIGHT_SLO, LIGHT_RATE, duration)
    svc = service("dstack", models, wl)
    try:
        p = run_point(svc, wl, "dstack", scale=1.0, duration_s=duration)
        lanes = svc._backend._lanes
        layout = lanes.layout
        sms = svc.device.partition_sms(lanes)
        excl = [(i, s) for i, (s, part) in enumerate(zip(sms, layout.partitions)) if not part.shared]
        res = {"layout": [repr(x) for x in layout.partitions], "driver_sms": sms,
               "exclusive_sum": sum(s for _, s in excl), "gpu_sms": svc.device.gpu_sms,
               "attainment_before": p.slo_attainment}
        res["sum_within_device"] = res["exclusive_sum"] <= svc.device.gpu_sms
        if len(excl) >= 2:
            (ia, _), (ib, _) = excl[0], excl[1]
            sa = lanes.state["lanes"][ia].streams.streams[0]
            sb = lanes.state["lanes"][ib].streams.streams[0]
            with svc.device.exclusive():  # no re-plan capture meanwhile
                ga, ka = _matmul_on(sa)
                gb, kb = _matmul_on(sb)

            # the slower partition sets "both"; compare with each alone
            t1, tb, t2 = replay_alone_and_together(ga, sa, gb, sb)
            res.update({"lanes_probed": [ia, ib], "alone_a_ms": t1, "alone_b_ms": tb, "both_ms": t2,
                        "disjoint": t2 < 1.35 * max(t1, tb)})
            del ga, gb, ka, kb
        p2 = run_point(svc, wl, "dstack", scale=1.0, duration_s=duration)  # still serving after the probe
        res["attainment_after"] = p2.slo_attainment
        return res
    finally:
        svc.close(drain=True, timeout_s=10)


def check_failure(models, duration):
    from gpuloom.bench.e2e import run_point

    wl = workload(LIGHT, LIGHT_SLO, LIGHT_RATE, duration)
    out = {}
    for pol in ("dstack", "triton"):
        svc = service(pol, models, wl)
        try:
            svc.device.inject_fault("efficientnet_b0", "injected failure")
            p = run_point(svc, wl, pol, scale=1.0, duration_s=duration)
            pj = point_json(p)
            st = svc.stats()
            bad = pj["models"]["efficientnet_b0"]
            others = {m: v["slo_attainment"] for m, v in pj["models"].items() if m != "efficientnet_b0"}
            out[pol] = {"failed_model": bad, "others_attainment": others, "totals": st["totals"],
                        "isolated": bad["served"] == 0 and bad["failed"] > 0 and min(others.values()) > 0.9,
                        "books_balance": st["totals"]["accepted"] == st["totals"]["success"] + st["totals"]["failure"]
                        + st["totals"]["dropped"] + st["totals"]["in_flight"]}
        finally:
            svc.close(drain=True, timeout_s=10)
    return out


def check_memory(models):
    from gpuloom.runtime.cuda_device import CudaDeviceLayer
    from gpuloom.runtime.service import InferenceService, ModelNotReady

    name = "resnet50"
    cfg, cm, _ = models[name]
    layer = CudaDeviceLayer(0, memory_limit_bytes=16 * 2**20)  # 16 MiB: too small for resnet50's graphs
    svc = InferenceService(policy="gslice", device_layer=layer)
    svc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.load(cfg, cm)
        return {"refused": False, "note": "loaded within 16 MiB?", "memory": layer.memory_bytes()}
    except ModelNotReady as e:
        return {"refused": True, "message": str(e)[:400], "live": svc.is_live()}
    finally:
        svc.close(drain=False, timeout_s=5)
        layer.close()  # handed to the service, so not closed by it


def check_load_while_serving(models, duration):
    """Load a fourth model (compile + capture) while three are being served; unload it again."""
    from gpuloom.bench.e2e import run_point
    from gpuloom.runtime.service import ModelConfig

    wl = workload(LIGHT, LIGHT_SLO, LIGHT_RATE, duration * 2)
    svc = service("dstack", models, wl)
    res = {}
    try:
        def loader():
            time.sleep(duration / 2)
            t = time.perf_counter()
            try:
                extra = build(["googlenet"], max_batch=8)["googlenet"]
                svc.load(ModelConfig("googlenet", extra[0].inputs, max_batch=8, slo_ms=50), extra[1])
                y = svc.submit("googlenet", {i.name: np.zeros((1, *i.shape), i.dtype) for i in extra[0].inputs},
                               deadline_ms=60_000).result(60)
                res["loaded"] = {"seconds": round(time.perf_counter() - t, 1),
                                 "output_shape": list(next(iter(y.values())).shape)}
                svc.unload("googlenet")
                res["unloaded"] = True
            except Exception as e:  # noqa: BLE001
                res["load_error"] = f"{type(e).__name__}: {e}"
                res["trace"] = traceback.format_exc()[-2000:]

        import threading

        th = threading.Thread(target=loader)
        th.start()
        p = run_point(svc, wl, "dstack", scale=1.0, duration_s=duration * 2)
        th.join(300)
        res["point"] = point_json(p)
        res["totals"] = svc.stats()["totals"]
        res["no_failures"] = all(v["failed"] == 0 for v in res["point"]["models"].values())
        return res
    finally:
        svc.close(drain=True, timeout_s=10)


MIX6 = ["resnet50", "mobilenet_v2", "inception_v3", "efficientnet_b0", "vgg16", "bert_base"]
MIX6_SLO = {"resnet50": 25, "mobilenet_v2": 10, "inception_v3": 40, "efficientnet_b0": 20, "vgg16": 100,
            "bert_base": 60}
MIX6_RATE = {"resnet50": 800, "mobilenet_v2": 1600, "inception_v3": 400, "efficientnet_b0": 1200, "vgg16": 200,
             "bert_base": 300}


def _delta(after, before):
    """``after - before`` key by key for the numbers of a stats dict (nested dicts likewise; other
    values as they are after), or ``after`` itself where it is no dict."""
    if not isinstance(after, dict):
        return after
    before = before if isinstance(before, dict) else {}
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = _delta(v, b)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float)):
            out[k] = v - b
        else:
            out[k] = v
    return out


def check_overhead(duration, scale, outputs=("copies",)):
    """Dispatch overhead at batch 1 per policy, for each way of handing outputs back (``outputs``:
    "copies", the default, and/or "views": run 70 put views' overhead above copies' at batches up to 16)."""
    global RATE_SCALE_HINT
    from gpuloom.bench.e2e import run_point
    from gpuloom.bench.variants import parse_policy_spec

    RATE_SCALE_HINT = scale

    models = build(MIX6, max_batch=1)
    wl = workload(MIX6, MIX6_SLO, MIX6_RATE, duration)
    out = {}
    # dstack as it runs by default (lanes per plan) and on partitions, as the sixth session measured it;
    # named as gpuloom bench names its variants (copies, the default, unnamed)
    names = [base + ("" if mode == "copies" else f":outputs={mode}") for mode in outputs
             for base in ("dstack", "dstack:lanes=partitions", "triton")]
    for name in names:
        pol, opts, service_opts = parse_policy_spec(name)
        svc = service(pol, models, wl, policy_options=opts, **service_opts)
        try:
            # unmeasured first: a process's and a service's first second under load is slower (the
            # first policy of a bench loses to itself, runs 51-52), and views' buffers are made then
            run_point(svc, wl, name, scale=scale, duration_s=duration)
            be0 = svc.stats()["backend"]
            p = run_point(svc, wl, name, scale=scale, duration_s=duration)
            be = svc.stats()["backend"]
            out[name] = {"scale": scale, "point": point_json(p), "dispatch_overhead": p.dispatch_overhead,
                        "gpu_idle_ratio_with_work_queued": p.gpu_idle_ratio, "idle_ratio": p.idle_ratio,
                        "warmed_up_s": duration,  # the backend's figures below are the measured point's alone
                        **{k: be[k] - be0[k] for k in ("host_dispatch_ms", "device_ms", "batches")},
                        "target_overhead_met": p.dispatch_overhead < 0.05,
                        # host ms per launch phase (views: "alloc", their buffers), and the views' pool
                        "launch_ms": _delta(be.get("launch_ms"), be0.get("launch_ms")),
                        "views_buffers": _delta(be.get("views_buffers"), be0.get("views_buffers"))}
        finally:
            svc.close(drain=True, timeout_s=10)
        save()
    return out


def main() -> int:
    global OUT, DEV, RATE_SCALE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "docs/results"))
    ap.add_argument("--only", default="serve,disjoint,failure,memory,loadwhile,overhead")
    ap.add_argument("--quick", action="store_true", help="1.5 s points instead of 3 s")
    ap.add_argument("--overhead-scale", type=float, default=0.25, help="load factor of the mix6 overhead run")
    ap.add_argument("--overhead-outputs", default="copies",
                    help="comma-separated: copies and/or views, the outputs modes the overhead check runs (default copies)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny models on the CPU at 2%% of the rates: checks the script, measures nothing")
    a = ap.parse_args()
    modes = tuple(dict.fromkeys(m.strip() for m in a.overhead_outputs.split(",") if m.strip()))  # in order, once
    if not modes or not set(modes) <= {"copies", "views"}:
        ap.error(f"--overhead-outputs: expected copies and/or views, got {a.overhead_outputs!r}")
    prefer_all_connections()  # as gpuloom serve and bench do, before CUDA starts
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.cpu_dry_run:
        DEV, RATE_SCALE = "cpu", 0.02
        asked = [x for x in a.only.split(",") if x]
        kept = [x for x in asked if x in ("serve", "failure", "loadwhile")]
        if kept != asked:
            print(f"--cpu-dry-run runs only serve, failure and loadwhile; skipping "
                  f"{', '.join(x for x in asked if x not in kept)}", file=sys.stderr)
        a.only = ",".join(kept)
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("gpuloom.runtime.exec_backend").setLevel(logging.ERROR)  # injected failures are expected
    only = set(a.only.split(","))
    dur = 1.5 if a.quick else 3.0
    R["env"] = {"torch": torch.__version__, "argv": sys.argv[1:],
                "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu dry run"}
    save()
    light = None
    if only & {"serve", "disjoint", "failure", "memory", "loadwhile"}:
        t = time.perf_counter()
        light = build(LIGHT, max_batch=8)
        R["_seconds"] = {"compile_light": round(time.perf_counter() - t, 1)}
    if "serve" in only:
        step("serve", check_serve, light, dur)
    if "disjoint" in only:
        step("disjoint", check_disjoint, light, dur)
    if "failure" in only:
        step("failure", check_failure, light, dur)
    if "memory" in only:
        step("memory", check_memory, light)
    if "loadwhile" in only:
        step("loadwhile", check_load_while_serving, light, dur)
    if "overhead" in only:
        del light
        torch.cuda.empty_cache()
        step("overhead", check_overhead, dur, a.overhead_scale, modes)
    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    ok = all(not (isinstance(v, dict) and "error" in v) for k, v in R.items() if k in only)
    print("DONE", "ok" if ok else "with errors", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
