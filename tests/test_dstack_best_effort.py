"""dstack never crashes on a schedule that serves nobody: it serves best effort and drops late requests."""

from __future__ import annotations

from gpuloom.bench.experiment import make_context, make_requests
from gpuloom.bench.metrics import compute_metrics
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.plan import Demand, plan
from gpuloom.policy import make_policy
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import synthetic_profile
from gpuloom.runtime import Runtime, SimBackend


def test_regression_empty_schedule_gives_a_whole_gpu_best_effort_layout():
    # batch 1 on the whole GPU takes 0.1 + 400/32 = 12.6 ms: an SLO of 10 ms can never be met
    # (a server measures a crude profile at load; on a busy host it can come out like this)
    slow = synthetic_profile("slow", per_item_sm_ms=400.0, knee1=32)
    store = ProfileStore(profiles=[slow])
    empty = plan([Demand("slow", rate=50, slo_ms=10)], store)
    assert not empty.partitions
    w = Workload((ModelSpec("slow", 10.0, arrival=Arrival("poisson", rate=50)),), duration_s=2)
    profiles = {"slow": slow}
    ctx = make_context(w, profiles)
    # dstack plans such a model for the SLO it can reach (servable, below); a schedule given
    # ready-made is run as it is, here one with no partition at all
    policy = make_policy("dstack", schedule=empty)
    record = Runtime(policy, SimBackend(profiles), ctx).run(make_requests(w), until_ms=2000.0, drain_ms=10.0)
    assert [p.sms for p in record.layouts[0][1].partitions] == [132]
    m = compute_metrics(record, models=["slow"])
    assert m.arrived > 50
    assert m.served + m.dropped + m.failed + m.queued == m.arrived  # every request accounted for
    assert m.drops.get("deadline", 0) > 0 and m.on_time == 0


def test_servable_raises_only_an_unreachable_slo_to_the_lowest_that_plans():
    from gpuloom.plan import fits, servable

    slow = synthetic_profile("slow", per_item_sm_ms=400.0, knee1=32)  # batch 1: 12.6 ms on the whole GPU
    fast = synthetic_profile("fast", per_item_sm_ms=40.0, knee1=32)
    store = ProfileStore(profiles=[slow, fast])
    asked = [Demand("slow", rate=50, slo_ms=10), Demand("fast", rate=200, slo_ms=10)]
    got = {d.model: d for d in servable(asked, store)}
    assert got["fast"] == asked[1]  # servable as asked: untouched
    raised = got["slow"].slo_ms
    assert raised > 10 and got["slow"].rate == 50 and got["slow"].weight == 1.0
    assert fits([Demand("slow", 1.0, raised)], store)
    assert not fits([Demand("slow", 1.0, raised / 1.25)], store)  # the lowest step that plans


def test_a_model_slower_than_its_slo_next_to_a_servable_one_still_gets_slots():
    # without servable() the planner gave "slow" nothing and dstack never ran it, even on an idle GPU,
    # because the fast model's slots left no gap a 12.6 ms batch fits in
    slow = synthetic_profile("slow", per_item_sm_ms=400.0, knee1=32)
    fast = synthetic_profile("fast", per_item_sm_ms=40.0, knee1=32)
    store = ProfileStore(profiles=[slow, fast])
    bare = plan([Demand("slow", rate=20, slo_ms=10), Demand("fast", rate=200, slo_ms=10)], store)
    assert next(m for m in bare.models if m.model == "slow").planned_rps == 0
    w = Workload((ModelSpec("slow", 10.0, arrival=Arrival("poisson", rate=20)),
                  ModelSpec("fast", 10.0, arrival=Arrival("poisson", rate=200))), duration_s=2)
    profiles = {"slow": slow, "fast": fast}
    ctx = make_context(w, profiles)
    policy = make_policy("dstack")
    record = Runtime(policy, SimBackend(profiles), ctx).run(make_requests(w), until_ms=2000.0, drain_ms=10.0)
    assert set(policy.relaxed) == {"slow"} and policy.relaxed["slow"][0] == 10
    assert any(p for p in policy.schedule.models if p.model == "slow" and p.planned_rps > 0)
    m = compute_metrics(record, models=["slow", "fast"]).models[0]
    # its requests (10 ms deadlines, 12.6 ms batches) are dropped at once, none served late or lost
    assert m.served + m.dropped + m.failed + m.queued == m.arrived and m.drops.get("deadline", 0) == m.arrived
    f = compute_metrics(record, models=["slow", "fast"]).models[1]
    assert f.arrived > 200 and f.on_time >= 0.99 * f.arrived


