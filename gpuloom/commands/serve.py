"""``gpuloom serve``: serve a model repository over KServe v2 / Triton HTTP and gRPC."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .argtypes import nonnegative_number, positive_number

NAME = "serve"
HELP = "serve a model repository (directory or YAML) over KServe v2 / Triton-compatible HTTP and gRPC"


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (70000 was taken as 4464, the kernel's 16 bits)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number 0-65535, found {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), found {port}")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    # (the package alone: no aiohttp at parse time)
    from ..serve import AUTO_HOST_MAX_BATCH_MS, DEFAULT_CLIENT_TIMEOUT_S, RUNTIME_ON

    p.add_argument("repository", help="model repository: a directory of model YAML files or one YAML file (format: "
                        "docs/model-repository.md; examples: examples/repository)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=port_number, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    p.add_argument("--grpc-port", type=port_number, default=8001, help="gRPC port (default 8001; 0 picks a free one)")
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument("--policy", default="dstack",
                   help="scheduling policy by name (default dstack), with its options as in gpuloom bench: "
                        "NAME:KEY=VALUE[:...], e.g. dstack:min_sms=0 or dstack:slowdowns=bench.json")
    p.add_argument("--profiles", type=profiles_dir_arg, default=None, metavar="DIR",
                   help="an existing directory of latency profiles by model name (default: the shipped H200 ones on "
                        "CUDA); a model with none is profiled on the GPU at load, see --profile-missing")
    p.add_argument("--profile-missing", choices=("measure", "crude"), default="measure",
                   help="a model without a profile, on CUDA: measure its latency on the SM grid at load, once "
                        "(seconds to a minute; kept in --profile-cache), or time it crudely at batch 1 and max "
                        "batch on the whole GPU (default measure; CPU always times it crudely)")
    p.add_argument("--profile-cache", default="default", metavar="DIR",
                   help="where profiles measured at load are kept, per GPU and model fingerprint "
                        "(default ~/.cache/gpuloom/profiles or $GPULOOM_PROFILE_CACHE; 'none', '0' or 'off': keep none)")
    p.add_argument("--graph-cache", default=None, metavar="DIR",
                   help="where each compile's functional export graph is kept, filed under a hash of the graph "
                        "traced from the model's code (default ~/.cache/gpuloom/graphs or $GPULOOM_GRAPH_CACHE; "
                        "'none': keep none)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--queue-limit", type=int, default=1024, help="queued requests before 429 (default 1024)")
    p.add_argument("--max-body-mb", type=positive_number("MiB"), default=64.0, help="largest request body, MiB (default 64)")
    p.add_argument("--max-bodies-mb", type=positive_number("MiB"), default=1024.0,
                   help="infer request bodies received or handled at once, MiB, per HTTP process (default 1024): "
                        "a request past it is answered 429 with Retry-After before its body is read, so a burst of "
                        "large requests cannot grow memory without bound")
    p.add_argument("--drain-timeout", type=nonnegative_number("seconds to drain (0: stop without draining)"), default=30.0,
                   help="seconds to drain queued requests on SIGTERM (default 30; 0: stop without waiting)")
    p.add_argument("--unload-collect-mib", type=float, default=256.0, metavar="MIB",
                   help="an unloaded model whose weights and graphs take at least this many MiB is freed at once: "
                        "one full garbage collection, a pause of the models still served (0.15-0.35 s), gives its "
                        "memory back now instead of at the next full collection, which can be hours away "
                        "(default 256; smaller unloaded models add up to it; 0: every unload; inf: none)")
    p.add_argument("--client-timeout", type=client_timeout_arg, default=DEFAULT_CLIENT_TIMEOUT_S, metavar="S",
                   help=f"close an HTTP connection whose client keeps the server waiting this long: no request "
                        f"headers since it connected, a body still arriving, or idle after an answer (default "
                        f"{DEFAULT_CLIENT_TIMEOUT_S:g}); a request being computed is never cut")
    p.add_argument("--models", type=model_names_arg, default=None,
                   help="comma-separated subset of the repository to load at start, each named once")
    p.add_argument("--http-workers", type=http_workers_arg, default=None, metavar="N|auto",
                   help="HTTP front-end processes that parse requests outside the runtime's process and share "
                        "the port; 0: this process parses them; auto (default): half the CPUs, at most 8, on a host "
                        "with 8 or more CPUs, else 0 (always 0 with --runtime-on http)")
    p.add_argument("--early-answer", action="store_true",
                   help="answer each request from its batch's completion thread, before the runtime's thread has "
                        "booked it (one thread hand-off less per answer)")
    p.add_argument("--torch-launch", action="store_true",
                   help="launch batches through torch calls instead of raw CUDA driver calls (slower on the host; "
                        "for comparison or if a driver call misbehaves)")
    p.add_argument("--outputs", choices=("copies", "views"), default="copies",
                   help="how a request gets its outputs from the GPU's page-locked buffers: copies (default) or "
                        "views of them, held until the response is written (no host copy per batch; on the H200 "
                        "+0.00-0.12 SLO attainment on mix6 and +14%% goodput on the overloaded mix in-process, "
                        "no gain measured over HTTP; needs raw launches, so not with --torch-launch)")
    from ..gpu.partition import WORKQUEUES  # no torch: imported only when a partition is made

    p.add_argument("--workqueues", choices=WORKQUEUES, default="shared",
                   help="hardware workqueues of the SM partitions: shared (default: the device's, which "
                        "CUDA_DEVICE_MAX_CONNECTIONS sizes; gpuloom sets it to 32, the most, when unset) or balanced (each partition its own, where the driver "
                        "can: CUDA 13.1+; experimental)")
    p.add_argument("--complete-on", choices=("watcher", "loop"), default="watcher",
                   help="who learns that a GPU batch is done: watcher (default: a thread per partition sleeps on "
                        "the batch and wakes the runtime's thread) or loop (the GPU wakes the runtime's thread "
                        "itself; needs raw launches)")
    p.add_argument("--launch-on", choices=("auto", "loop", "lane", "inline"), default="auto",
                   help="which thread runs a batch: loop (the runtime's thread launches it, a watcher thread "
                        "waits for it), lane (the watcher launches it too), inline (the runtime's thread launches "
                        "and waits for it: no thread hand-off per batch), auto (default: inline on --device cpu, "
                        "loop on a GPU)")
    p.add_argument("--runtime-on", choices=RUNTIME_ON, default="auto",
                   help="where the runtime's scheduling loop runs: thread (its own), http (the HTTP server's event "
                        "loop, as KServe runs its models: each request is queued, batched, computed and answered "
                        "with no thread hand-off, but HTTP waits while a batch runs; --device cpu only, without "
                        "--http-workers) or auto (default: http where it can run there and every model's largest "
                        f"batch takes at most {AUTO_HOST_MAX_BATCH_MS:g} ms, else thread; decided again at each load)")
    p.add_argument("--switch-interval-ms", type=switch_interval_arg, default=None, metavar="MS",
                   help="the interpreter's GIL switch interval while serving (default: Python's, 5 ms): how long "
                        "a thread woken for a request may wait for another busy thread to hand over the GIL")
    p.add_argument("--cpus", type=cpus_arg, default=None, metavar="LIST",
                   help="run this process (the HTTP loop, the runtime's threads, torch's) on these CPUs only, e.g. "
                        "'1' or '0,2-3' (default: all); the front-end workers run on the other CPUs")
    p.add_argument("--http-worker-arena-mb", type=arena_mb_arg, default=None, metavar="MIB",
                   help="shared memory per front-end worker that request tensors pass through to the runtime's "
                        "process (default 256; 0: over the socket; a request that does not fit goes over the socket)")
    p.add_argument("--http-worker-nice", type=nice_arg, default=None, metavar="N",
                   help="how much lower the front-end workers' CPU priority is than this process's (os.nice; "
                        "default 0: the same): on a busy host a worker woken for its reply then does not preempt "
                        "the runtime's thread, but it gets less CPU itself (on a 2-core machine, 10 helped the "
                        "runtime's thread and not the requests)")
    p.add_argument("--http-worker-ring-kb", type=ring_kb_arg, default=None, metavar="KIB",
                   help="shared rings per front-end worker that request and reply frames pass through, with no "
                        "thread of this process woken per request or reply (default 8192; 0: over the socket; "
                        "used with the arena, on x86-64 Linux; a frame that does not fit goes over the socket)")
    from ..serve.allowance import DEFAULT_MODE, MODES

    p.add_argument("--http-return-allowance", choices=MODES, default=DEFAULT_MODE,
                   help="auto: each front-end worker counts the time it expects a request to spend in the server "
                        "after it is handed to the runtime and outside the runtime's own clock (the median of its "
                        "recent replies, at most 50 ms) as already waited, so the scheduler drops what would reach "
                        f"the client late instead of serving it; off: it does not (default {DEFAULT_MODE}: on a slow "
                        "H100 host it turned late answers into drops without more on time; a faster host is still "
                        "to measure)")
    p.add_argument("--http-intake-window-ms", type=intake_window_arg, default=0.0, metavar="MS",
                   help="the runtime's loop takes the front-end workers' requests at most once per this many ms, "
                        "so that under load they come in bursts, each request cheaper for the loop's thread; a "
                        "request may wait up to this long, counted against its deadline (default 0: at every "
                        "wake-up; at most 10)")


def default_http_workers(cpus: int | None) -> int:
    """Front-end workers for ``auto``: half the CPUs, at most 8, on a host with 8 or more; else none.
    Measured (docs/reports/serving.md): on the H200 host (16 CPUs), mix6 x0.25 over HTTP kept 0.80 of
    the in-process goodput with 4 workers and 0.02 without; at x1, 4 workers were saturated (0.78
    CPU-s/s each, requests waited 55 ms in them at p50) and kept 0.077, where 8 kept 0.255 (run 81).
    On a 2-CPU machine the workers cost more than they saved."""
    cpus = cpus or 1
    return min(8, cpus // 2) if cpus >= 8 else 0


def _non_negative(text: str, expected: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return n


def switch_interval_arg(text: str) -> float:
    """A number of ms in (0, 100] (argparse type; the service's own check, ``gilswitch.check_interval_ms``)."""
    from gpuloom.runtime.gilswitch import check_interval_ms

    try:
        return check_interval_ms(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of ms in (0, 100], got {text!r}") from None


def model_names_arg(text: str) -> list[str]:
    """``a,b`` as ``["a", "b"]`` (argparse type): at least one name, none twice (``a,a`` loaded ``a``
    twice; ``,`` and an empty value were taken as no ``--models``, every model)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more model names separated by commas, got {text!r} "
                                         f"(leave --models out to load every model)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"names {', '.join(twice)} more than once in {text!r}: name each model once")
    return names


def profiles_dir_arg(text: str) -> str:
    """An existing directory (argparse type): profiles are only read from it (a missing one was an empty
    store, unsaid: every model profiled at load)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} " + ("is not a directory" if os.path.exists(text) else "does not exist")
                                         + " (a directory of profiles, as gpuloom profile --store DIR writes)")
    return text


