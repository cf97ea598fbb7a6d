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
    assert not plan([Demand("slow", rate=50, slo_ms=10)], store).partitions
    w = Workload((ModelSpec("slow", 10.0, arrival=Arrival("poisson", rate=50)),), duration_s=2)
    profiles = {"slow": slow}
    ctx = make_context(w, profiles)
    policy = make_policy("dstack")
    record = Runtime(policy, SimBackend(profiles), ctx).run(make_requests(w), until_ms=2000.0, drain_ms=10.0)
    assert [p.sms for p in record.layouts[0][1].partitions] == [132]
    m = compute_metrics(record, models=["slow"])
    assert m.arrived > 50
    assert m.served + m.dropped + m.failed + m.queued == m.arrived  # every request accounted for
    assert m.drops.get("deadline", 0) > 0 and m.on_time == 0
