"""A measured ``gpuloom bench`` report's points through the simulator again, with another simulated GPU.

Why: a bench run simulates each point as it measures it, with the preset it was given (``h200`` by
default), and which preset fits depends on the host (``host_hold``). Once the run is over its own
lowest held load says how long this host's lanes hold a batch; :func:`host_resimulation` simulates
every point again with that hold (``host_contention``) and scores the points above the calibration
load, which it did not see. The report keeps both columns: ``sim`` (the preset) and ``sim_host``.
Pure Python (the simulator), any machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..runtime.core import REPORT_YIELD_DEFAULT, YIELD_CHECK_S, yields_answers
from ..runtime.sim import DROP_ANSWER_MS, ContentionModel
from .e2e import offered_as_scheduled, planned_profiles
from .experiment import simulate
from .host_hold import DROP_MS_PER_LOOP_US, calibration_point, host_contention, loop_us_per_request
from .variants import sim_policy
from .workload import workload_from_dict

#: issue 5's bar for the simulator: goodput within 10% of the measured
WITHIN = 0.10
#: below this attainment a point is in collapse: no queueing model of the GPU is asked to follow it
#: (``scripts/calibrate_sim.py --min-attainment``'s default)
MIN_ATTAINMENT = 0.5


def as_the_runtime_ran(contention: Any, settings: Mapping[str, str]) -> Any:
    """``contention`` (a ``ContentionModel``) with what the runtime's process ``settings`` (a report's
    ``meta.gpuloom_settings``) change on the simulated GPU: with ``GPULOOM_YIELD_ANSWERS`` a launch
    waits behind at most the loop's check interval of drops' answers (``drop_yield_ms``, each answer
    ``DROP_ANSWER_MS`` of the drop's host time), as the runtime's launches do. A model without a
    per-drop host time has nothing to yield and is returned as it is."""
    if yields_answers(settings, default=REPORT_YIELD_DEFAULT) and contention.drop_yield_ms is None \
            and contention.host_drop_ms > 0:
        return dataclasses.replace(contention, drop_yield_ms=YIELD_CHECK_S * 1e3,
                                   drop_answer_ms=min(DROP_ANSWER_MS, contention.host_drop_ms))
    return contention


#: ``gpuloom bench --queue-limit``'s default, for reports that recorded neither the key nor the flag
BENCH_QUEUE_LIMIT = 1024


def report_queue_limit(meta: Mapping[str, Any]) -> int:
    """The per-model queue bound a report's service ran with: its ``meta.queue_limit`` (since the
    sixty-third session), else ``--queue-limit N`` in its ``argv``, else the bench's default."""
    if meta.get("queue_limit") is not None:
        return int(meta["queue_limit"])
    argv = [str(a) for a in meta.get("argv") or []]
    for i, a in enumerate(argv):
        if a.startswith("--queue-limit="):
            return int(a.split("=", 1)[1])
        if a == "--queue-limit" and i + 1 < len(argv):
            return int(argv[i + 1])
    return BENCH_QUEUE_LIMIT


def simulate_report_point(report: dict, workload, profiles: dict, policy: str, scale: float, contention: Any,
                          plan: dict | None = None, *, bounded: bool = True):
    """The simulator's run (``RunMetrics``) of ``policy`` at load ``scale`` as ``gpuloom bench``
    simulates a point of ``report``: its ``workload`` scaled, its points' duration, the variant as
    the report's ``meta`` (and the point's ``plan``) builds it, the service's queue limit
    (``bounded=False``: none, as the simulator ran before the sixty-third session)."""
    meta = report["meta"]
    wl = dataclasses.replace(workload.scaled(scale), duration_s=float(meta["duration_s"]))
    name, options = sim_policy(policy, meta, plan)
    return simulate(wl, profiles, name, contention=contention, options=options,
                    queue_limit=report_queue_limit(meta) if bounded else None).metrics


def scored(point: dict) -> bool:
    """Whether the simulator is held to ``point``: not in collapse, and offered as scheduled."""
    return (point["slo_attainment"] >= MIN_ATTAINMENT and bool(point["goodput_rps"])
            and offered_as_scheduled(point.get("arrivals") or {}))


#: a point where at least this share of the requests that entered were dropped is simulated in
#: ``sim_host`` with the host's time per drop read off its own runtime loop's CPU
#: (``host_hold.DROP_MS_PER_LOOP_US``): on the overloaded mix's nexus points (runs 196-204, every one
#: 80-90% dropped, held out) 6 of 9 within 10% and 9 of 9 within 20%, against 0 and 0 for the preset's
#: fixed 0.04 ms (``scripts/sim_host_drop_from_loop.py``, sixty-fifth session). Where few requests drop
#: the loop's CPU per request is mostly per-batch work and the reading overstates a drop (mix6: 145 of
#: 162 points within 10% told it at every point, against 148), hence only where drops dominate
DROP_DOMINATED = 0.5


def point_drop_ms(point: dict) -> float | None:
    """The host's time per dropped request (ms) read off ``point``'s runtime loop CPU, where at least
    :data:`DROP_DOMINATED` of the requests that entered it were dropped; None elsewhere."""
    models = point.get("models") or ()
    entered = sum(m.get("submitted", 0) for m in models)
    loop_us = loop_us_per_request(point) if entered else None
    if loop_us is None or sum(m.get("dropped", 0) for m in models) < DROP_DOMINATED * entered:
        return None
    return round(DROP_MS_PER_LOOP_US * loop_us, 4)


