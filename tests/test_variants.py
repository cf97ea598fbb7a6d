"""A bench variant's spelling (``NAME:KEY=VALUE``) and the policy the simulator builds again from a
report's variant (``gpuloom.bench.variants``)."""

from __future__ import annotations

import pytest

from gpuloom.bench.variants import SERVICE_KEYS, parse_policy_spec, sim_policy


def test_a_variant_splits_into_policy_and_service_options_with_values_read_as_json():
    assert parse_policy_spec("dstack:lookahead_ms=0:replan=false:holds=h.json") == (
        "dstack", {"replan": False, "holds": "h.json"}, {"lookahead_ms": 0})
    assert parse_policy_spec("triton") == ("triton", {}, {})
    assert "pinned_inputs" in SERVICE_KEYS and "outputs" in SERVICE_KEYS  # device keys are service keys too
    for bad in ("dstack:replan", "dstack:=1", "dstack:lookahead_ms"):
        with pytest.raises(ValueError, match="expected NAME:KEY=VALUE"):
            parse_policy_spec(bad)


def test_a_measured_variant_is_simulated_with_its_policy_options_and_plain_dstack_with_its_runs_floor():
    assert sim_policy("triton", {}) == ("triton", {})
    # service keys configure the real runtime; the simulator gets the policy's own options
    # reports from before meta.dstack_remainder_default (and before lanes, growing and shedding)
    # (and before meta.dstack_hold_default dstack planned no hold: 0, not the simulated device's)
    old = {"remainder": "smallest", "lanes": "partitions", "grow": False, "shed": False, "batch_overhead_ms": 0.0}
    assert sim_policy("dstack:batch_overhead_ms=0.7:pinned_inputs=true", {}) == (
        "dstack", {**old, "batch_overhead_ms": 0.7, "min_sms": 0})
    assert sim_policy("dstack", {}) == ("dstack", {"min_sms": 0, **old})  # a report from before the floor
    assert sim_policy("dstack", {"dstack_min_sms_default": 16}) == ("dstack", {"min_sms": 16, **old})
    assert sim_policy("dstack:min_sms=24", {"dstack_min_sms_default": 16}) == ("dstack", {"min_sms": 24, **old})
    meta = {"dstack_min_sms_default": 16, "dstack_remainder_default": "largest"}
    before = {"lanes": "partitions", "grow": False, "shed": False, "batch_overhead_ms": 0.0}
    assert sim_policy("dstack", meta) == ("dstack", {"min_sms": 16, "remainder": "largest", **before})
    assert sim_policy("dstack:remainder=smallest", meta) == (
        "dstack", {"min_sms": 16, "remainder": "smallest", **before})
    assert sim_policy("dstack:lanes=shared", meta)[1]["grow"] is False  # session 15: no growing unless asked
    now = {"lanes": "auto", "grow": "auto", "shed": True, "batch_overhead_ms": 0.0}
    assert sim_policy("dstack", meta, {"admit_rps": {}})[1] == {"min_sms": 16, "remainder": "largest", **now}
    meta16 = {**meta, "dstack_lanes_default": "auto", "dstack_grow_default": "auto", "dstack_shed_default": True}
    assert sim_policy("dstack:shed=false", meta16)[1] == {"min_sms": 16, "remainder": "largest", **now,
                                                          "shed": False}
    # adapt needs shedding: a report whose plain dstack did not shed still simulates its adapt variant
    assert sim_policy("dstack:adapt=true", meta)[1] == {"min_sms": 16, "remainder": "largest", **before,
                                                       "shed": True, "adapt": True}
    meta17 = {**meta16, "dstack_adapt_default": False}
    assert sim_policy("dstack", meta17)[1] == {"min_sms": 16, "remainder": "largest", **now, "adapt": False}
    # the hold a run planned: the point's plan says it, else the report's default (fifty-third session)
    meta53 = {**meta17, "dstack_hold_default": 1.125}
    assert sim_policy("dstack", meta53)[1]["batch_overhead_ms"] == 1.125
    assert sim_policy("dstack", meta53, {"admit_rps": {}, "batch_overhead_ms": 0.8})[1]["batch_overhead_ms"] == 0.8
    assert sim_policy("dstack:batch_overhead_ms=0", meta53)[1]["batch_overhead_ms"] == 0.0
    learning = sim_policy("dstack:learn_slowdown=true", meta16)  # as dstack itself: partitions
    assert learning[1]["lanes"] == "partitions"
    from gpuloom.policy import make_policy

    make_policy(*learning[:1], **learning[1])  # and the simulator can build it
