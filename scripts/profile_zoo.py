"""Profile the model zoo on the GPU, then (on any machine) build the shipped profiles and knee table.

On the GPU (writes one run JSON + PNG per model under WORK/zoo, tarred into OUT/zoo.tar.gz):

    PYTHONPATH=. python3 scripts/profile_zoo.py run --out $OUT [--runner auto] [--budget-s 420]

Anywhere (reads the run JSONs; picks the knee aggregation with the smallest median |error|; writes
gpuloom/profiles/h200/*.json, docs/results/profile_knees.json and docs/results/knee_<model>.png):

    python3 scripts/profile_zoo.py analyze DIR_WITH_RUN_JSONS

Zoo: resnet50, resnet101, inception_v3 (299x299), googlenet, mobilenet_v2, efficientnet_b0,
densenet121, vgg16 (torchvision, random weights) and bert_base (nn.TransformerEncoder, 12 layers,
d=768, 12 heads, ff=3072, GELU, sequence 128, batch-first), float32 (torch defaults: TF32 off for
matmuls, cuDNN convolutions may use TF32), batches 1..64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ZOO = ["resnet50", "mobilenet_v2", "efficientnet_b0", "bert_base", "googlenet", "inception_v3",
       "resnet101", "densenet121", "vgg16"]
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from gpuloom.profile.profiler import load_model, profile_model, write_outputs

    out = os.path.join(args.work, "zoo")  # many files: only the tarball goes to --out
    os.makedirs(out, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    summary = []
    models = args.models or ZOO
    for i, name in enumerate(models):
        left = args.budget_s - (time.perf_counter() - t_start)
        per_model = left / max(1, len(models) - i)
        batches = BATCHES if per_model > args.min_full_s else BATCHES[:-1]
        t0 = time.perf_counter()
        name, _, runner = name.partition("@")  # "inception_v3@auto": a runner for this model only
        try:
            spec = load_model(name)
            run = profile_model(spec, batches=batches, runner=runner or args.runner, progress=True)
            write_outputs(run, out)
            ks = run.knee_rows()
            summary.append((name, run.runner, round(run.setup_seconds, 1), round(run.seconds, 1),
                            [r["knee_measured"] for r in ks], [r["knee_predicted"] for r in ks]))
        except Exception as e:  # noqa: BLE001 - keep profiling the rest; the error is reported
            traceback.print_exc()
            summary.append((name, "FAILED", f"{type(e).__name__}: {str(e)[:200]}"))
        print(f"== {name}: {time.perf_counter() - t0:.1f}s total; batches {batches}", flush=True)
        for v in ("spec", "run"):
            locals().pop(v, None)
        torch.cuda.empty_cache()
        subprocess.run(["tar", "czf", os.path.join(args.out, args.tar_name), "-C", args.work, "zoo"], check=False)
    print("\nmodel | runner | setup s | sweep s | measured knees | predicted knees")
    for row in summary:
        print(" | ".join(str(x) for x in row))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from gpuloom.profile.knee import KernelRecord, OccupancyLimits, predict_variant
    from gpuloom.profile.knee import variants as knee_variants
    from gpuloom.profile.profiler import plot_profile
    from gpuloom.profile.store import Profile, ProfileStore

    runs = {}
    for fn in sorted(os.listdir(args.dir)):
        if fn.endswith(".json"):
            with open(os.path.join(args.dir, fn)) as f:
                d = json.load(f)
            if "profile" in d:
                runs[d["profile"]["model"]] = d
    lim = OccupancyLimits()
    variants = knee_variants()
    table, errs = [], {v: [] for v in variants}
    per_model_err = {v: {} for v in variants}
    for name, d in runs.items():
        p = Profile.from_json(d["profile"])
        for b in p.batches:
            recs = [KernelRecord(k[0], k[1], tuple(k[2]), tuple(k[3]), k[4], k[5]) for k in d["kernels"][str(b)]]
            km = p.knee(b, args.eps)
            row = {"model": name, "batch": b, "knee_measured": km, "runner": d.get("runner"),
                   "latency_knee_ms": round(p.latency(b, km), 4), "latency_full_ms": round(p.full_latency(b), 4),
                   "latency_8_ms": round(p.latency(b, p.sms[0]), 4), "predicted": {}}
            gap_us = max(0.0, p.full_latency(b) * 1000.0 - sum(r.duration_us for r in recs))
            row["gap_us"] = round(gap_us, 1)
            for v in variants:
                k = predict_variant(v, recs, p.sms, full_latency_us=p.full_latency(b) * 1000.0, eps=args.eps, lim=lim)
                row["predicted"][v] = k
                errs[v].append(abs(k - km))
                per_model_err[v].setdefault(name, []).append(abs(k - km))
            table.append(row)
    score = {v: {"median_abs_err_sms": statistics.median(e), "mean_abs_err_sms": round(statistics.fmean(e), 2),
                 "max_abs_err_sms": max(e)} for v, e in errs.items() if e}
    # leave-one-model-out choice, so the reported error is not fitted to the model it is measured on
    loo = []
    for name in runs:
        best = min(variants, key=lambda v: statistics.median(
            [x for m, xs in per_model_err[v].items() if m != name for x in xs]) if len(runs) > 1 else 0)
        loo.extend(per_model_err[best][name])
    chosen = args.method or min(score, key=lambda v: (score[v]["median_abs_err_sms"], score[v]["mean_abs_err_sms"]))
    store = ProfileStore(args.store)
    os.makedirs(args.results, exist_ok=True)
    for name, d in runs.items():
        p = Profile.from_json(d["profile"])
        pk = {r["batch"]: r["predicted"][chosen] for r in table if r["model"] == name}
        p2 = Profile(model=p.model, input_shapes=p.input_shapes, dtype=p.dtype, gpu=p.gpu, batches=p.batches,
                     sms=p.sms, latency_ms=p.latency_ms, date=p.date, source=p.source, predicted_knee=pk)
        store.put(p2)
        plot_profile(p2, os.path.join(args.results, f"knee_{name}.png"), args.eps)
    for r in table:
        r["knee_predicted"] = r["predicted"][chosen]

    def _err(rows, f):
        e = [abs(f(r) - r["knee_measured"]) for r in rows]
        return {"median_abs_err_sms": statistics.median(e), "mean_abs_err_sms": round(statistics.fmean(e), 2)} if e else {}

    small, large = [r for r in table if r["batch"] <= 4], [r for r in table if r["batch"] >= 8]
    chosen_by_batch = {"batch<=4": _err(small, lambda r: r["knee_predicted"]),
                       "batch>=8": _err(large, lambda r: r["knee_predicted"])}
    # how much a predictor that ignores the model would score: the honest yardstick
    baselines = {f"constant_{c}": {"all": _err(table, lambda r, c=c: c), "batch<=4": _err(small, lambda r, c=c: c),
                                   "batch>=8": _err(large, lambda r, c=c: c)} for c in (112, 120, 132)}
    out = {
        "what": "knee per model and batch on the H200: measured (fewest SMs within (1+eps) of the whole GPU) "
                "and predicted from kernel launch shapes (gpuloom.profile.knee)",
        "command": "PYTHONPATH=. python3 scripts/profile_zoo.py run --out $OUT --models NAME@RUNNER ... (GPU); "
                   "tar xzf docs/results/profile_runs.tar.gz -C /tmp && "
                   "python3 scripts/profile_zoo.py analyze /tmp/runs (anywhere)",
        "eps": args.eps, "chosen_method": chosen, "scores": score,
        "leave_one_model_out_median_abs_err_sms": statistics.median(loo) if loo else None,
        "chosen_by_batch": chosen_by_batch,
        "baselines": baselines,
        "gpu": runs[next(iter(runs))]["profile"]["gpu"] if runs else None,
        "runners": {n: d.get("runner") for n, d in runs.items()},
        "sweep_seconds": {n: d.get("sweep_seconds") for n, d in runs.items()},
        "setup_seconds": {n: d.get("setup_seconds") for n, d in runs.items()},
        "table": table,
    }
    with open(os.path.join(args.results, "profile_knees.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"chosen: {chosen}; scores: {json.dumps(score)}; LOMO median: {out['leave_one_model_out_median_abs_err_sms']}")
    print("model | batch | knee measured | knee predicted | latency at knee | latency full")
    for r in table:
        print(f"{r['model']} | {r['batch']} | {r['knee_measured']} | {r['knee_predicted']} | "
              f"{r['latency_knee_ms']:.3f} | {r['latency_full_ms']:.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="out", help="where zoo.tar.gz goes")
    r.add_argument("--tar-name", default="zoo.tar.gz")
    r.add_argument("--work", default="/tmp/gpuloom_zoo", help="where the per-model JSON and PNG files go")
    r.add_argument("--runner", default="auto", choices=("auto", "engine", "graph"))
    r.add_argument("--budget-s", type=float, default=420.0, help="drop batch 64 when the time left per model is short")
    r.add_argument("--min-full-s", type=float, default=35.0, help="seconds per model below which batch 64 is dropped")
    r.add_argument("--models", nargs="*", default=None, help="names, optionally NAME@RUNNER (engine/graph/auto)")
    a = sub.add_parser("analyze")
    a.add_argument("dir")
    a.add_argument("--eps", type=float, default=0.1)
    a.add_argument("--method", default=None, help="force an aggregation instead of the best-scoring one")
    a.add_argument("--store", default="gpuloom/profiles/h200")
    a.add_argument("--results", default="docs/results")
    args = ap.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_analyze(args)


if __name__ == "__main__":
    sys.exit(main())
