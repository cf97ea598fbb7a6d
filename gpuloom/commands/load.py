"""``gpuloom load``: open-loop load against a KServe v2 HTTP server; prints throughput, SLO attainment, latency."""

from __future__ import annotations

import argparse

from .argtypes import positive_number

NAME = "load"
HELP = "drive a KServe v2 / Triton HTTP server open-loop (Poisson or constant rate); print throughput, SLO attainment, latency percentiles"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="server address, e.g. 127.0.0.1:8000 or http://host:8000")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--rate", type=float, default=None, help="offered load, requests/s (open loop; required unless --concurrency)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop instead: this many clients, each sending when its last request answered (saturation)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds to send for (default 10)")
    arr = p.add_mutually_exclusive_group()
    arr.add_argument("--poisson", dest="poisson", action="store_true", default=True, help="Poisson arrivals (default)")
    arr.add_argument("--constant", dest="poisson", action="store_false", help="evenly spaced arrivals")
    p.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    p.add_argument("--json-tensors", action="store_true", help="send JSON tensors instead of binary tensor data")
    p.add_argument("--slo-ms", type=positive_number("ms"), default=None,
                   help="latency objective, ms (default: the model's, from its config on a gpuloom server; 100 "
                        "where the server does not say)")
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request, s (default 30)")
    p.add_argument("--deadline-ms", type=float, default=None, metavar="MS",
                   help="every request's own deadline, sent as Triton's timeout parameter (open loop; the server "
                        "answers 504 where it cannot meet it; also the SLO unless --slo-ms; default: the model's SLO)")
    p.add_argument("--seed", type=int, default=0)
    # loadgen.CLIENTS, spelled out: importing loadgen here would import numpy for every command's
    # --help (tests/test_load_client.py keeps the two equal)
    p.add_argument("--client", choices=("aiohttp", "lean"), default="aiohttp",
                   help="HTTP client: aiohttp (default), or lean (plain http:// only; about half the CPU per "
                        "large request, for a load generator on the same host as the server)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from gpuloom.serve.loadgen import run_closed, run_load

    if args.concurrency is not None:
        if args.deadline_ms is not None:
            print("error: --deadline-ms goes with --rate (open loop), not --concurrency", file=sys.stderr)
            return 2
        if args.concurrency < 1 or args.duration <= 0 or args.batch < 1:
            print(f"error: --concurrency and --batch must be >= 1 and --duration positive (found {args.concurrency}, "
                  f"{args.batch}, {args.duration})", file=sys.stderr)
            return 2
        try:
            res = run_closed(args.url, args.model, concurrency=args.concurrency, duration_s=args.duration,
                             binary=not args.json_tensors, slo_ms=args.slo_ms, timeout_s=args.timeout, seed=args.seed,
                             client=args.client, batch=args.batch)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except Exception as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(res.as_dict()))
        else:
            print(f"model {res.model}: {args.concurrency} closed-loop clients for {args.duration:g} s, "
                  f"batch {args.batch}")
            _report_counts(res)
            print(f"  throughput     {res.throughput:.1f} req/s")
            print(f"  SLO attainment {res.slo_attainment * 100:.1f}% within {res.slo_ms:g} ms")
            print(f"  latency ms     p50 {res.p50_ms:.2f}  p90 {res.p90_ms:.2f}  p99 {res.p99_ms:.2f}  mean {res.mean_ms:.2f}")
        return 0
    if args.rate is None:
        print("error: give --rate (open loop) or --concurrency (closed loop)", file=sys.stderr)
        return 2
    if args.rate <= 0 or args.duration <= 0 or args.batch < 1 or (args.deadline_ms is not None and not args.deadline_ms > 0):
        print(f"error: --rate, --duration and --deadline-ms must be positive and --batch >= 1 (found {args.rate}, "
              f"{args.duration}, {args.deadline_ms}, {args.batch})", file=sys.stderr)
        return 2
    try:
        res = run_load(args.url, args.model, rate=args.rate, duration_s=args.duration, poisson=args.poisson,
                       batch=args.batch, binary=not args.json_tensors, slo_ms=args.slo_ms, timeout_s=args.timeout, seed=args.seed,
                       client=args.client, deadline_ms=args.deadline_ms)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # aiohttp connection errors
        print(f"error: cannot reach {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res.as_dict()))
        return 0
    print(f"model {res.model}: offered {args.rate:g} req/s for {args.duration:g} s ({'Poisson' if args.poisson else 'constant'}), batch {args.batch}")
    if args.deadline_ms is not None:
        print(f"  every request due within {args.deadline_ms:g} ms (its timeout parameter; 504: not met)")
    _report_counts(res)
    print(f"  throughput     {res.throughput:.1f} req/s")
    print(f"  SLO attainment {res.slo_attainment * 100:.1f}% within {res.slo_ms:g} ms")
    print(f"  latency ms     p50 {res.p50_ms:.2f}  p90 {res.p90_ms:.2f}  p99 {res.p99_ms:.2f}  mean {res.mean_ms:.2f}")
    for k, v in res.server_timing_ms.items():  # the server's own Server-Timing, when it sends one
        print(f"  server {k:<7} p50 {v['p50']:.2f}  p99 {v['p99']:.2f}  mean {v['mean']:.2f}")
    return 0


def _report_counts(res) -> None:
    """The sent / ok / errors line, and what the first failure was told (why a run's requests failed)."""
    print(f"  sent {res.sent}, ok {res.ok}, errors {res.errors or 'none'}")
    if res.first_error:
        print(f"  first error    {res.first_error}")
