#!/usr/bin/env python
"""How fast can bert_base's float32 GEMMs run on the H200, and with which kernels?

Why: bert_base at float32 batch 1 is the engine's weakest row (1.16x over eager, 2.29 ms, at the
critical path of its kernels' durations), and the one that keeps the fp32 b1 geomean at 6.84x
against the target of 7x. Its 12 layers do about 22 GFLOP in 2.29 ms, ~10 TFLOPS, while the H200
does ~60 TFLOPS of float32 (no TF32: outputs must equal eager's). With 128 tokens a GEMM's output
is 128 rows: cuBLAS's tiles cover few of the 132 SMs. This measures, per GEMM shape of a layer
(``F.linear``, bias included):

* ``cublas``: PyTorch's default;
* ``cublaslt``: ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
* ``splitk{s}``: the reduction split in ``s`` parts as one batched GEMM (``torch.baddbmm`` over
  ``s`` slices of K, s times the tiles), then summed (``sum(0)`` + bias);
* ``cols{s}``: the output's columns in ``s`` GEMMs on ``s`` streams (fork / join by events).

Each variant is timed as a CUDA graph of ``--reps`` calls, replayed ``--iters`` times (CUDA events,
median per call). Error: max |variant - float64| / max |float64| beside cuBLAS's own. Then the whole
model (bert_base, eager forward in one CUDA graph) with cublas and with cublaslt, A B B A. One JSON
line per row. Needs a GPU::

    PYTHONPATH=. python3 scripts/diag_fp32_gemm.py --tokens 128,1024

``--dtype float16`` times the same GEMMs in half precision, where a split's partial sums would be
rounded to half before their sum: ``splitk{s}`` does so, ``splitk{s}_f32`` keeps them in float32
(``aten.bmm.dtype``, where this torch has it), sums and adds the bias in float32 and rounds once::

    PYTHONPATH=. python3 scripts/diag_fp32_gemm.py --dtype float16 --tokens 128,1024 --no-model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qkv": (768, 2304), "out": (768, 768), "ffn1": (768, 3072), "ffn2": (3072, 768)}


def timed_graph(fn, reps: int, iters: int) -> float:
    """Median ms per call of ``fn`` over ``iters`` replays of a graph of ``reps`` calls."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    from gpuloom.engine.capture import time_replays

    return time_replays(g, torch.cuda.current_stream(), warmup=5, iters=iters) / reps


def variants(x, w, bias, streams):
    """name -> zero-argument function returning the output."""
    import torch
    import torch.nn.functional as F

    n, k = x.shape[0], x.shape[1]
    out = {"cublas": lambda: F.linear(x, w, bias)}
    for s in (2, 3, 4, 6, 8):
        if k % s:
            continue
        xs = x.view(n, s, k // s).transpose(0, 1)  # (s, n, k/s)
        ws = w.t().reshape(s, k // s, w.shape[0])  # (s, k/s, out): contiguous slices of K
        ws = ws.contiguous()

        def splitk(xs=xs, ws=ws):
            return torch.bmm(xs, ws).sum(0) + bias

        out[f"splitk{s}"] = splitk
        if x.dtype != torch.float32 and hasattr(torch.ops.aten.bmm, "dtype"):
            def splitk_f32(xs=xs, ws=ws):
                return torch.ops.aten.bmm.dtype(xs, ws, torch.float32).sum(0).add_(bias).to(x.dtype)

            out[f"splitk{s}_f32"] = splitk_f32
    for s in (2, 4):
        cols = w.shape[0] // s
        ws_ = [w[i * cols:(i + 1) * cols] for i in range(s)]
        bs_ = [bias[i * cols:(i + 1) * cols] for i in range(s)]
        res = torch.empty(n, w.shape[0], device=x.device, dtype=x.dtype)

        def colsplit(ws_=ws_, bs_=bs_, res=res, s=s, cols=cols):
            main = torch.cuda.current_stream()
            fork = torch.cuda.Event()
            fork.record(main)
            joins = []
            for i in range(s):
                st = streams[i]
                st.wait_event(fork)
                with torch.cuda.stream(st):
                    torch.addmm(bs_[i], x, ws_[i].t(), out=res[:, i * cols:(i + 1) * cols])
                    e = torch.cuda.Event()
                    e.record(st)
                    joins.append(e)
            for e in joins:
                main.wait_event(e)
            return res

        out[f"cols{s}"] = colsplit
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,1024", help="rows of each GEMM (batch x 128 tokens)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--model-iters", type=int, default=200)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = ap.parse_args(argv)

    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda")
    streams = [torch.cuda.Stream() for _ in range(8)]
    tflops = lambda n, k, m, ms: 2 * n * k * m / ms / 1e9  # noqa: E731
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, (k, m) in SHAPES.items():
            dt = getattr(torch, args.dtype)
            x = torch.randn(tokens, k, device=dev).to(dt)
            w = (torch.randn(m, k, device=dev) / k ** 0.5).to(dt)
            bias = torch.randn(m, device=dev).to(dt)
            ref = (x.double() @ w.double().t() + bias.double())
            scale = ref.abs().max().item()
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for vname, fn in variants(x, w, bias, streams).items():
                    if lib == "cublaslt" and vname != "cublas":
                        continue  # the other variants' GEMMs with cuBLASLt: only the plain one
                    err = (fn().double() - ref).abs().max().item() / scale
                    ms = timed_graph(fn, args.reps, args.iters)
                    row = {"dtype": args.dtype, "tokens": tokens, "gemm": name, "k": k, "n_out": m,
                           "variant": "cublaslt" if lib == "cublaslt" else vname, "ms": round(ms, 5),
                           "tflops": round(tflops(tokens, k, m, ms), 2), "rel_err": err}
                    print(json.dumps(row), flush=True)
            torch.backends.cuda.preferred_blas_library("cublas")
    if args.no_model:
        return 0
    from scripts.bench_engine import bert_base

    for tokens in (int(t) for t in args.tokens.split(",")):
        model = bert_base().to(dev).eval()
        x = torch.randn(tokens // 128, 128, 768, device=dev)
        for rnd, lib in enumerate(("cublas", "cublaslt", "cublaslt", "cublas")):
            torch.backends.cuda.preferred_blas_library(lib)
            with torch.no_grad():
                ms = timed_graph(lambda: model(x), 1, args.model_iters)
            print(json.dumps({"model": "bert_base", "batch": tokens // 128, "blas": lib, "round": rnd,
                              "ms": round(ms, 4)}), flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
