"""A workload's world on a fake GPU that runs as profiled: the runtime's and the server's host side,
measured on any machine.

Why: what separates the GPU hosts in issue 5's overload and issue 6's HTTP legs is the host's Python
(the loop's intake, answers and decisions), not the GPU. A CPU-only run of the real service on real
models (``--tiny`` MLPs on the CPU device) spends its cores on the models' arithmetic; here the
device takes no CPU at all: each batch "runs" for its shipped H200 profile's latency on its partition
(:class:`~gpuloom.runtime.host_device.ProfiledFakeLayer`), ``slow`` times longer, with SLOs ``slow``
times longer, so a small machine keeps up with the same overload at rates ``1 / slow`` of the GPU's.
Each model reads and returns one 4-float row: requests carry the protocol's per-request work, not
real images' bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .workload import Workload

#: what each fake model takes and returns: one row of 4 floats
ROW_SHAPE = (4,)


def fake_world(workload: Workload, slow: float, max_batch: int) -> tuple[Workload, dict[str, Any]]:
    """``(workload with SLOs slow times longer, {model: its shipped H200 profile slow times slower, cut to
    max_batch, taking one 4-float row})``."""
    from ..plan.slowdown import slowed
    from ..profile.store import ProfileStore
    from ..runtime.model_profiles import trim_profile

    if not slow >= 1.0:
        raise ValueError(f"slow must be >= 1 (the fake device as fast as the H200 or slower), got {slow!r}")
    wl = dataclasses.replace(workload, models=tuple(dataclasses.replace(m, slo_ms=m.slo_ms * slow)
                                                    for m in workload.models))
    store = ProfileStore.builtin("h200")
    profiles = {m.name: dataclasses.replace(trim_profile(slowed(store.get(m.name), slow), max_batch),
                                            input_shapes=(ROW_SHAPE,))
                for m in wl.models}
    return wl, profiles


def fake_models(workload: Workload, max_batch: int, rate_scale: float = 1.0) -> dict[str, tuple[Any, Any]]:
    """``{name: (ModelConfig, FakeModel)}`` for ``fake_world``'s workload: each model returns its input
    row (so a reply can be checked against its request); ``rate_scale`` times the workload's rates as
    each model's rate hint (the plan's)."""
    from ..runtime.host_device import FakeModel
    from ..runtime.service import ModelConfig, TensorSpec

    row = (TensorSpec("x", ROW_SHAPE, "float32"),)
    return {m.name: (ModelConfig(m.name, row, row, max_batch=max_batch, slo_ms=m.slo_ms, weight=m.weight,
                                 rate_hint=workload.mean_rate(m) * rate_scale),
                     FakeModel(lambda xs: [xs[0]]))
            for m in workload.models}


def fake_service(policy: str, profiles: dict[str, Any], **options: Any) -> Any:
    """An ``InferenceService`` (not started) for ``policy`` on a :class:`ProfiledFakeLayer` of ``profiles``
    (planned from the same profiles; none measured at load)."""
    from ..profile.store import ProfileStore
    from ..runtime.host_device import ProfiledFakeLayer
    from ..runtime.service import InferenceService

    return InferenceService(policy=policy, device_layer=ProfiledFakeLayer(profiles),
                            profiles=ProfileStore(profiles=profiles.values()), measure_profiles=False, **options)