def cpus_arg(text: str) -> set[int]:
    """A CPU list like ``taskset -c`` takes (``1``, ``0,2-3``) as a set of CPU numbers (argparse type)."""
    from gpuloom.runtime.affinity import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def client_timeout_arg(text: str) -> float:
    """Seconds > 0 (argparse type; the server's own check, ``serve.check_client_timeout``)."""
    from ..serve import check_client_timeout

    try:
        return check_client_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None


def arena_mb_arg(text: str) -> int:
    """A non-negative integer of MiB (argparse type)."""
    return _non_negative(text, "a non-negative integer of MiB (0: no arena)")


def ring_kb_arg(text: str) -> int:
    """A non-negative integer of KiB (argparse type)."""
    return _non_negative(text, "a non-negative integer of KiB (0: no rings)")


def intake_window_arg(text: str) -> float:
    """A number of ms in [0, 10] (argparse type)."""
    from ..serve.bridge import check_intake_window

    try:
        return check_intake_window(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "window" in str(e) else f"expected a number of ms, got {text!r}")


def nice_arg(text: str) -> int:
    """An integer from 0 to 19 (argparse type)."""
    n = _non_negative(text, "an integer from 0 to 19 (0: the workers run at this process's priority)")
    if n > 19:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 19 (0: the workers run at this process's "
                                         f"priority), got {text!r}")
    return n


