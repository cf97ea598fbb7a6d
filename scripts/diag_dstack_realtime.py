#!/usr/bin/env python
"""Is dstack's gap to the simulator in the real-time runtime, or on the GPU? (issue 5 diagnosis)

On the H200 at mix6 x1, dstack's batches ran within 7-9% (median) of their profiles on their
partitions, yet its p50 was 11-12 ms against the simulator's 2.7 ms and it kept 80-86% of requests
against the simulator's 100%. This runs the *real-time* runtime (the service, its loop thread, the
policy, the execution backend and its watcher threads) on a fake device that sleeps each batch for
exactly its profiled latency on its partition's SMs, with the workload's arrival times, and puts the
same point through the simulator. If the two agree, the gap is on the GPU or in the CUDA layer; if
the fake is already far from the simulator, it is in the runtime or the policy in real time.
The fake is ``gpuloom.runtime.host_device.ProfiledFakeLayer`` (since the fifty-eighth session; the
script's own copy before ran a shared lane's batches side by side, the shared class one after another,
as a stream does).

    .venv/bin/python scripts/diag_dstack_realtime.py --scales 0.1,0.25 --policy dstack,triton --out F.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/profile_threads.py (--cprofile)

from gpuloom.bench.e2e import run_point, simulate_point  # noqa: E402
from gpuloom.bench.workload import load_workload  # noqa: E402
from gpuloom.bench.variants import parse_policy_spec  # noqa: E402
from gpuloom.profile.store import ProfileStore  # noqa: E402
from gpuloom.runtime.host_device import FakeModel, ProfiledFakeLayer  # noqa: E402
from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec  # noqa: E402


def _profile_threads(cpu_time: bool = False) -> None:
    """Run every thread started from now on, and this one, under cProfile (``--cprofile``; Python
    < 3.12, where each thread may have its own profiler: ``scripts/profile_threads.py``); with
    ``cpu_time``, on each thread's CPU clock (``--cprofile-cpu``)."""
    import profile_threads

    if cpu_time:
        profile_threads.TIMER = time.thread_time

    profile_threads.install("", main=True).enable()


