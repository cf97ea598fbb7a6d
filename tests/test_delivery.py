"""Admission at the delivered rate: DeliveryCap's rules, and dstack:adapt=true end to end in the simulator."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuloom.bench.experiment import simulate
from gpuloom.bench.workload import load_workload
from gpuloom.policy import make_policy
from gpuloom.policy.delivery import DeliveryCap
from gpuloom.profile.store import ProfileStore
from gpuloom.runtime.service import trim_profile
from gpuloom.runtime.sim import ContentionModel

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def window(cap: DeliveryCap, now_ms: float, model: str, arrived: int, on_time: int, missed: int) -> bool:
    cap.arrived(model, arrived)
    cap.outcome(model, on_time, missed)
    return cap.update(now_ms)


def test_a_model_missing_over_a_fifth_is_capped_at_what_it_delivered_on_time():
    c = DeliveryCap(["a", "b"])
    assert window(c, 250, "a", 500, 300, 100)  # 25% missed, 300 on time in 0.25 s
    assert c.caps == {"a": pytest.approx(1200.0)}
    assert c.admit({}) == {"a": pytest.approx(1200.0)}
    assert c.admit({"a": 900.0, "b": 50.0}) == {"a": 900.0, "b": 50.0}  # the plan's lower rate stands


def test_no_cap_below_the_trigger_or_on_too_few_outcomes():
    c = DeliveryCap(["a"])
    assert not window(c, 250, "a", 500, 400, 80)  # 16.7% missed: under the trigger
    assert not window(c, 500, "a", 20, 5, 14)  # 19 outcomes: too few to judge
    assert c.caps == {}


def test_a_cut_is_at_most_a_halving_and_never_below_the_floor_of_demand():
    c = DeliveryCap(["a"], tolerance=1.0)  # every cut pays here: the rules of the cut alone
    window(c, 250, "a", 500, 300, 100)
    assert c.caps["a"] == pytest.approx(1200.0)
    window(c, 500, "a", 500, 50, 200)  # 200/s on time: halved, not cut to 200
    assert c.caps["a"] == pytest.approx(600.0)
    window(c, 750, "a", 4000, 10, 100)  # 16,000/s arrive: a tenth of that is the floor
    assert c.caps["a"] == pytest.approx(600.0)  # the floor (1600) is above the cap: no cut


def test_the_cap_rises_while_the_model_keeps_up_and_goes_at_its_demand():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 500, 300, 100)  # cap 1200/s; usual rate 1200/s
    assert window(c, 500, "a", 400, 300, 5)  # kept up (1.6% missed): x1.25
    assert c.caps["a"] == pytest.approx(1500.0)
    assert window(c, 750, "a", 500, 400, 0)
    assert c.caps["a"] == pytest.approx(1875.0)
    assert window(c, 1000, "a", 500, 470, 0)  # 1875 * 1.25 >= 2000/s arriving: no cap
    assert c.caps == {}


def test_a_cut_that_does_not_pay_is_undone_and_not_tried_again_for_a_while():
    c = DeliveryCap(["a"], block_ms=1000)
    window(c, 250, "a", 700, 500, 100)  # uncapped: 2000/s on time, 16.7% missed
    window(c, 500, "a", 700, 450, 200)  # 30.8% missed: cut to 1800/s
    assert c.caps["a"] == pytest.approx(1800.0)
    assert window(c, 750, "a", 700, 300, 130)  # capped, 1200/s on time: below its usual 1940/s
    assert c.caps == {}
    window(c, 1000, "a", 700, 450, 200)
    assert c.caps == {}  # blocked until 1750 ms
    window(c, 1750, "a", 700, 450, 200)
    assert "a" in c.caps


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="recover < trigger"):
        DeliveryCap(["a"], trigger=0.1, recover=0.2)


def _light3(opts, contention, scale=8.0, duration_s=1.0):
    store = ProfileStore.builtin("h200")
    w = load_workload(EXAMPLES / "light3.yaml")
    wl = dataclasses.replace(w.scaled(scale), duration_s=duration_s)
    profs = {m.name: trim_profile(store.get(m.name), 16) for m in w.models}
    return simulate(wl, profs, "dstack", contention=contention, options=opts)


def test_dstack_adapt_sheds_what_a_saturated_host_cannot_serve_and_serves_more():
    # the shared-interpreter host fitted to the overloaded mix (sixteenth session): light3 at x8
    # saturates it, and the plan, which serves every demand, sheds nothing
    host = ContentionModel(batch_overhead_ms=0.25, gil_request_ms=0.06, gil_batch_ms=0.6)
    plain = _light3({}, host)
    adapt = _light3({"adapt": True}, host)
    assert not any(r.reason == "shed" for r in plain.record.results)
    assert sum(r.reason == "shed" for r in adapt.record.results) > 0.05 * len(adapt.record.results)
    assert adapt.policy["delivery_cuts"] > 0
    assert adapt.metrics.goodput_rps > 1.03 * plain.metrics.goodput_rps


def test_dstack_adapt_leaves_a_host_that_keeps_up_alone():
    host = ContentionModel(batch_overhead_ms=0.25)
    plain = _light3({}, host, scale=4.0)
    adapt = _light3({"adapt": True}, host, scale=4.0)
    assert adapt.policy["delivery_caps"] == {} and adapt.policy["delivery_cuts"] == 0
    assert adapt.metrics.goodput_rps == plain.metrics.goodput_rps


def test_dstack_adapt_needs_shedding_and_is_off_by_default():
    assert make_policy("dstack").wants_outcomes is False
    assert make_policy("dstack", adapt=True).wants_outcomes is True
    with pytest.raises(ValueError, match="adapt=true needs shed=true"):
        make_policy("dstack", adapt=True, shed=False)
    with pytest.raises(ValueError, match="adapt must be true or false"):
        make_policy("dstack", adapt="yes")