def http_workers_arg(text: str) -> int | str:
    """``auto`` or a non-negative integer (argparse type)."""
    if text == "auto":  # resolved by run(): none with --runtime-on http, else default_http_workers
        return "auto"
    return _non_negative(text, "'auto' or a non-negative number of workers")


def _count(n: int, noun: str) -> str:
    """``1 model``, ``3 models``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def service_options_of(args: argparse.Namespace) -> dict:
    """``InferenceService``'s keyword options from ``gpuloom serve``'s flags (all but the policy and the
    profiles, which need parsing first). A flag left alone gives the service's own default (a test
    holds them equal: the repository's parser once drifted from ModelConfig's default unseen)."""
    from gpuloom.cachedirs import is_off

    return {"device": args.device, "queue_limit": args.queue_limit, "early_answer": args.early_answer,
            "launch_on": args.launch_on, "switch_interval_ms": args.switch_interval_ms,
            "raw_launch": not args.torch_launch, "workqueues": args.workqueues, "complete_on": args.complete_on,
            "outputs": args.outputs, "measure_profiles": args.profile_missing == "measure",
            "unload_collect_mib": args.unload_collect_mib,
            # as gpuloom cache --profile-cache reads it
            "profile_cache": None if is_off(args.profile_cache) else args.profile_cache}


def run(args: argparse.Namespace) -> int:
    with _QuitOnCtrlC() as quit_on_ctrl_c:
        return _run(args, quit_on_ctrl_c)


class _QuitOnCtrlC:
    """Until the server serves, Ctrl-C (SIGINT) ends the process at once, in one line, with status 130.
    Why not Python's KeyboardInterrupt: raised while ``import torch`` or a compile calls back into
    Python from C++ it aborted the process (``terminate called after throwing ... pybind11::
    error_already_set``); raised in a ``gc`` callback (the service's GC monitor) it was printed as
    ignored and the server started anyway; raised while the builder thread compiled in torch, the
    interpreter's teardown under it aborted (``terminate called without an active exception``; on the
    CPU, sixty-fifth session: 2 of 8 tries, and one stack). Before serving nothing is left to write (the caches'
    files are replaced whole). From :meth:`release` on, the server's own handlers drain and stop.
    Only in the main thread, where signals are handled, and not where SIGINT is ignored (a server
    started in the background by a script keeps ignoring it until it serves, as before)."""

    def __init__(self) -> None:
        self._installed = False
        self._previous = None

    @staticmethod
    def _quit(signum, frame) -> None:
        sys.stderr.write("\ninterrupted while starting: stopping (no model served)\n")
        sys.stderr.flush()
        os._exit(130)

    def __enter__(self) -> "_QuitOnCtrlC":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._quit)
            self._installed = True
        return self

    def release(self) -> None:
        """Python's (or the caller's) handler again: the server installs its own when it starts. (One
        not installed from Python reads as None and cannot be put back: the default then.)"""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed, self._previous = False, None

    def __exit__(self, *exc) -> None:
        self.release()


def _run(args: argparse.Namespace, quit_on_ctrl_c: _QuitOnCtrlC) -> int:
    import logging

    from gpuloom.serve.core import ServeCore
    from gpuloom.serve.protocol import ProtocolError
    from gpuloom.serve.repository import RepositoryError, scan_repository
    from gpuloom.serve.server import ServeError, Server, check_ports_free

    if args.outputs == "views" and args.torch_launch:
        print("error: --outputs views needs raw CUDA launches (a torch copy would tie the views' page-locked "
              "buffers to a lane's stream); drop --torch-launch or use --outputs copies", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from gpuloom.commands.output import plain_warnings

    plain_warnings()
    if args.http_workers in (None, "auto"):
        args.http_workers = 0 if args.runtime_on == "http" else default_http_workers(os.cpu_count())
    elif args.runtime_on == "http" and args.http_workers:
        print(f"error: --runtime-on http runs the runtime's loop on this process's HTTP event loop; the front-end "
              f"workers of --http-workers {args.http_workers} wake the runtime's own thread: use --http-workers 0",
              file=sys.stderr)
        return 2
    worker_cpus = None
    if getattr(args, "cpus", None):
        try:
            from gpuloom.runtime.affinity import pin_apart

            worker_cpus = pin_apart(args.cpus)  # the front-end workers run on the other CPUs
        except (OSError, ValueError, AttributeError) as e:
            print(f"error: --cpus {sorted(args.cpus)}: {e}", file=sys.stderr)
            return 2
    try:  # every model asked for (all, without --models) must be valid; a broken one not asked for waits
        repo = scan_repository(args.repository)
        names = repo.require(args.models)  # a list of names (model_names_arg), or None: every model
    except RepositoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, why in sorted(repo.errors.items()):
        if name not in names:
            print(f"warning: model {name} is not loaded, its entry is invalid: {why}", file=sys.stderr)
    try:  # before any model is built: a taken port or a wrong --host costs seconds, not the loading time
        check_ports_free(args.host, args.http_port, None if args.no_grpc else args.grpc_port)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not names:
        print(f"warning: {args.repository} has no models: serving none until one is added and loaded with "
              f"POST /v2/repository/models/<name>/load", file=sys.stderr)
    from gpuloom.runtime.service import InferenceService

    from gpuloom.profile.store import ProfileStore

    from gpuloom.bench.variants import parse_policy_spec

    if args.graph_cache is not None:  # read by every compile of this process (gpuloom.engine.graph_cache)
        os.environ["GPULOOM_GRAPH_CACHE"] = args.graph_cache
    try:
        policy, policy_options, service_options = parse_policy_spec(args.policy)
        if service_options:
            raise ValueError(f"--policy {args.policy}: {sorted(service_options)} configure the service, not the policy; "
                             f"gpuloom serve sets them with its own flags (see gpuloom serve --help)")
        profiles = ProfileStore(args.profiles) if args.profiles else None
        service = InferenceService(policy=policy, policy_options=policy_options, profiles=profiles,
                                   **service_options_of(args))
    except (ValueError, TypeError, OSError) as e:  # TypeError: an option the policy does not take
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.runtime_on == "http":
        why = service.host_loop_refusal()
        if why is not None:  # said before any model is loaded
            hint = "--device cpu" if service.device.kind != "cpu" else "--launch-on inline (or auto)"
            print(f"error: --runtime-on http: {why}; use {hint}", file=sys.stderr)
            return 2
    try:
        service.start()
    except (ValueError, RuntimeError) as e:  # --device cuda on a host without one, or a device that is none
        print(f"error: --device {args.device or 'default'}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    core = ServeCore(service, repo, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     max_bodies_bytes=int(args.max_bodies_mb * (1 << 20)))
    if names:
        print(f"loading {', '.join(names)} ...", file=sys.stderr, flush=True)
        try:
            core.load_all(names)  # each compiled (and profiled) in turn, then one layout for all
        except ProtocolError as e:
            print(f"error: {e}", file=sys.stderr)
            service.close(drain=False)
            return 1
        except KeyboardInterrupt:  # Ctrl-C while a model compiles: stop, without the compiler's stack
            print("\ninterrupted while loading: stopping (no model served)", file=sys.stderr)
            service.close(drain=False)
            return 130
    server = Server(core, host=args.host, http_port=args.http_port, grpc_port=None if args.no_grpc else args.grpc_port,
                    drain_timeout_s=args.drain_timeout, client_timeout_s=args.client_timeout,
                    http_workers=args.http_workers,
                    worker_arena_mb=args.http_worker_arena_mb, worker_ring_kb=args.http_worker_ring_kb,
                    worker_cpus=worker_cpus, runtime_on=args.runtime_on, return_allowance=args.http_return_allowance,
                    intake_window_ms=args.http_intake_window_ms,
                    **({} if args.http_worker_nice is None else {"worker_nice": args.http_worker_nice}))

    def started(addr):
        grpc = f", gRPC on {addr.grpc_url}" if addr.grpc_port else ""
        allowing = ", with the return allowance" if server.return_allowance == "auto" else ""
        workers = (f" ({args.http_workers} front-end workers, at nice +{server.worker_nice}{allowing})"
                   if args.http_workers else "")
        hosted = " (the runtime's loop on HTTP's event loop)" if service.loop_hosted else ""
        print(f"gpuloom serving {_count(len(names), 'model')} ({', '.join(names) or 'none yet'}) with policy {args.policy}: HTTP on http://{addr.http_url}{workers}{hosted}{grpc}", file=sys.stderr, flush=True)

    quit_on_ctrl_c.release()
    try:
        server.serve_forever(on_started=started)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        service.close(drain=False)
        return 1
    print("gpuloom serve stopped (drained)", file=sys.stderr)
    return 0
