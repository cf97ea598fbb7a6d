"""gpuloom.bench.fake: a workload's world on a fake GPU that runs as profiled (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuloom.bench.fake import fake_models, fake_service, fake_world
from gpuloom.bench.workload import load_workload
from gpuloom.profile.store import ProfileStore

OVERLOAD = Path(__file__).resolve().parents[1] / "examples" / "overload.yaml"


def test_the_fake_world_is_the_workload_slowed_evenly_and_cut_to_the_max_batch():
    wl0 = load_workload(str(OVERLOAD))
    wl, profiles = fake_world(wl0, 4.0, 16)
    assert [m.slo_ms for m in wl.models] == [4.0 * m.slo_ms for m in wl0.models]
    assert [wl.mean_rate(m) for m in wl.models] == [wl0.mean_rate(m) for m in wl0.models]  # rates are --scale's
    assert set(profiles) == {m.name for m in wl.models}
    store = ProfileStore.builtin("h200")
    for name, p in profiles.items():
        assert max(p.batches) == 16 and p.input_shapes == ((4,),)  # one row of 4 floats, as the fake models read
        assert p.latency(8, 132) == pytest.approx(4.0 * store.get(name).latency(8, 132))
    with pytest.raises(ValueError, match="slow must be >= 1"):
        fake_world(wl0, 0.5, 16)


def test_a_fake_service_serves_each_model_its_own_row_back_within_its_slowed_latency():
    wl, profiles = fake_world(load_workload(str(OVERLOAD)), 2.0, 8)
    models = fake_models(wl, 8, rate_scale=0.01)
    assert {cfg.rate_hint for cfg, _ in models.values()} == {wl.mean_rate(m) * 0.01 for m in wl.models}
    svc = fake_service("nexus", profiles)
    svc.start()
    try:
        svc.load_many(list(models.values()))
        rows = {name: np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)
                for i, name in enumerate(models)}
        futs = {name: svc.submit(name, {"x": x}, deadline_ms=60_000) for name, x in rows.items()}
        for name, f in futs.items():
            out = f.result(30)
            assert np.array_equal(out["x"], rows[name])
        assert svc.device.kind == "fake" and type(svc.device).__name__ == "ProfiledFakeLayer"
    finally:
        svc.close(drain=False, timeout_s=10)