def test_a_model_without_slots_is_served_on_an_idle_gpu_in_the_next_gap_not_dropped():
    """A re-plan for measured rates can leave a model without slots (none of its requests came for a
    while). Its lone requests ran only where they fit before another model's next slot; one that
    arrived too late in a gap waited, on an idle GPU, until it was dropped at its deadline (the serve
    layer's review, sixty-fourth session: 6 of 10 answered 504). It now runs when the next gap opens."""
    from gpuloom.policy.types import Request

    a = synthetic_profile("a", per_item_sm_ms=40.0, knee1=32)
    b = synthetic_profile("b", per_item_sm_ms=100.0, knee1=32)
    only_a = plan([Demand("a", rate=300, slo_ms=10)], ProfileStore(profiles=[a, b]))
    assert {s.model for p in only_a.partitions for s in p.slots} == {"a"}
    w = Workload((ModelSpec("a", 10.0, arrival=Arrival("poisson", rate=300)),
                  ModelSpec("b", 100.0, arrival=Arrival("poisson", rate=5))), duration_s=2)
    profiles = {"a": a, "b": b}
    # b's requests, 200 ms apart at different phases of the cycle, nothing else arriving
    arrivals = [200.0 * i + 0.37 * i for i in range(20)]
    reqs = [Request(id=i, model="b", arrival_ms=t, deadline_ms=t + 100.0) for i, t in enumerate(arrivals)]
    record = Runtime(make_policy("dstack", schedule=only_a), SimBackend(profiles), make_context(w, profiles)).run(
        reqs, until_ms=4100.0, drain_ms=10.0)
    m = compute_metrics(record, models=["b"]).models[0]
    assert m.arrived == 20 and m.on_time == 20 and not m.drops
    assert max(r.latency_ms for r in record.results) < 10.0  # a cycle (5.9 ms) and a batch at most


def _vgg16_beside_resnet50():
    """The zoo's vgg16 (60 ms SLO, 100/s) and resnet50 (25 ms, 1,500/s): what dstack plans for, with
    their profiles; the tests send their own requests."""
    from gpuloom.profile.synthetic import zoo

    profiles = {p.model: p for p in zoo() if p.model in ("vgg16", "resnet50")}
    return profiles, Workload((ModelSpec("vgg16", 60.0, arrival=Arrival("poisson", rate=100)),
                               ModelSpec("resnet50", 25.0, arrival=Arrival("poisson", rate=1500))), duration_s=2)


def test_a_model_with_slots_whose_own_slot_comes_too_late_for_a_short_deadline_takes_the_next_gap():
    """vgg16 has its own (small) partition, where a batch of one misses a client's 5 ms deadline, and
    fits one in resnet50's larger partition, between resnet50's slots (no resnet50 traffic). A request
    that arrived just before one of those slots was looked at again only at its drop time: 2 of 10
    dropped on an idle GPU (a review, sixty-fourth session). Now it runs as that slot begins."""
    from gpuloom.policy.types import Request

    profiles, w = _vgg16_beside_resnet50()
    policy = make_policy("dstack", lanes="partitions")
    reqs = [Request(i, "vgg16", 100.0 * i + 10, 100.0 * i + 15) for i in range(10)]
    record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(reqs, until_ms=1100.0, drain_ms=60.0)
    own = [p for p in policy.schedule.partitions if any(s.model == "vgg16" for s in p.slots)]
    assert own and all(profiles["vgg16"].latency(1, p.sms) > 5.0 for p in own)  # the case: its own SMs too few
    m = compute_metrics(record, models=["vgg16"]).models[0]
    assert m.arrived == 10 and m.on_time == 10 and not m.drops


