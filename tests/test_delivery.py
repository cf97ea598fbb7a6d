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


def test_no_cut_below_the_trigger_or_on_too_few_outcomes():
    c = DeliveryCap(["a"])
    assert not window(c, 250, "a", 500, 400, 80)  # 16.7% missed: under the trigger
    assert not window(c, 500, "a", 20, 5, 14)  # 19 outcomes: too few to judge
    assert c.caps == {}


def test_a_cut_that_pays_stays_and_a_second_cut_at_most_halves_the_cap():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 1000, 600, 400)  # 40% missed: cut to 2400/s
    assert c.caps["a"] == pytest.approx(2400.0)
    assert not window(c, 500, "a", 1000, 500, 200)  # the window after a cut still resolves older requests: hold
    window(c, 750, "a", 1000, 100, 30)  # 23% missed, under 2/3 of 40%: the cut paid; 400/s on time: cut again
    assert c.caps["a"] == pytest.approx(1200.0) and c.undone == 0  # halved, not cut to 400
    window(c, 1000, "a", 1000, 50, 200)  # hold
    window(c, 1250, "a", 1000, 50, 200)  # 80% missed after the second cut: undone
    assert c.caps == {} and c.undone == 1


def test_a_cut_is_never_under_the_floor_of_demand_nor_zero():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 4000, 10, 100)  # 16,000/s arrive, 40/s on time: a tenth of demand is the floor
    assert c.caps["a"] == pytest.approx(1600.0)
    c = DeliveryCap(["a"])
    window(c, 250, "a", 0, 0, 30)  # a burst's misses after its arrivals ended: nothing on time, no demand
    assert c.caps["a"] == pytest.approx(1.0)  # the lowest cap, not zero
    for t in (500, 750, 1000):  # 1,600/s arrive; the cap keeps outcomes too few to judge: counts carry over
        window(c, t, "a", 400, 0, 0)
        assert c.caps["a"] == pytest.approx(1.0)
    window(c, 1250, "a", 400, 0, 0)  # a second of them, still too few: raised by a tenth of demand
    assert c.caps["a"] == pytest.approx(161.0)


def test_a_low_cap_under_high_demand_is_judged_on_counts_carried_over_not_raised_blind():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 100, 10, 90)  # 400/s arrive, 90% missed: cut to 40/s (the floor)
    assert c.caps["a"] == pytest.approx(40.0)
    window(c, 500, "a", 100, 2, 8)  # 10 outcomes: too few, but 100 arrived: carried over, not raised
    assert c.caps["a"] == pytest.approx(40.0)
    window(c, 750, "a", 100, 2, 8)  # 20 over 0.5 s: the hold window after the cut
    assert c.caps["a"] == pytest.approx(40.0)
    window(c, 1000, "a", 100, 2, 8)
    window(c, 1250, "a", 100, 2, 8)  # judged: 80% missed, as when cut: undone
    assert c.caps == {} and c.undone == 1


def test_a_cap_raised_away_before_its_judgement_leaves_nothing_to_judge():
    # review: a cut, then a quiet window that raised the cap away, then a judged window that misses
    c = DeliveryCap(["a"])
    window(c, 250, "a", 100, 50, 50)  # 50% missed: cut to 200/s
    window(c, 500, "a", 5, 5, 0)  # few arrivals, few outcomes: raised to >= demand: no cap
    assert c.caps == {}
    window(c, 750, "a", 100, 40, 60)  # 60% missed: a fresh cut, not a judgement of the old one (no KeyError)
    assert c.caps["a"] == pytest.approx(160.0) and c.undone == 0


def test_the_cap_rises_while_the_model_keeps_up_and_goes_at_its_demand():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 500, 300, 100)  # cap 1200/s
    window(c, 500, "a", 400, 300, 5)  # the hold window after the cut
    assert c.caps["a"] == pytest.approx(1200.0)
    assert window(c, 750, "a", 400, 300, 5)  # kept up (1.6% missed): x1.25
    assert c.caps["a"] == pytest.approx(1500.0)
    assert window(c, 1000, "a", 500, 400, 40)  # 9% missed: creeps x1.05, or a tenth of demand (200/s) if more
    assert c.caps["a"] == pytest.approx(1700.0)
    assert window(c, 1250, "a", 500, 470, 0)  # 1700 * 1.25 >= 2000/s arriving: no cap
    assert c.caps == {}


