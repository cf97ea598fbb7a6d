"""A re-plan's layout is built while the current one serves (policies with ``defers_layout_change``)."""

from __future__ import annotations

import pytest

from gpuloom.bench.experiment import make_context, make_requests
from gpuloom.bench.workload import Arrival, ModelSpec, Workload
from gpuloom.policy.base import Policy
from gpuloom.policy.types import Decision, Layout, Partition, Status
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import zoo
from gpuloom.runtime.core import Runtime
from gpuloom.runtime.sim import SimBackend

ZOO = ProfileStore(profiles=zoo())
PROFS = {"resnet50": ZOO.get("resnet50")}
WHOLE = Layout((Partition(0, 0, 132, shared=False, label="whole"),), 132)
HALVES = Layout((Partition(0, 0, 64, shared=False, label="left"), Partition(1, 64, 68, shared=False, label="right")), 132)


class SlowBuilds(SimBackend):
    """A simulated GPU that takes ``build_ms`` to build a layout while the current one runs (as the
    CUDA layer captures graphs), and refuses to set up the layouts in ``refuse``."""

    builds_while_serving = True

    def __init__(self, *args, build_ms: float, refuse: tuple[Layout, ...] = (), **kw) -> None:
        super().__init__(*args, **kw)
        self.build_ms, self.refuse = build_ms, refuse
        self.loop.post = lambda prio, cb, *a: self.loop.schedule(self.loop.now, prio, cb, *a)

    def prepare(self, layout, ready) -> bool:
        if self._layout is None:
            return False  # the first layout: set up at once
        self.loop.schedule(self.loop.now + self.build_ms, 0, ready)
        return True

    def configure(self, layout) -> float:
        if layout in self.refuse:
            raise RuntimeError("out of graph memory (test)")
        return super().configure(layout)


class Resplit(Policy):
    """Serves one model FIFO, a batch of one on every free partition; at ``at_ms`` proposes HALVES
    and decides for WHOLE until the runtime says HALVES is set up."""

    name = "resplit-test"
    defers_layout_change = True

    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.current, self.proposed = at_ms, WHOLE, None
        self.adopted_at: float | None = None
        self.proposed_at: float | None = None
        self.failed: list[Layout] = []
        self.now = 0.0
        self.decided_on: list[tuple[float, str]] = []  # (time, partition label) of each dispatch

    def layout(self, ctx):
        return WHOLE

    def decide(self, now_ms, queues, free):
        self.now = now_ms
        (m, q), = queues.items()
        out = []
        for p, r in zip(free, q):
            assert p.label in {x.label for x in self.current.partitions}, (p.label, self.current)
            self.decided_on.append((now_ms, p.label))
            out.append(Decision(m, (r.id,), 1, p.index))
        return out

    def next_wakeup(self, now_ms):
        self.now = now_ms
        return self.at_ms if self.proposed is None and now_ms < self.at_ms else None

    def layout_change(self):
        if self.proposed is None and self.now >= self.at_ms:
            self.proposed, self.proposed_at = HALVES, self.now
            return HALVES
        return None

    def adopt_layout(self, layout, now_ms):
        assert layout is self.proposed
        self.current, self.adopted_at = layout, now_ms

    def layout_failed(self, layout):
        self.failed.append(layout)


def _run(policy: Policy, backend: SimBackend, duration_ms: float = 400.0):
    wl = Workload((ModelSpec("resnet50", 200.0, arrival=Arrival("poisson", rate=400.0)),), duration_s=duration_ms / 1000)
    ctx = make_context(wl, PROFS)
    rec = Runtime(policy, backend, ctx).run(make_requests(wl), until_ms=duration_ms, drain_ms=200.0)
    return rec


def test_the_current_layout_serves_while_the_replans_is_built_then_the_policy_switches():
    pol = Resplit(at_ms=100.0)
    rec = _run(pol, SlowBuilds(PROFS, build_ms=150.0))
    t0 = pol.proposed_at
    assert 100.0 <= t0 < 120.0 and pol.adopted_at == pytest.approx(t0 + 150.0)  # built 150 ms after it was asked for
    during = [label for t, label in pol.decided_on if t0 < t < t0 + 150.0]
    assert len(during) > 30 and set(during) == {"whole"}  # dispatched on the old layout throughout the build
    after = {label for t, label in pol.decided_on if t > t0 + 150.0}
    assert after == {"left", "right"}
    assert [len(layout.partitions) for _, layout in rec.layouts] == [1, 2]
    assert all(r.status == Status.SERVED for r in rec.results)


def test_a_replans_layout_that_cannot_be_set_up_leaves_the_current_one_serving():
    pol = Resplit(at_ms=100.0)
    rec = _run(pol, SlowBuilds(PROFS, build_ms=150.0, refuse=(HALVES,)))
    assert pol.failed == [HALVES] and pol.adopted_at is None
    assert {label for _, label in pol.decided_on} == {"whole"}
    assert [len(layout.partitions) for _, layout in rec.layouts] == [1]
    assert all(r.status == Status.SERVED for r in rec.results)


class RefuseReplans(SlowBuilds):
    """Builds every re-plan's layout, then cannot set any of them up (out of graph memory, say)."""

    def configure(self, layout) -> float:
        if self._layout is not None:
            raise RuntimeError("out of graph memory (test)")
        return super().configure(layout)


def test_dstack_goes_on_with_its_plan_when_a_replans_layout_cannot_be_set_up_and_tries_again_later():
    import dataclasses

    from gpuloom.bench.workload import load_workload
    from gpuloom.policy import make_policy

    wl = dataclasses.replace(load_workload("examples/shift.yaml"), duration_s=30)  # mobilenet_v2 doubles at 20 s
    profs = {m.name: ProfileStore.builtin("h200").get(m.name) for m in wl.models}
    pol = make_policy("dstack")
    rec = Runtime(pol, RefuseReplans(profs, build_ms=50.0), make_context(wl, profs)).run(
        make_requests(wl), until_ms=wl.duration_s * 1000, drain_ms=200.0)
    assert pol.replans >= 1  # it asked, after the shift ...
    assert len(rec.layouts) == 1  # ... and every re-plan was refused: the first layout served throughout
    assert pol.replanner.schedule is pol.schedule  # the replanner drifts from the plan that runs
    assert pol.replanner.planned_rates == {m: i.rate for m, i in pol.ctx.models.items()}  # as first planned
    served = sum(r.status == Status.SERVED for r in rec.results)
    assert served > 0.9 * len(rec.results)


def test_dstack_proposes_no_second_replan_while_the_first_ones_layout_is_being_built():
    from gpuloom.bench.workload import load_workload
    from gpuloom.policy import make_policy

    wl = load_workload("examples/shift.yaml")  # mobilenet_v2 doubles at 20 s, efficientnet_b0 fades at 40 s
    profs = {m.name: ProfileStore.builtin("h200").get(m.name) for m in wl.models}
    pol = make_policy("dstack")
    rec = Runtime(pol, SlowBuilds(profs, build_ms=60_000.0), make_context(wl, profs)).run(
        make_requests(wl), until_ms=wl.duration_s * 1000, drain_ms=200.0)
    # asked once, after the first shift; the second shift came while that layout was being built
    # (60 s), and no re-plan overtook it: the one layout swapped in is the first one's
    assert pol.replans == 1 and len(rec.layouts) == 2
