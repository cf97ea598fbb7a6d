"""Planning (D-STACK): batch sizes under SLO, the space-time schedule of one GPU, fairness, re-planning.

Plain Python (no torch). Entry points:

* ``plan(demands, profiles)`` -> ``Schedule``: disjoint SM partitions, each a repeating cycle of slots.
* ``servable(demands, profiles)``: demands no plan can serve with their SLO raised to one it can.
* ``choose_batch(profile, rate, slo_ms, sms_options)``: the batch-size optimizer on its own.
* ``RateEstimator`` / ``Replanner``: re-plan online when measured rates drift.
* ``render_gantt(schedule, path)``: the schedule as a PNG (matplotlib, imported lazily).
"""

from .schedule import (
    SCHEMA,
    Demand,
    ModelPlan,
    Partition,
    PlanError,
    PlanInfeasible,
    Schedule,
    Slot,
)
from .planner import choose_batch, fits, plan, servable
from .replan import RateEstimator, Replanner, ReplanDecision
from .gantt import render_gantt

__all__ = [
    "SCHEMA",
    "Demand",
    "ModelPlan",
    "Partition",
    "PlanError",
    "PlanInfeasible",
    "RateEstimator",
    "ReplanDecision",
    "Replanner",
    "Schedule",
    "Slot",
    "choose_batch",
    "fits",
    "plan",
    "servable",
    "render_gantt",
]