def _dump_profiles(out_dir: str, tag: str) -> None:
    """Write and summarize what ``_profile_threads`` collected since the last dump."""
    import io
    import pstats

    from profile_threads import PROFILES

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    kept = []
    for name, prof in PROFILES:
        prof.disable()
        path = Path(out_dir) / f"{tag}_{name}.prof"
        prof.dump_stats(str(path))
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(12)
        print(f"--- {tag} thread {name}: total {st.total_tt:.2f} s\n" + "\n".join(buf.getvalue().splitlines()[6:]))
        if name == "MainThread":
            prof.clear()
            prof.enable()
            kept.append((name, prof))
    PROFILES[:] = kept  # the service's threads ended with the point


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="examples/mix6.yaml")
    ap.add_argument("--policy", default="dstack,triton",
                    help="comma-separated policies; NAME:KEY=VALUE sets a policy option (dstack:batch_overhead_ms=1) "
                         "or a service one (dstack:launch_on=lane)")
    ap.add_argument("--scales", default="0.1,0.25")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--no-replan", action="store_true", help="dstack keeps its first plan (no re-planning)")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="K: profiled latencies and SLOs x K, rates / K (host costs weigh K times less)")
    ap.add_argument("--small-tensors", action="store_true",
                    help="4-float inputs (same profiled latencies): the runtime's own cost without tensor copies")
    ap.add_argument("--tune-gc", default="on", help="on, off, or on,off (both, alternating per point: an A/B "
                    "of InferenceService(tune_gc=...)); default on")
    ap.add_argument("--lookahead-ms", default="0", help="launch-ahead value(s), comma-separated (an A/B like --tune-gc)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="host time per launch on the runtime's thread, ms (H200 CUDA layer: 0.25-0.4; default 0)")
    ap.add_argument("--repeat", type=int, default=1, help="measure every (policy, scale, tune-gc) this many times")
    ap.add_argument("--cprofile", default=None, metavar="DIR",
                    help="profile every thread with cProfile (slows the host: for where the CPU goes, not for "
                         "attainment); DIR/<policy>_<scale>_<thread>.prof, and the top functions printed")
    ap.add_argument("--cprofile-cpu", action="store_true",
                    help="with --cprofile: charge CPU time (time.thread_time), not wall time, to functions")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.cprofile:
        _profile_threads(a.cprofile_cpu)
    wl = load_workload(a.workload)
    store = ProfileStore.builtin("h200")
    import dataclasses

    if a.small_tensors:  # the same latencies for 4-float inputs: what the runtime costs without big copies
        store = ProfileStore(profiles=[dataclasses.replace(store.get(m.name), input_shapes=((4,),)) for m in wl.models])
    if a.slowdown != 1.0:  # a GPU K times slower, SLOs K times looser, rates K times lower: the same
        k = a.slowdown     # schedule in slow motion, where the host's fixed costs weigh K times less
        store = ProfileStore(profiles=[dataclasses.replace(
            p, latency_ms=tuple(tuple(x * k for x in row) for row in p.latency_ms)) for p in store])
        wl = dataclasses.replace(wl, models=tuple(dataclasses.replace(m, slo_ms=m.slo_ms * k) for m in wl.models))
        wl = wl.scaled(1.0 / k)
    rows = []
    tunes = [t.strip() == "on" for t in a.tune_gc.split(",")]
    aheads = [float(x) for x in a.lookahead_ms.split(",")]
    # policies and settings alternate within each (scale, repetition), so an A/B shares the machine's moods
    cases = [(pol, s, tune, ahead) for s in (float(x) for x in a.scales.split(",")) for _ in range(a.repeat)
             for pol in a.policy.split(",") for tune in tunes for ahead in aheads]
    for pol, s, tune, ahead in cases:
        name, opts, service_opts = parse_policy_spec(pol)  # e.g. dstack:batch_overhead_ms=1, dstack:launch_on=lane
        arrivals = str(service_opts.pop("arrivals", "thread"))  # the load generator's (dstack:arrivals=loop)
        if name == "dstack" and a.no_replan:
            opts["replan"] = False
        svc = InferenceService(policy=name, device_layer=ProfiledFakeLayer(store, host_ms=a.host_ms), profiles=store,
                               policy_options=opts or None, **{"tune_gc": tune, "lookahead_ms": ahead, **service_opts})
        svc.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                svc.load_many([(ModelConfig(m.name, tuple(TensorSpec(f"x{i}", tuple(sh), "float32") for i, sh in
                                                        enumerate(store.get(m.name).input_shapes)),
                                            (TensorSpec("y", (4,), "float32"),), max_batch=a.max_batch,
                                            slo_ms=float(m.slo_ms), weight=float(m.weight),
                                            rate_hint=wl.mean_rate(m) * s),
                                FakeModel(lambda xs: [xs[0].reshape(len(xs[0]), -1)[:, :4]], 0.0))
                               for m in wl.models])
            t0 = time.process_time()
            p = run_point(svc, wl, pol, scale=s, duration_s=a.duration, arrivals=arrivals)
            cpu_s = time.process_time() - t0
            be = svc.stats()["backend"]
            layouts = be.get("layouts_built")
            # per batch, how long a partition was held beyond its (fake) device time: launch,
            # completion's way back, the loop's turnaround (the point's lane_deltas)
            lane_gap = [round(q["gap_ms"], 3) for q in p.layouts if q["gap_ms"] is not None]
            sim = simulate_point(svc, wl, name, scale=s, duration_s=a.duration)
        finally:
            svc.close(drain=False, timeout_s=10)
        row = {"policy": pol, "scale": s, "tune_gc": tune, "lookahead_ms": ahead, "host_ms": a.host_ms, "gc": p.gc,
               "loop_lag": p.loop_lag,
               "offered_rps": p.offered_rps, "layouts_built": layouts, "lane_ms_per_batch_off_device": lane_gap,
               "lanes": p.layouts,
               "realtime_fake": {"goodput_rps": p.goodput_rps, "slo_attainment": p.slo_attainment,
                                 "p50_ms": p.p50_ms, "p99_ms": p.p99_ms, "host": p.host,
                                 "models": {mp.model: {"slo_attainment": mp.slo_attainment, "p50_ms": mp.p50_ms}
                                            for mp in p.models}},
               "arrivals": p.arrivals,
               "simulated": {k: sim[k] for k in ("goodput_rps", "slo_attainment", "p50_ms", "p99_ms")},
               "process_cpu_s": cpu_s, "wall_s": a.duration}
        rows.append(row)
        if a.cprofile:
            _dump_profiles(a.cprofile, f"{pol.replace(':', '_')}_x{s:g}")
        print(f"{pol:7s} x{s:<5g} tune_gc {'on ' if tune else 'off'} lookahead {ahead:g} ms, full GCs {p.gc['collections'][2]} "
              f"(longest {p.gc['max_ms']:.0f} ms), loop lag > 5 ms: {p.loop_lag.get('over_5ms')} "
              f"(longest {p.loop_lag.get('max_ms', 0):.0f} ms) | offered {p.offered_rps:6.0f}/s | real-time fake: attainment "
              f"{p.slo_attainment:.3f} p50 {p.p50_ms:5.1f} p99 {p.p99_ms:6.1f} ms | simulated: "
              f"{sim['slo_attainment']:.3f} p50 {sim['p50_ms']:5.1f} p99 {sim['p99_ms']:6.1f} ms | "
              f"CPU {cpu_s / a.duration:.2f} of a core-s per s, layouts built {layouts}; lane ms/batch off the "
              f"device {lane_gap}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"workload": a.workload, "duration_s": a.duration, "rows": rows}, indent=1))
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
