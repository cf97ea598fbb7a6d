"""Metrics of a run, computed from hand-built records."""

from __future__ import annotations

import math

import pytest

from gpuloom.bench.metrics import compute_metrics, geomean, jain, percentile
from gpuloom.policy import Request, Result, Status
from gpuloom.runtime.core import RunRecord


def record(results, *, until_ms=1000.0, end_ms=1000.0, busy=0.0, gpu=10) -> RunRecord:
    return RunRecord(policy="test", results=results, until_ms=until_ms, end_ms=end_ms, gpu_sms=gpu,
                     busy_sm_ms=busy, layouts=[], dispatches=0)


def req(i, model="a", t=0.0, slo=10.0) -> Request:
    return Request(i, model, t, t + slo)


def test_percentile_interpolates_between_order_statistics():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_jain_index_is_one_for_equal_shares_and_one_over_n_for_a_monopoly():
    assert jain([0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([]) == 1.0


def test_geomean_leaves_out_values_that_were_not_measured():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([2.0, None, 0.0, 8.0]) == pytest.approx(4.0)  # a speedup not measured is no zero
    assert math.isnan(geomean([])) and math.isnan(geomean([None]))


def test_goodput_attainment_drops_and_utilization_from_a_record():
    results = [
        Result(req(0), Status.SERVED, 5.0, batch=2),  # on time
        Result(req(1), Status.SERVED, 12.0, batch=2),  # late
        Result(req(2, "b"), Status.DROPPED, 3.0, "deadline"),
        Result(req(3, "b"), Status.SERVED, 9.0, batch=1),
        Result(req(4, "b"), Status.QUEUED),
    ]
    m = compute_metrics(record(results, busy=5000.0), models=["a", "b"])
    assert (m.arrived, m.served, m.on_time, m.dropped, m.queued) == (5, 3, 2, 1, 1)
    assert m.drops == {"deadline": 1}
    assert m.goodput_rps == pytest.approx(2.0) and m.throughput_rps == pytest.approx(3.0)
    assert m.slo_attainment == pytest.approx(0.4)
    assert m.model("a").slo_attainment == 0.5 and m.model("b").slo_attainment == pytest.approx(1 / 3)
    assert m.model("a").mean_batch == 2.0
    assert m.sm_utilization == pytest.approx(0.5)  # 5000 SM-ms of 10 SMs x 1000 ms
    assert m.fairness == pytest.approx(jain([0.5, 1 / 3]))
    assert m.model("a").p50_ms == pytest.approx(8.5)


def test_fairness_divides_served_fractions_by_weights():
    results = [Result(req(0, "a"), Status.SERVED, 1.0), Result(req(1, "a"), Status.DROPPED, 1.0, "deadline"),
               Result(req(2, "b"), Status.SERVED, 1.0)]
    m = compute_metrics(record(results), models=["a", "b"], weights={"a": 1.0, "b": 2.0})
    assert m.fairness == pytest.approx(1.0)  # b got twice a's fraction, as its weight asks


def test_models_without_requests_are_reported_but_do_not_count_for_fairness():
    m = compute_metrics(record([Result(req(0), Status.SERVED, 1.0)]), models=["a", "idle"])
    assert m.model("idle").arrived == 0 and m.model("idle").slo_attainment == 1.0
    assert m.fairness == 1.0