def test_a_cut_after_which_the_model_misses_as_much_is_undone_and_not_tried_again_for_a_while():
    c = DeliveryCap(["a"], block_ms=1000)
    window(c, 250, "a", 700, 450, 200)  # 30.8% missed: cut to 1800/s
    assert c.caps["a"] == pytest.approx(1800.0)
    window(c, 500, "a", 500, 300, 130)  # the hold window
    assert window(c, 750, "a", 500, 300, 130)  # capped, still 30.2% missed: the misses are not the load's
    assert c.caps == {} and c.undone == 1
    window(c, 1000, "a", 700, 450, 200)
    assert c.caps == {}  # blocked until 1750 ms
    window(c, 1750, "a", 700, 450, 200)
    assert "a" in c.caps


def test_a_restart_forgets_the_window_and_the_pending_judgement_but_keeps_the_caps():
    c = DeliveryCap(["a"])
    window(c, 250, "a", 700, 450, 200)
    c.outcome("a", 0, 500)  # a layout switch drains the GPU: misses that say nothing about the host
    c.restart(300)
    assert c.caps["a"] == pytest.approx(1800.0)
    assert not c.due(500) and c.due(550)
    window(c, 550, "a", 700, 300, 130)  # 30% missed: no judgement pending, so a cut, not an undo
    assert c.undone == 0 and c.caps["a"] == pytest.approx(1200.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="recover < trigger"):
        DeliveryCap(["a"], trigger=0.1, recover=0.2)


#: the shared-interpreter host fitted to the overloaded mix (sixteenth session): light3 at x8 saturates it
INTERPRETER = ContentionModel(batch_overhead_ms=0.25, gil_request_ms=0.06, gil_batch_ms=0.6)


def _light3_models():
    """light3 and its H200 profiles cut at batch 16, as the bench runs them."""
    store = ProfileStore.builtin("h200")
    w = load_workload(EXAMPLES / "light3.yaml")
    return w, {m.name: trim_profile(store.get(m.name), 16) for m in w.models}


def _light3(policy, contention, opts=None, scale=8.0, duration_s=1.0):
    w, profs = _light3_models()
    return simulate(dataclasses.replace(w.scaled(scale), duration_s=duration_s), profs, policy,
                    contention=contention, options=opts)


def test_dstack_adapt_sheds_what_a_saturated_host_cannot_serve_and_serves_more():
    # light3 at x8 saturates the interpreter host, and the plan, which serves every demand, sheds nothing
    plain = _light3("dstack", INTERPRETER, duration_s=3.0)  # the first window after the layout's first decision does not count
    adapt = _light3("dstack", INTERPRETER, {"adapt": True}, duration_s=3.0)
    assert not any(r.reason == "shed" for r in plain.record.results)
    assert sum(r.reason == "shed" for r in adapt.record.results) > 0.05 * len(adapt.record.results)
    assert adapt.policy["delivery_cuts"] > 0
    assert adapt.metrics.goodput_rps > 1.03 * plain.metrics.goodput_rps


def test_dstack_adapt_leaves_a_host_that_keeps_up_alone():
    host = ContentionModel(batch_overhead_ms=0.25)
    plain = _light3("dstack", host, scale=4.0)
    adapt = _light3("dstack", host, {"adapt": True}, scale=4.0)
    assert adapt.policy["delivery_caps"] == {} and adapt.policy["delivery_cuts"] == 0
    assert adapt.metrics.goodput_rps == plain.metrics.goodput_rps