def test_traffic_returning_to_a_model_without_slots_is_served_after_one_check_not_the_hold():
    """b's batch of one (12.6 ms) fits no gap between a's slots (every 5.9 ms): until a re-plan gives
    b slots, every request of b is dropped, even on an idle GPU. The re-plan waited for b's drift to
    last the replanner's hold (2 s): the first 12 of 20 dropped (a review, sixty-fourth session). Now
    the first check that sees b's traffic re-plans."""
    from gpuloom.policy.types import Request

    a = synthetic_profile("a", per_item_sm_ms=40.0, knee1=32)
    b = synthetic_profile("b", per_item_sm_ms=400.0, knee1=32)
    only_a = plan([Demand("a", rate=300, slo_ms=10)], ProfileStore(profiles=[a, b]))
    w = Workload((ModelSpec("a", 10.0, arrival=Arrival("poisson", rate=300)),
                  ModelSpec("b", 100.0, arrival=Arrival("poisson", rate=5))), duration_s=2)
    profiles = {"a": a, "b": b}
    reqs = [Request(id=i, model="b", arrival_ms=t, deadline_ms=t + 100.0)
            for i, t in enumerate(200.0 * i + 0.37 * i for i in range(20))]
    policy = make_policy("dstack", schedule=only_a)
    record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(reqs, until_ms=4100.0, drain_ms=10.0)
    m = compute_metrics(record, models=["b"]).models[0]
    assert m.arrived == 20 and m.on_time + m.drops.get("deadline", 0) == 20
    assert policy.replans == 1 and record.layouts[1][0] <= 500.0  # the second check (250 ms each)
    assert m.on_time >= 17


def test_on_shared_lanes_a_deadline_too_short_for_the_planned_share_runs_alone_on_the_whole_gpu():
    """On shared lanes a model's batches were sized, and its requests judged hopeless, at the SMs of the
    partition it was planned on, though its lane is the whole GPU: a client's 5 ms deadline for vgg16
    (6.35 ms on its planned 32 SMs, 2.18 ms on the whole GPU) was dropped 10 times of 10 on an idle GPU
    (a review, sixty-fourth session; clipper served them). With every lane free a batch runs alone."""
    from gpuloom.policy.types import Request

    profiles, w = _vgg16_beside_resnet50()
    policy = make_policy("dstack", lanes="shared")
    reqs = [Request(i, "vgg16", 100.0 * i + 10, 100.0 * i + 15) for i in range(10)]
    record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(reqs, until_ms=1100.0, drain_ms=60.0)
    planned = next(p.sms for p in policy.schedule.partitions if any(s.model == "vgg16" for s in p.slots))
    assert profiles["vgg16"].latency(1, planned) > 5.0 > profiles["vgg16"].latency(1, 132)  # the case
    m = compute_metrics(record, models=["vgg16"]).models[0]
    assert m.arrived == 10 and m.on_time == 10 and not m.drops


def test_on_shared_lanes_a_short_deadline_runs_alone_only_with_no_other_request_waiting():
    """Only alone: with another model's request waiting (or its batch on the GPU) the planned share's
    latencies stand. resnet50 keeps the GPU busy (a request every 0.5 ms): vgg16's 3 ms requests, which
    its share cannot serve in time, are dropped, not run beside resnet50 and late, and they do not hold
    vgg16's lane from its other requests (a review of the first version: with one every 1 ms, 3 of 50 of
    its 60 ms requests on time). With resnet50 every 2 ms, 5 ms requests find the GPU to themselves
    and run alone, on time."""
    from gpuloom.policy.types import Request

    profiles, w = _vgg16_beside_resnet50()
    for gap_ms, every_ms, deadline_ms, on_time in ((0.5, 100.0, 3.0, 0), (0.5, 1.0, 3.0, 0), (2.0, 100.0, 5.0, 9)):
        policy = make_policy("dstack", lanes="shared")
        busy = [Request(1000 + i, "resnet50", gap_ms * i, gap_ms * i + 25.0) for i in range(int(1000 / gap_ms))]
        n = 9 if every_ms == 100.0 else 900
        short = [Request(5000 + i, "vgg16", every_ms * i + 10, every_ms * i + 10 + deadline_ms) for i in range(n)]
        normal = [Request(100 + i, "vgg16", 20.0 * i + 1.1, 20.0 * i + 61.1) for i in range(50)]
        record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(
            sorted(busy + short + normal, key=lambda r: r.arrival_ms), until_ms=1100.0, drain_ms=60.0)
        fates = {r.request.id: r for r in record.results}
        assert len(fates) == len(busy) + len(short) + len(normal)  # every request accounted for
        assert sum(fates[r.id].on_time for r in short) == on_time
        assert all(fates[r.id].on_time or fates[r.id].status.name == "DROPPED" for r in short)  # none late
        assert all(fates[r.id].on_time for r in normal)
        assert all(fates[r.id].on_time for r in busy)

