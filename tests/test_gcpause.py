"""Garbage-collector pauses: the monitor times them, and the service keeps loaded models out of them
without keeping an unloaded model alive. CPU only, about a second."""

from __future__ import annotations

import gc
import time
import warnings
import weakref

import numpy as np
import pytest

from gpuloom.runtime.host_device import FakeDeviceLayer, FakeModel
from gpuloom.runtime.gcpause import GcMonitor, freeze_loaded, thaw
from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

X4 = (TensorSpec("x", (4,), "float32"),)
Y4 = (TensorSpec("y", (4,), "float32"),)


@pytest.fixture(autouse=True)
def _thawed():
    thaw()
    yield
    thaw()


def test_the_monitor_times_every_collection_and_reports_those_of_a_window():
    mon = GcMonitor.installed()
    assert GcMonitor.installed() is mon  # one per process
    before = mon.snapshot()
    t = time.monotonic()
    gc.collect()
    after = mon.snapshot()
    assert after["collections"][2] == before["collections"][2] + 1
    assert after["total_ms"] > before["total_ms"] and after["max_ms"] > 0
    window = mon.since(t)
    assert window["collections"][2] >= 1 and window["max_ms"] > 0
    assert mon.since(time.monotonic())["collections"] == [0, 0, 0]


def test_a_later_load_and_a_stats_snapshot_do_not_walk_the_frozen_heap():
    """Both hold the GIL, so every served model waits for them: counting the frozen objects
    (gc.get_freeze_count, a walk of the whole list) made a load in the test suite's large heap hold
    up another model's request for 0.1 s."""
    keep = [[i] for i in range(1_500_000)]
    gc.collect()
    gc.freeze()  # what earlier loads froze
    t0 = time.perf_counter()
    assert gc.get_freeze_count() >= len(keep)
    count_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    freeze_loaded(collect=False)  # a later load: nothing collected, nothing counted
    freeze_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    GcMonitor.installed().snapshot()
    snapshot_ms = (time.perf_counter() - t0) * 1000
    assert freeze_ms < count_ms / 5 and snapshot_ms < count_ms / 5, (freeze_ms, snapshot_ms, count_ms)


def test_freezing_takes_what_is_alive_out_of_full_collections():
    keep = [[i] for i in range(200_000)]  # many tracked objects, like a compiled model's graph
    t0 = time.perf_counter()
    gc.collect()
    unfrozen_ms = (time.perf_counter() - t0) * 1000
    freeze_loaded()
    assert gc.get_freeze_count() >= len(keep)
    t0 = time.perf_counter()
    gc.collect()
    frozen_ms = (time.perf_counter() - t0) * 1000
    assert frozen_ms < unfrozen_ms / 2, (frozen_ms, unfrozen_ms)
    thaw()
    assert gc.get_freeze_count() == 0


class CyclicModel(FakeModel):
    """A model whose objects form a reference cycle, as an FX graph's nodes and graph do."""


def _service(**kw) -> InferenceService:
    svc = InferenceService(policy="triton", device_layer=FakeDeviceLayer(), **kw)
    svc.start()
    return svc


def _load(svc: InferenceService, name: str) -> weakref.ref:
    m = CyclicModel(lambda xs: [xs[0] * 2], 0.5)
    m.me = m  # the cycle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no profile: a crude one
        svc.load(ModelConfig(name, X4, Y4, max_batch=4, slo_ms=500), m)
    return weakref.ref(m)


def test_a_loaded_service_is_frozen_and_an_unloaded_models_cycles_are_still_collected():
    svc = _service()
    try:
        gone = _load(svc, "a")
        _load(svc, "b")
        assert gc.get_freeze_count() > 0
        out = svc.infer("b", {"x": np.ones((1, 4), np.float32)}, timeout_s=10)
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2.0, np.float32))
        svc.unload("a")
        # the unload thaws without a collection of its own (that would stop "b" mid-service): the
        # next full collection frees the unloaded model, which freezing had kept out of reach
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert gone() is None
    finally:
        svc.close()
    assert gc.get_freeze_count() == 0  # close hands everything back to the collector


def test_a_load_right_after_an_unload_leaves_the_unloaded_models_cycles_collectable():
    # a load froze everything alive, the unloaded model's uncollected cycles too: for good (the soak's
    # unload/load cycles kept 6 graph modules a cycle). Now the freeze waits for a full collection.
    svc = _service()
    gc.disable()  # no automatic collection between the unload and the load: the case that leaked
    try:
        gone = _load(svc, "a")
        _load(svc, "b")
        svc.unload("a")
        _load(svc, "c")
        assert gc.get_freeze_count() == 0  # not frozen: "a" is still uncollected garbage
        gc.collect()
        assert gone() is None
        assert gc.get_freeze_count() > 0  # that full collection froze what survived: "b" and "c"
        out = svc.infer("c", {"x": np.ones((1, 4), np.float32)}, timeout_s=10)
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2.0, np.float32))
    finally:
        gc.enable()
        svc.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gc.get_freeze_count() == 0  # close's thaw freezes nothing again


def test_a_thaw_during_a_loads_collection_leaves_the_freeze_to_its_own_collection(monkeypatch):
    from gpuloom.runtime import gcpause

    real_collect = gc.collect

    def collect_while_another_thread_unloads(*a):
        n = real_collect(*a)
        thaw(refreeze=True)  # an unload elsewhere, after the load's collection ran
        return n

    monkeypatch.setattr(gcpause.gc, "collect", collect_while_another_thread_unloads)
    try:
        freeze_loaded(collect=True)
        assert gc.get_freeze_count() == 0  # the unload's garbage is uncollected: not frozen
        assert gcpause._Refreeze.pending
    finally:
        monkeypatch.undo()
        thaw()


def test_closing_one_service_leaves_the_others_models_to_be_frozen_again():
    a, b = _service(), _service()
    try:
        _load(a, "a")
        _load(b, "b")
        a.close()  # thaws everything; "b" is still served
        gc.collect()
        assert gc.get_freeze_count() > 0  # the next full collection froze what "b" holds again
    finally:
        a.close()
        b.close()
    gc.collect()
    assert gc.get_freeze_count() == 0  # the last close freezes nothing again


def test_freezing_can_be_turned_off():
    svc = _service(tune_gc=False)
    try:
        _load(svc, "a")
        assert gc.get_freeze_count() == 0
    finally:
        svc.close()


def test_an_unloaded_model_is_not_kept_alive_by_the_layout_built_without_it():
    # the re-plan after an unload used to build while the model was still on the device, so the
    # serving build kept its graphs and weights until the next layout change
    svc = _service(tune_gc=False)
    try:
        gone = _load(svc, "a")
        _load(svc, "b")
        svc.unload("a")
        gc.collect()
        assert gone() is None
    finally:
        svc.close()


def test_full_collections_are_rarer_while_a_service_runs_and_the_thresholds_come_back_after():
    before = gc.get_threshold()
    a, b = _service(), _service()
    try:
        assert gc.get_threshold()[2] == before[2] * 100 and gc.get_threshold()[:2] == before[:2]
        a.close()
        assert gc.get_threshold()[2] == before[2] * 100  # the other service still runs
    finally:
        a.close()
        b.close()
    assert gc.get_threshold() == before
    off = _service(tune_gc=False)
    try:
        assert gc.get_threshold() == before
    finally:
        off.close()
