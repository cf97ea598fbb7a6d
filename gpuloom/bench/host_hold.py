"""How long a host's lanes held each batch beyond its GPU time, read off a ``gpuloom bench`` report.

Why: the simulator's batch overhead (``ContentionModel.batch_overhead_ms``) stands for that hold, and
the hold is the host's, not the GPU's: the ``h200`` preset (0.75 ms) was fitted on runs whose lanes
held a median 0.60-0.69 ms, ``h100-fast-host`` (0.35 ms) on runs 171-175, which held 0.20-0.25 ms
(``docs/reports/runtime.md``, fifty-second session). A bench report says which kind of host it ran
on, so its simulated column can be read, or re-run, with the preset fitted on hosts like it, or with
a model of the host itself: :func:`calibration_point` reads the hold at the lowest load a report held
and :func:`host_contention` gives the simulator that hold (fifty-ninth session: held out on 25
reports, 148 of 162 higher points within 10% against the presets' 140 and 143,
``scripts/sim_host_calibrated.py``). Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from ..runtime.sim import FITTED_PRESETS, ContentionModel

#: the median lane hold (ms) of the runs each ``--contention`` preset was fitted on
PRESET_HOST_HOLD_MS = {"h200": 0.64, "h100-fast-host": 0.23}
#: the presets' batch overhead beyond the hold of the hosts they were fitted on (ms), averaged: the
#: overhead also stands for what the hold leaves out (the launch before the batch's first kernel)
PRESET_MARGIN_MS = round(statistics.mean(FITTED_PRESETS[k]().batch_overhead_ms - v
                                         for k, v in PRESET_HOST_HOLD_MS.items()), 4)
#: the host's time per dropped request (``ContentionModel.host_drop_ms``, ms) for each us of the
#: runtime loop's CPU per request that entered the point: fitted on nexus's overloaded points of H100
#: runs 173 and 183 (fast hosts, 16.5-20.2 us per request); held out on runs 192-198 (18.8-28.2 us),
#: 5 of 11 within 10% and 10 of 11 within 20%, where the fixed 0.04 ms put 0 and 1
#: (``scripts/sim_host_drop_from_loop.py``, sixtieth session). Not in the bench's ``sim_host``: where
#: few requests drop, the loop's CPU per request is mostly per-batch work (mix6 with max batch 4, run
#: 164: 72-98 us per request at 0.24-0.42 batches per request), and told it at every point the
#: calibrated simulator put 145 of session 59's 162 held-out points within 10% against 148
#: (``scripts/sim_host_calibrated.py``'s ``loop_drop`` column)
DROP_MS_PER_LOOP_US = 0.00235


def cpu_us_per_request(cpu_s_per_s: float | None, entered: int, duration_s: float) -> float | None:
    """A thread's CPU (us) per request that entered: its CPU seconds per second over the requests
    that entered per second of the arrivals' ``duration_s``. None without a reading or a request."""
    return cpu_s_per_s / (entered / duration_s) * 1e6 if cpu_s_per_s and entered else None


def loop_us_per_request(point: dict, thread: str = "gpuloom-runtime") -> float | None:
    """The runtime loop thread's CPU (us) per request that entered a bench ``point``: its intake,
    decision and answer work, which a dropped request costs in full. None where not recorded.
    ``thread``: another of the point's ``host.thread_cpu`` entries instead (``"process"``: the whole
    process, whose threads share one interpreter)."""
    return cpu_us_per_request(point.get("host", {}).get("thread_cpu", {}).get(thread),
                              sum(m["submitted"] for m in point.get("models", ())), point["duration_s"])


def lane_holds(report: dict, target: float = 0.99) -> list[float]:
    """Every lane's median hold (ms, ``layouts[].hold_p50_ms``) at every point of ``report``, any
    policy, that held ``target``: past its edge a lane's hold is queueing, not the host."""
    return [lane["hold_p50_ms"] for p in report.get("policies", {}).values() for pt in p.get("points", [])
            if pt.get("slo_attainment", 0.0) >= target for lane in pt.get("layouts", []) if "hold_p50_ms" in lane]


def host_hold(report: dict, target: float = 0.99) -> dict | None:
    """``{"median_ms", "lanes", "nearest_preset"}`` of ``report``'s lane holds (None without any):
    the preset whose fitted hosts' hold is nearest on a log scale."""
    holds = lane_holds(report, target)
    if not holds:
        return None
    med = statistics.median(holds)
    nearest = min(PRESET_HOST_HOLD_MS, key=lambda k: abs(math.log(PRESET_HOST_HOLD_MS[k] / med)) if med > 0 else 0)
    return {"median_ms": round(med, 3), "lanes": len(holds), "nearest_preset": nearest}


def holds_by_load(report: dict, target: float = 0.99) -> list[tuple[float, list[float]]]:
    """[(load factor, every lane's median hold there, ms)] of each load any policy of ``report`` held at
    ``target``, every policy's lanes together, lowest load first; loads whose points recorded no hold
    are left out."""
    by: dict[float, list[float]] = {}
    for p in report.get("policies", {}).values():
        for pt in p.get("points", []):
            if pt.get("slo_attainment", 0.0) >= target:
                by.setdefault(pt["scale"], []).extend(q["hold_p50_ms"] for q in pt.get("layouts", [])
                                                      if "hold_p50_ms" in q)
    return [(scale, holds) for scale, holds in sorted(by.items()) if holds]


def calibration_point(report: dict, target: float = 0.99) -> tuple[float, float, int] | None:
    """(the lowest load factor any policy of ``report`` held at ``target``, the median lane hold in ms
    over every policy's lanes there, how many lanes) or None where no held point recorded its lanes'
    holds. The lowest load: the hold is the host's there, not queueing, and the loads above it are
    left to be predicted."""
    loads = holds_by_load(report, target)
    if not loads:
        return None
    scale, holds = loads[0]
    return scale, statistics.median(holds), len(holds)


def host_contention(hold_ms: float) -> ContentionModel:
    """The simulated GPU of a host whose lanes hold a batch ``hold_ms`` beyond its GPU time:
    ``h100-fast-host`` (the sharing model, launching host and per-drop time of the H100 fit) with
    that hold plus :data:`PRESET_MARGIN_MS` as each batch's overhead. At the hosts the presets were
    fitted on it is within 0.01 ms of their overheads."""
    if not hold_ms >= 0:
        raise ValueError(f"host_contention: expected a hold >= 0 ms, found {hold_ms}")
    return dataclasses.replace(ContentionModel.h100_fast_host(), batch_overhead_ms=round(hold_ms + PRESET_MARGIN_MS, 3))


def hold_line(hold: dict, preset: str) -> str:
    """One line for the bench's output: the host's hold, and the preset fitted on hosts like it where
    the points were simulated with another."""
    line = (f"lanes held a batch {hold['median_ms']:.2f} ms beyond its GPU time (median of {hold['lanes']} lanes "
            f"at the points held); the simulator's presets were fitted on hosts holding "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in PRESET_HOST_HOLD_MS.items()))
    if preset in PRESET_HOST_HOLD_MS and hold["nearest_preset"] != preset:
        line += f"; nearer this host: --contention {hold['nearest_preset']}"
    return line


__all__ = ["DROP_MS_PER_LOOP_US", "PRESET_HOST_HOLD_MS", "PRESET_MARGIN_MS", "calibration_point", "cpu_us_per_request",
           "holds_by_load", "host_contention", "host_hold", "hold_line", "lane_holds", "loop_us_per_request"]
