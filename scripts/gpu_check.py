"""First look at the GPU: green-context API, partitions (cost, confinement, disjointness), Kineto
kernel fields, the engine, a quick profile, MPS. Writes $OUT/gpu_check.json; prints a summary.

    PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from gpuloom.gpu.timing import replay_alone_and_together, wall_ms_across

R: dict = {}


def step(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            R[name] = fn()
        except Exception as e:  # noqa: BLE001 - record and continue to the next check
            R[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        R.setdefault("_seconds", {})[name] = round(time.perf_counter() - t, 2)
        print(f"[{name}] {time.perf_counter() - t:.1f}s {str(R[name])[:600]}", flush=True)
        return fn
    return deco


def wall(fn, streams, reps=5):
    return wall_ms_across(fn, streams, reps=reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick-model", default="resnet50")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from gpuloom.gpu import Partitioner, device_facts

    @step("facts")
    def _():
        import cuda.bindings
        from cuda.bindings import driver as cu
        f = device_facts()
        err, res = cu.cuDeviceGetDevResource(0, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        sm = res.sm
        p = torch.cuda.get_device_properties(0)
        props = {k: getattr(p, k) for k in dir(p) if not k.startswith("_") and isinstance(getattr(p, k), (int, str, float))}
        return {"facts": f.__dict__, "bindings": getattr(cuda.bindings, "__version__", "?"),
                "sm_resource": {k: int(getattr(sm, k)) for k in ("smCount", "minSmPartitionSize", "smCoscheduledAlignment", "flags") if hasattr(sm, k)},
                "props": props}

    @step("layouts")
    def _():
        out = {}
        for sizes in ([40, 16, 24, 48], [64, 68], [132], [8] * 16, [128, 4]):
            try:
                with Partitioner(sizes, mode="green") as ps:
                    out[str(sizes)] = [p.sms for p in ps]
            except Exception as e:  # noqa: BLE001
                out[str(sizes)] = f"{type(e).__name__}: {e}"
        for bad in ([136], [12], [72, 72]):
            try:
                Partitioner(bad, mode="green")
                out[str(bad)] = "NO ERROR"
            except Exception as e:  # noqa: BLE001
                out[str(bad)] = f"{type(e).__name__}: {e}"
        return out

    @step("carve_cost_ms")
    def _():
        ts = {}
        for s in device_facts().grid():
            t = time.perf_counter()
            with Partitioner([s], mode="green") as ps:
                assert ps[0].sms == s, (s, ps[0].sms)
                ps[0].new_stream()
            ts[s] = round((time.perf_counter() - t) * 1000, 2)
        return ts

    N = 8192
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)

    @step("confinement_ms")
    def _():
        out = {}
        for s in (16, 32, 72, 132):
            with Partitioner([s], mode="green") as ps:
                p = ps[0]
                g = p.capture_graph(lambda: torch.matmul(a, b, out=c))
                with p.use():
                    out[s] = round(wall(g.replay, [p.stream]), 3)
                del g
        # negative control: captured on a normal stream, replayed on a 16-SM partition stream
        s0 = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s0):
            torch.matmul(a, b, out=c)
        with torch.cuda.graph(g, stream=s0):
            torch.matmul(a, b, out=c)
        with Partitioner([16], mode="green") as ps:
            with ps[0].use():
                out["normal_capture_replayed_on_16"] = round(wall(g.replay, [ps[0].stream]), 3)
        out["ratios"] = {k: round(out[k] / out[132], 2) for k in (16, 32, 72)}
        return out

    @step("disjointness_ms")
    def _():
        with Partitioner([64, 64], mode="green") as ps:
            ga = ps[0].capture_graph(lambda: torch.matmul(a, b, out=c))
            gb = ps[1].capture_graph(lambda: torch.matmul(b, a, out=d))
            sa, sb = ps[0].stream, ps[1].stream

            t1, _, t2 = replay_alone_and_together(ga, sa, gb, sb)
        out = {"alone": round(t1, 3), "both": round(t2, 3), "ratio": round(t2 / t1, 3)}
        try:  # control: torch's GreenContext.create twice -> overlapping SMs
            from torch.cuda.green_contexts import GreenContext
            g1, g2 = GreenContext.create(64, 0), GreenContext.create(64, 0)
            s1, s2 = g1.Stream(), g2.Stream()
            x1, x2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            for gg, ss, o in ((x1, s1, c), (x2, s2, d)):
                with torch.cuda.stream(ss):
                    torch.matmul(a, b, out=o)
                with torch.cuda.graph(gg, stream=ss):
                    torch.matmul(a, b, out=o)

            def both2():
                with torch.cuda.stream(s1):
                    x1.replay()
                with torch.cuda.stream(s2):
                    x2.replay()
            def alone2():
                with torch.cuda.stream(s1):
                    x1.replay()
            u1, u2 = wall(alone2, [s1]), wall(both2, [s1, s2])
            out["torch_greencontext_control"] = {"alone": round(u1, 3), "both": round(u2, 3), "ratio": round(u2 / u1, 3)}
        except Exception as e:  # noqa: BLE001
            out["torch_greencontext_control"] = f"{type(e).__name__}: {e}"
        return out

    @step("kineto_fields")
    def _():
        from torch.profiler import ProfilerActivity, profile
        import torchvision
        m = torchvision.models.resnet50().cuda().eval()
        x = torch.randn(8, 3, 224, 224, device="cuda")
        with torch.no_grad():
            m(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                m(x)
                torch.cuda.synchronize()
        path = "/tmp/trace_eager.json"
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        res = {"eager_kernels": len(ev), "arg_keys": sorted(ev[0].get("args", {}).keys()) if ev else [],
               "example": ev[len(ev) // 2] if ev else None}
        # graph replay: are kernels inside graphs traced, with grid?
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.no_grad(), torch.cuda.stream(s):
            m(x)
            with torch.cuda.graph(g, stream=s):
                m(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof2:
            g.replay()
            torch.cuda.synchronize()
        prof2.export_chrome_trace("/tmp/trace_graph.json")
        ev2 = [e for e in json.load(open("/tmp/trace_graph.json"))["traceEvents"] if e.get("cat") == "kernel"]
        res["graph_kernels"] = len(ev2)
        res["graph_arg_keys"] = sorted(ev2[0].get("args", {}).keys()) if ev2 else []
        return res

    @step("engine")
    def _():
        from gpuloom.profile.profiler import EngineRunner, load_model
        spec = load_model("googlenet")
        t = time.perf_counter()
        r = EngineRunner(spec, (1, 8))
        t_compile = time.perf_counter() - t
        with Partitioner([32], mode="green") as ps:
            cap = r.capture(ps[0])
            from gpuloom.profile.profiler import time_replays
            ms = {bb: time_replays(lambda: cap.replay(bb), cap.stream)[0] for bb in (1, 8)}
            cap.close()
        return {"compile_s": round(t_compile, 2), "choice": r.choice, "ms_on_32": ms,
                "streams": getattr(r.cm.plan, "num_streams", None)}

    @step("quick_profile")
    def _():
        from gpuloom.profile.profiler import load_model, profile_model, write_outputs
        spec = load_model(args.quick_model)
        run = profile_model(spec, batches=(1, 2, 4, 8, 16, 32, 64), runner="graph", progress=True)
        paths = write_outputs(run, args.out)
        return {"sweep_s": round(run.seconds, 1), "setup_s": round(run.setup_seconds, 1),
                "knees": run.knee_rows(), "predicted": run.predicted, "paths": paths}

    @step("mps")
    def _():
        code = ("import torch,time,statistics;N=8192;a=torch.randn(N,N,device='cuda',dtype=torch.bfloat16);"
                "c=torch.empty_like(a);torch.matmul(a,a,out=c);torch.cuda.synchronize();t=[]\n"
                "for i in range(6):\n s=time.perf_counter();torch.matmul(a,a,out=c);torch.cuda.synchronize();t.append(time.perf_counter()-s)\n"
                "print(statistics.median(t[1:])*1000)")
        from gpuloom.gpu.mps import MpsDaemon
        out = {}
        with MpsDaemon() as dmn:
            for pct_sms in (33, 132):
                env = dmn.client_env(pct_sms, 132)
                r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
                out[pct_sms] = r.stdout.strip() or r.stderr[-400:]
        return out

    json.dump(R, open(os.path.join(args.out, "gpu_check.json"), "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
