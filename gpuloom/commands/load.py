"""``gpuloom load``: open-loop load against a KServe v2 HTTP server; prints throughput, SLO attainment, latency.

Exit status: 0 when at least one request succeeded (some failures included), 1 when none did (none
sent, or every one failed; stderr says which) or the run could not start, 2 for bad arguments."""

from __future__ import annotations

import argparse
import math

from .argtypes import positive_number
from .output import finite_json

NAME = "load"
HELP = "drive a KServe v2 / Triton HTTP server open-loop (Poisson or constant rate); print throughput, SLO attainment, latency percentiles"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="server address, e.g. 127.0.0.1:8000 or http://host:8000")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--rate", type=positive_number("requests/s"), default=None,
                   help="offered load, requests/s (open loop; required unless --concurrency)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop instead: this many clients, each sending when its last request answered (saturation)")
    p.add_argument("--duration", type=positive_number("seconds"), default=10.0, help="seconds to send for (default 10)")
    arr = p.add_mutually_exclusive_group()
    arr.add_argument("--poisson", dest="poisson", action="store_true", default=True, help="Poisson arrivals (default)")
    arr.add_argument("--constant", dest="poisson", action="store_false", help="evenly spaced arrivals")
    p.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    p.add_argument("--json-tensors", action="store_true", help="send JSON tensors instead of binary tensor data")
    p.add_argument("--slo-ms", type=positive_number("ms"), default=None,
                   help="latency objective, ms (default: the model's, from its config on a gpuloom server; 100 "
                        "where the server does not say)")
    p.add_argument("--timeout", type=positive_number("seconds"), default=30.0,
                   help="client timeout per request, s (default 30; there is no \"no timeout\")")
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
    import sys

    from gpuloom.serve.loadgen import MAX_REQUESTS, run_closed, run_load

    if args.concurrency is not None:
        if args.deadline_ms is not None:
            print("error: --deadline-ms goes with --rate (open loop), not --concurrency", file=sys.stderr)
            return 2
        if args.concurrency < 1 or args.batch < 1:
            print(f"error: --concurrency and --batch must be >= 1 (found {args.concurrency}, {args.batch})",
                  file=sys.stderr)
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
        _report(res, args, f"model {res.model}: {args.concurrency} closed-loop clients for {args.duration:g} s, "
                           f"batch {args.batch}")
        return _exit_status(res, args)
    if args.rate is None:
        print("error: give --rate (open loop) or --concurrency (closed loop)", file=sys.stderr)
        return 2
    if args.batch < 1 or (args.deadline_ms is not None and not 0 < args.deadline_ms < math.inf):
        print(f"error: --deadline-ms must be a finite positive number of ms and --batch >= 1 (found "
              f"{args.deadline_ms}, {args.batch})", file=sys.stderr)
        return 2
    if args.rate * args.duration > MAX_REQUESTS:
        print(f"error: --rate {args.rate:g} for --duration {args.duration:g} s is {args.rate * args.duration:.3g} "
              f"requests; one run sends at most {MAX_REQUESTS:,} (it schedules every request up front, about 1 KB "
              f"of memory each): lower --rate or --duration", file=sys.stderr)
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
    head = (f"model {res.model}: asked {res.rate:g} req/s, sent {res.sent_rate:.1f} req/s for {args.duration:g} s "
            f"({'Poisson' if args.poisson else 'constant'}), batch {args.batch}")
    if args.deadline_ms is not None:
        head += f"\n  every request due within {args.deadline_ms:g} ms (its timeout parameter; 504: not met)"
    _report(res, args, head)
    return _exit_status(res, args)


def _report(res, args: argparse.Namespace, head: str) -> None:
    """The run's account on stdout: one JSON object with ``--json`` (null where there is no value),
    else ``head`` and the report's lines ("-" where there is no value)."""
    if args.json:
        print(finite_json(res.as_dict()))
        return
    print(head)
    print(f"  sent {res.sent}, ok {res.ok}, errors {res.errors or 'none'}")
    if res.first_error:  # why a run's requests failed
        print(f"  first error    {res.first_error}")
    print(f"  throughput     {res.throughput:.1f} req/s")
    attained = "-" if res.slo_attainment is None else f"{res.slo_attainment * 100:.1f}%"
    print(f"  SLO attainment {attained} within {res.slo_ms:g} ms")
    print(f"  latency ms     p50 {_ms(res.p50_ms)}  p90 {_ms(res.p90_ms)}  p99 {_ms(res.p99_ms)}  "
          f"mean {_ms(res.mean_ms)}")
    for k, v in res.server_timing_ms.items():  # the server's own Server-Timing, when it sends one
        print(f"  server {k:<7} p50 {v['p50']:.2f}  p99 {v['p99']:.2f}  mean {v['mean']:.2f}")


def _exit_status(res, args: argparse.Namespace) -> int:
    """0 when at least one request succeeded; 1, saying why on stderr, when none did."""
    import sys

    if res.ok:
        return 0
    if not res.sent:
        why = f"no request was sent in {args.duration:g} s"
        if args.concurrency is None:
            why += f" at {args.rate:g} req/s (its arrivals drew no send time): raise --rate or --duration"
    else:
        why = (f"none of the {res.sent} requests sent succeeded (errors {res.errors}); the first was told: "
               f"{res.first_error}")
    print(f"error: {why}", file=sys.stderr)
    return 1


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