def test_models_whose_slos_fit_alone_but_not_together_are_raised_until_the_set_plans():
    """Two SLOs 1.3x their batch of one on the whole GPU: servable raised each alone, but the plan of
    both left mobilenet_v2 out (no one cycle halves to both periods) beside 68 unused SMs, and its
    requests were dropped on an idle GPU (a review, sixty-fourth session). The left-out model's SLO is
    raised until the set plans; its requests that can make their own deadline are served."""
    from gpuloom.plan import fits, servable
    from gpuloom.policy.types import Request
    from gpuloom.profile.synthetic import zoo

    profiles = {p.model: p for p in zoo() if p.model in ("resnet50", "mobilenet_v2")}
    store = ProfileStore(profiles=list(profiles.values()))
    asked = [Demand(m, rate=100, slo_ms=1.3 * p.latency(1, 132)) for m, p in profiles.items()]
    alone = [servable([d], store)[0] for d in asked]
    assert not fits([Demand(d.model, 1.0, d.slo_ms) for d in alone], store)  # the case
    got = servable(asked, store)
    assert fits([Demand(d.model, 1.0, d.slo_ms) for d in got], store)
    assert all(g.slo_ms >= a.slo_ms for g, a in zip(got, alone))
    sched = plan(got, store)
    assert all(mp.planned_rps > 0 for mp in sched.models)
    w = Workload(tuple(ModelSpec(d.model, d.slo_ms, arrival=Arrival("poisson", rate=d.rate)) for d in asked),
                 duration_s=2)
    # mobilenet_v2 alone on an idle GPU, each request with the SLO asked (0.54 ms; 0.41 ms a batch)
    slo = asked[1].slo_ms
    reqs = [Request(i, "mobilenet_v2", 50.0 * i + 3.7, 50.0 * i + 3.7 + slo) for i in range(20)]
    policy = make_policy("dstack", lanes="partitions")
    record = Runtime(policy, SimBackend(profiles), make_context(w, profiles)).run(reqs, until_ms=1100.0, drain_ms=10.0)
    m = compute_metrics(record, models=["mobilenet_v2"]).models[0]
    assert m.arrived == 20 and m.on_time == 20


def test_servable_raises_no_idle_models_demand_and_no_model_it_gave_up_on():
    """The set step counts only models with traffic (an idle resnet50 raised mobilenet_v2's SLO though
    the pair fits as asked) and leaves a model no SLO makes servable alone as asked (it was raised 40
    more times, and its huge SLO moved every other model's plan): a review, sixty-fifth session."""
    from gpuloom.plan import servable
    from gpuloom.profile.synthetic import zoo

    profiles = {p.model: p for p in zoo() if p.model in ("resnet50", "mobilenet_v2")}
    store = ProfileStore(profiles=list(profiles.values()))
    busy = Demand("mobilenet_v2", rate=100, slo_ms=2.0 * profiles["mobilenet_v2"].latency(1, 132))
    idle = Demand("resnet50", rate=0.0, slo_ms=1.3 * profiles["resnet50"].latency(1, 132))
    got = {d.model: d for d in servable([busy, idle], store)}
    assert got["mobilenet_v2"] == busy
    slow = synthetic_profile("slow", per_item_sm_ms=400.0, knee1=32)  # 12.6 ms on the whole GPU
    fast = synthetic_profile("fast", per_item_sm_ms=40.0, knee1=32)
    store = ProfileStore(profiles=[slow, fast])
    asked = [Demand("slow", rate=50, slo_ms=1.0), Demand("fast", rate=200, slo_ms=10)]
    assert servable(asked, store, tries=3) == asked  # 1.95 ms at most: never servable, left as asked