def host_resimulation(report: dict, store: Any, target: float = 0.99) -> dict | None:
    """Every point of ``report`` simulated with its host's calibration, or None where no point held
    with its lanes' holds recorded and no point is dominated by drops (:func:`point_drop_ms`).
    Returns ``{"calibration": {...}, "points": {policy: [sim, ...]}}``, each ``sim`` as a point's
    ``sim`` plus ``held_out`` (its load is above the calibration's; every point where no load held)
    and ``host_drop_ms`` where told one, and, under ``"summary"``, how many held-out scored points
    each column put within 10%: this one's and the preset's the run simulated with (``sim``).
    ``store``: the profiles for reports that did not record theirs (``planned_profiles``). Without a
    held load the host's hold is unknown: the ``h100-fast-host`` preset's stands."""
    cal = calibration_point(report, target)
    told = {(pol, i): point_drop_ms(pt) for pol, p in report["policies"].items() for i, pt in enumerate(p["points"])}
    if cal is None and not any(v is not None for v in told.values()):
        return None
    scale0, hold, lanes = cal if cal is not None else (None, None, 0)
    settings = report["meta"].get("gpuloom_settings") or {}
    base = host_contention(hold) if hold is not None else ContentionModel.h100_fast_host()
    contention = as_the_runtime_ran(base, settings)
    wl = workload_from_dict(report["workload"])
    points: dict[str, list[dict]] = {}
    host_ok = preset_ok = n = 0
    for pol, p in report["policies"].items():
        profs = planned_profiles(report, store, pol)
        rows = points[pol] = []
        for i, pt in enumerate(p["points"]):
            drop_ms = told[(pol, i)]
            c = contention if drop_ms is None else as_the_runtime_ran(dataclasses.replace(base, host_drop_ms=drop_ms),
                                                                      settings)
            m = simulate_report_point(report, wl, profs, pol, pt["scale"], c, pt.get("plan"))
            g = pt["goodput_rps"]
            row = {"goodput_rps": m.goodput_rps, "slo_attainment": m.slo_attainment, "p50_ms": m.p50_ms,
                   "p99_ms": m.p99_ms, "goodput_error": (m.goodput_rps - g) / g if g else None,
                   "held_out": scale0 is None or pt["scale"] > scale0,
                   **({"host_drop_ms": drop_ms} if drop_ms is not None else {})}
            rows.append(row)
            if row["held_out"] and scored(pt):
                n += 1
                host_ok += abs(row["goodput_error"]) <= WITHIN
                preset_err = (pt.get("sim") or {}).get("goodput_error")
                preset_ok += preset_err is not None and abs(preset_err) <= WITHIN
    return {"calibration": {"scale": scale0, "hold_ms": round(hold, 3) if hold is not None else None, "lanes": lanes,
                            "batch_overhead_ms": contention.batch_overhead_ms,
                            # the process ran with GPULOOM_YIELD_ANSWERS, simulated so (as_the_runtime_ran)
                            "yield_answers": yields_answers(settings, default=REPORT_YIELD_DEFAULT),
                            "drops_told": sum(v is not None for v in told.values())},
            "points": points,
            "summary": {"scored": n, "within_10pct_host": host_ok, "within_10pct_preset": preset_ok}}


def add_host_resimulation(report: dict, store: Any, target: float = 0.99) -> dict | None:
    """:func:`host_resimulation` written into ``report``: each point's ``sim_host`` and the report's
    ``host_calibration`` (with its summary). Returns what it added (None: nothing)."""
    res = host_resimulation(report, store, target)
    if res is None:
        return None
    for pol, rows in res["points"].items():
        for pt, row in zip(report["policies"][pol]["points"], rows):
            pt["sim_host"] = row
    report["host_calibration"] = {**res["calibration"], **res["summary"]}
    return res


def host_line(res: dict, preset: str) -> str:
    """One line for the bench's output: the two simulated columns' scores on the held-out points."""
    c, s = res["calibration"], res["summary"]
    flags = f"--contention h100-fast-host --batch-overhead-ms {c['batch_overhead_ms']:g}" \
        + ("" if c.get("yield_answers") else " --no-yield-answers")
    drops = (f"; at the {c['drops_told']} point(s) most requests dropped, this host's time per drop read off the "
             f"loop's CPU (--host-drop-ms)") if c.get("drops_told") else ""
    if c.get("hold_ms") is None:
        return (f"no load held: sim_host told only each drop-dominated point's host time per drop read off its "
                f"loop's CPU ({c['drops_told']} point(s), the h100-fast-host preset otherwise)")
    if not s["scored"]:
        return (f"simulated with this host's hold ({c['hold_ms']:.2f} ms a batch at x{c['scale']:g}; sim_host): no "
                f"higher load measured to score it on; this host in gpuloom simulate: {flags}{drops}")
    return (f"simulator within {WITHIN:.0%} of the measured goodput above x{c['scale']:g} ({s['scored']} points): "
            f"{s['within_10pct_host']} told this host's hold ({c['hold_ms']:.2f} ms a batch at x{c['scale']:g}; "
            f"sim_host), {s['within_10pct_preset']} with --contention {preset} (sim); this host in "
            f"gpuloom simulate: {flags}{drops}")


__all__ = ["BENCH_QUEUE_LIMIT", "DROP_DOMINATED", "MIN_ATTAINMENT", "WITHIN", "add_host_resimulation", "host_line",
           "host_resimulation", "point_drop_ms", "report_queue_limit", "scored", "simulate_report_point"]