def test_dstack_adapt_needs_shedding_and_is_off_by_default():
    assert make_policy("dstack").wants_outcomes is False
    assert make_policy("dstack", adapt=True).wants_outcomes is True
    with pytest.raises(ValueError, match="adapt=true needs shed=true"):
        make_policy("dstack", adapt=True, shed=False)
    with pytest.raises(ValueError, match="adapt must be true or false"):
        make_policy("dstack", adapt="yes")


def test_the_runtime_reports_each_batchs_and_each_deadline_drops_outcomes_to_a_policy_that_asks():
    from gpuloom.policy.types import Status

    seen = {"on_time": 0, "missed": 0}
    for asks in (True, False):
        pol = make_policy("dstack")
        pol.wants_outcomes = asks

        def on_outcomes(model, on_time, missed, now_ms, asks=asks):
            assert asks, "a policy that did not ask heard of outcomes"
            seen["on_time"] += on_time
            seen["missed"] += missed

        pol.on_outcomes = on_outcomes
        run = _light3(pol, INTERPRETER)
        if asks:
            res = run.record.results
            served = [r for r in res if r.status is Status.SERVED]
            on_time = sum(r.finish_ms <= r.request.deadline_ms for r in served)
            dropped = sum(r.status is Status.DROPPED and r.reason == "deadline" for r in res)
            assert dropped > 0 and len(served) - on_time > 0  # both kinds of miss happened
            assert seen == {"on_time": on_time, "missed": len(served) - on_time + dropped}


def test_dstack_adapt_replaces_its_admitted_rates_and_reports_plan_and_caps_apart():
    pol = make_policy("dstack", adapt=True)
    seen = []
    real = pol._close_window

    def spy(now_ms):
        before = pol.admit_rps
        real(now_ms)
        if pol.admit_rps is not before:
            seen.append((before, dict(before), pol.admit_rps))

    pol._close_window = spy
    run = _light3(pol, INTERPRETER)
    assert seen  # the caps changed at least once ...
    assert all(old == kept for old, kept, _ in seen)  # ... each time in a new mapping, the old one untouched
    d = run.policy
    assert d["adapt"] is True and d["admit_rps"] == {}  # the plan serves every demand: it sheds nothing itself
    assert d["delivery_cuts"] >= 1 and set(d) >= {"delivery_caps", "delivery_undone"}


def test_dstack_asks_to_be_woken_for_a_replan_check_that_is_already_due():
    # layout_change() has no clock: on a bare wake-up it sees the last decide's time and skips a due
    # check; next_wakeup must then ask for a time after now (the runtime ignores the past), not the check's
    from gpuloom.bench.experiment import make_context

    w, profs = _light3_models()
    pol = make_policy("dstack")
    pol.setup(make_context(w, profs))
    pol._now = 100.0  # the last decide
    pol._next_check = 250.0
    assert pol.layout_change() is None  # at the wake-up for 250 ms, with no decide before it
    wake = pol.next_wakeup(260.0)
    assert 260.0 < wake < 260.1
    assert pol._now == 260.0 and pol._next_check <= pol._now  # the wake-up's layout_change runs the check


def test_dstack_adapt_counts_no_outcome_until_a_window_after_a_new_layouts_first_decision():
    # review: a layout switch drains the GPU and what queued meanwhile misses; that says nothing of the host
    from collections import deque

    from gpuloom.bench.experiment import make_context

    w, profs = _light3_models()
    pol = make_policy("dstack", adapt=True)
    pol.setup(make_context(w, profs))
    m = w.models[0].name
    for t in (10.0, 50.0):  # before the layout's first decision
        pol.on_outcomes(m, 0, 100, t)
    pol.decide(100.0, {x.name: deque() for x in w.models}, [])
    pol.on_outcomes(m, 0, 100, 300.0)  # within a window of it
    assert pol.delivery.caps == {}
    pol.on_outcomes(m, 0, 100, 360.0)  # settled: counting starts here
    pol.on_outcomes(m, 0, 100, 400.0)
    assert pol.delivery.caps == {}
    pol.on_outcomes(m, 5, 100, 620.0)  # the first window counted closes: 95% missed, a cut
    assert m in pol.delivery.caps and m in pol.admit_rps
