"""A bench variant, ``NAME:KEY=VALUE[:...]``: which keys configure the device layer and the service
rather than the policy, how a spelling splits into them, and the policy a report's variant ran as the
simulator builds it again. Plain logic (no torch): the bench, the server, the simulator and the
scripts that read reports parse variants one way."""

from __future__ import annotations

import json

from .labels import spec_of

# variant keys that configure the device layer the service makes (one layer per set of them with --share-device)
DEVICE_KEYS = ("raw_launch", "workqueues", "lane_streams", "outputs")
# variant keys that configure the service (and pinned_inputs, the load generator); the rest are policy options
SERVICE_KEYS = ("lookahead_ms", "tune_gc", "switch_interval_ms", "launch_on", "early_answer", *DEVICE_KEYS,
                "complete_on", "pinned_inputs", "arrivals", "cpus")


def parse_policy_spec(spec: str) -> tuple[str, dict, dict]:
    """``"dstack:lookahead_ms=0:replan=false"`` -> ``("dstack", {"replan": False}, {"lookahead_ms": 0.0})``.

    Values are read as JSON where they parse (numbers, true/false), else kept as strings.
    """
    name, *pairs = spec.split(":")
    policy_options: dict = {}
    service_options: dict = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"policy variant {spec!r}: expected NAME:KEY=VALUE[:KEY=VALUE...], got {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        (service_options if key in SERVICE_KEYS else policy_options)[key] = value
    return name, policy_options, service_options


def sim_policy(spec: str, meta: dict, plan: dict | None = None) -> tuple[str, dict]:
    """The policy a measured variant ``spec`` ran, as the simulator builds it again from a bench
    report's ``meta``: its name and policy options (service keys configure the real runtime, not the
    simulated GPU). Plain ``dstack`` gets the defaults it had in that run:
    reports written before ``meta.dstack_min_sms_default`` planned down to 8 SMs, those before
    ``meta.dstack_remainder_default`` gave the remainder to the smallest partition, and those before
    ``meta.dstack_lanes_default`` ran on partitions without growing or shedding, unless the point's
    ``plan`` (the policy's description) reports ``admit_rps`` (run 51 had the new defaults, not the keys);
    it plans the hold the point's ``plan`` reports, else ``meta.dstack_hold_default`` (before the key,
    none), not the simulated device's, as a simulated dstack would by default."""
    name, options, _ = parse_policy_spec(spec_of(spec))  # a repeat's label ("dstack#2") names the same variant
    if name == "dstack":
        planned_hold = (plan or {}).get("batch_overhead_ms")
        options.setdefault("batch_overhead_ms", float(planned_hold if planned_hold is not None
                                                      else meta.get("dstack_hold_default", 0.0)))
        options.setdefault("min_sms", int(meta.get("dstack_min_sms_default", 0)))
        options.setdefault("remainder", str(meta.get("dstack_remainder_default", "smallest")))
        new = "dstack_lanes_default" in meta or (plan is not None and "admit_rps" in plan)
        # learning needs partitions, as dstack's own default says
        learning = options.get("learn_slowdown") is True or options.get("learn_holds") is True
        options.setdefault("lanes", str(meta.get("dstack_lanes_default", "auto")) if new and not learning
                           else "partitions")
        options.setdefault("grow", meta.get("dstack_grow_default", "auto") if new else False)
        # a variant asking for adapt sheds (adapt needs it), whatever the report's default
        options.setdefault("shed", True if options.get("adapt") is True
                           else bool(meta.get("dstack_shed_default", True)) if new else False)
        if "dstack_adapt_default" in meta:  # before the key, dstack had no adapt (its default now: off)
            options.setdefault("adapt", bool(meta["dstack_adapt_default"]))
        if isinstance(options.get("holds"), str) and plan is not None:
            # what the point planned with, not the file as it is now (learning: what it started from)
            given = plan.get("given_holds") if options.get("learn_holds") is True else plan.get("holds")
            if given:
                options["holds"] = dict(given)
    return name, options
