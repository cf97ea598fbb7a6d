"""Profiles measured at a model's load, kept per GPU and fingerprint (gpuloom/profile/cache.py), and
the service's use of them: measured once, taken from the cache at the next load, measured again when
the model changes; a failed measurement leaves the load to a crude profile."""

from __future__ import annotations

import json
import types
import warnings

import pytest

from gpuloom.profile.cache import ProfileCache, default_cache_dir, fingerprint, op_name
from gpuloom.profile.synthetic import synthetic_profile

BASE = dict(name="m", input_shapes=[(16,)], input_dtypes=["float32"], max_batch=8, runner="engine",
            parameters=[("0.weight", (32, 16), "torch.float32")], ops=["aten.linear.default"])


def test_the_fingerprint_changes_with_everything_a_measured_profile_depends_on():
    fp = fingerprint(**BASE)
    assert fp == fingerprint(**BASE) and len(fp) == 16
    changed = dict(name="n", input_shapes=[(17,)], input_dtypes=["float16"], max_batch=16,
                   runner="engine:channels_last=true", parameters=[("0.weight", (33, 16), "torch.float32")],
                   ops=["aten.linear.default", "aten.relu.default"])
    for key, value in changed.items():
        assert fingerprint(**{**BASE, key: value}) != fp, key


def _kernel(y):
    return y


class _Stable:
    def __str__(self) -> str:
        return "aten.conv2d.default"


def test_an_operator_is_named_without_the_address_a_python_function_prints():
    assert str(_kernel).startswith("<function _kernel at 0x")  # what the fingerprint used to take
    assert op_name(_kernel) == f"{__name__}._kernel"
    again = types.FunctionType(_kernel.__code__, _kernel.__globals__, "_kernel")  # another process's copy
    assert again is not _kernel and op_name(again) == op_name(_kernel)
    assert op_name(_Stable()) == "aten.conv2d.default"  # torch's operators and builtins as before
    assert op_name(len) == str(len) and op_name("getattr") == "getattr"
    bare = object()  # no qualified name: its address is cut out
    assert op_name(bare) == "<object object>" and op_name(bare) == op_name(object())


def test_a_cached_profile_round_trips_per_gpu_and_a_torn_file_reads_as_none(tmp_path):
    p = synthetic_profile("m", per_item_sm_ms=20.0, knee1=32, batches=(1, 4))
    h200 = ProfileCache(tmp_path, "NVIDIA H200", 132)
    assert h200.get("m", "abc") is None
    path = h200.put("m", "abc", p)
    assert path.parent.name == "NVIDIA_H200-132sm" and h200.get("m", "abc") == p
    assert ProfileCache(tmp_path, "NVIDIA H100", 132).get("m", "abc") is None  # another GPU: not this one's
    path.write_text(path.read_text()[:40])
    assert h200.get("m", "abc") is None
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_the_cache_directory_follows_gpuloom_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("GPULOOM_PROFILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "gpuloom" / "profiles"
    monkeypatch.setenv("GPULOOM_PROFILE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


# -- the service ----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _compiled(width: int):
    import gpuloom
    from gpuloom.runtime.service import ModelConfig, TensorSpec

    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).eval()
    cm = gpuloom.compile(m, torch.randn(1, 16), max_batch=4, input_names=["x"], device="cpu")
    return ModelConfig("m", (TensorSpec("x", (16,), "float32"),), max_batch=4), cm


def _measuring(monkeypatch, fail: bool = False) -> list:
    """A GPU as far as measured_profile looks, and profile_model replaced by a recorder."""
    import gpuloom.gpu
    import gpuloom.profile.profiler as profiler

    calls = []
    facts = types.SimpleNamespace(name="NVIDIA H200", sm_count=132, grid=lambda: (8, 16, 132))
    monkeypatch.setattr(gpuloom.gpu, "device_facts", lambda device=0: facts)

    def measure(spec, *, batches, runner, device, predict, log):
        calls.append((spec.name, tuple(batches), runner.kind, runner.cm))
        if fail:
            raise RuntimeError("cuDNN could not run on 8 SMs")
        p = synthetic_profile(spec.name, per_item_sm_ms=20.0, knee1=32, batches=tuple(batches))
        return profiler.ProfileRun(profile=p, runner=runner.kind, seconds=0.1, setup_seconds=0.0)

    monkeypatch.setattr(profiler, "profile_model", measure)
    return calls


def _measure(cache_dir, config, cm):
    """What a service's load does to measure ``cm``'s profile on device 0, cached in ``cache_dir``."""
    from gpuloom.runtime.model_profiles import measured_profile

    return measured_profile(config, cm, types.SimpleNamespace(device=0), cache_dir)


def test_a_model_is_measured_once_then_taken_from_the_cache_and_measured_again_when_it_changes(monkeypatch, tmp_path):
    calls = _measuring(monkeypatch)
    config, cm = _compiled(32)
    first = _measure(tmp_path, config, cm)
    assert len(calls) == 1 and calls[0][:3] == ("m", (1, 2, 4), "engine") and calls[0][3] is cm  # no recompile
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["model"] == "m"
    again = _measure(tmp_path, *_compiled(32))
    assert again == first and len(calls) == 1  # a new process, the same model: from the cache
    _measure(tmp_path, *_compiled(64))  # wider: measured
    assert len(calls) == 2 and len(list(tmp_path.rglob("*.json"))) == 2
    _measure(None, *_compiled(32))  # no cache: measured
    assert len(calls) == 3


def test_a_graph_with_gpuloom_kernels_is_taken_from_the_cache_in_the_next_process(monkeypatch, tmp_path):
    """A fused op's target is a Python function (engine.epilogue.bias_act), a new object at another
    address in each process: the next start must still find its profile (run 156 measured it again)."""
    calls = _measuring(monkeypatch)
    config, cm = _compiled(32)
    cm.graph.ops[1].target = _kernel  # where a fused epilogue would stand
    _measure(tmp_path, config, cm)
    config, cm = _compiled(32)
    cm.graph.ops[1].target = types.FunctionType(_kernel.__code__, _kernel.__globals__, "_kernel")
    _measure(tmp_path, config, cm)
    assert len(calls) == 1 and len(list(tmp_path.rglob("*.json"))) == 1


def test_a_failed_measurement_is_a_warning_and_no_profile_so_the_load_goes_on_crudely(monkeypatch, tmp_path):
    _measuring(monkeypatch, fail=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _measure(tmp_path, *_compiled(32)) is None
    assert any("measuring its profile failed (RuntimeError: cuDNN could not run on 8 SMs)" in str(w.message)
               for w in seen), [str(w.message) for w in seen]
    assert not list(tmp_path.rglob("*.json"))


def test_serve_passes_its_profile_flags_to_the_service(tmp_path, monkeypatch):
    import argparse

    import gpuloom.runtime.service as service_mod
    from gpuloom.commands import serve

    seen = []

    def record(**kw):
        seen.append(kw)
        raise ValueError("recorded")

    monkeypatch.setattr(service_mod, "InferenceService", record)
    (tmp_path / "m.yaml").write_text("name: m\nsource: 'x.py:f'\ninputs: [{name: x, shape: [4], dtype: float32}]\n")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    for argv in ([], ["--profile-missing", "crude", "--profile-cache", "none"], ["--profile-cache", str(tmp_path)]):
        assert serve.run(p.parse_args([str(tmp_path / "m.yaml"), "--http-port", "0", "--no-grpc", *argv])) == 2
    assert [(kw["measure_profiles"], kw["profile_cache"]) for kw in seen] == [
        (True, "default"), (False, None), (True, str(tmp_path))]


def test_a_cache_that_cannot_be_written_still_serves_the_measured_profile(monkeypatch, tmp_path):
    calls = _measuring(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prof = _measure(blocker / "cache", *_compiled(32))
    assert prof is not None and prof.model == "m" and len(calls) == 1
    assert not [w for w in seen if "failed" in str(w.message)], [str(w.message) for w in seen]


def _stored_profile_service(monkeypatch, runner: str, measure: bool = True):
    """How a service on a CUDA device (a stand-in) picks the profile of "m" when its store holds one
    timed as ``runner``: ``profile(config, compiled)``; a measurement at load returns a marker profile."""
    import dataclasses

    import gpuloom.runtime.model_profiles as model_profiles
    from gpuloom.profile.store import ProfileStore

    stored = dataclasses.replace(synthetic_profile("m", per_item_sm_ms=20.0, batches=(1, 2, 4),
                                                   input_shapes=((3, 6, 6),)), runner=runner)
    store = ProfileStore()
    store.put(stored)
    dev = types.SimpleNamespace(kind="cuda", gpu_sms=stored.gpu.sm_count, expected_ms=lambda *a: None)
    measured = synthetic_profile("m", per_item_sm_ms=5.0, batches=(1, 2, 4), input_shapes=((3, 6, 6),))
    calls = []
    monkeypatch.setattr(model_profiles, "measured_profile",
                        lambda config, cm, device, cache_dir: calls.append(config.name) or measured)

    def profile(config, cm):
        return model_profiles.profile_for(config, cm, dev, store, measure=measure, cache_dir=None)
    return profile, stored, measured, calls


def test_a_stored_profile_of_other_graphs_than_the_model_compiles_is_measured_again(monkeypatch):
    # the shipped profiles timed the plain engine's graphs: a model whose config's engine options
    # change what it compiles (here its squeeze-excitation gate as gpuloom's kernels, the default since
    # the forty-fourth session) is planned with a profile of its own graphs, measured at load; an option
    # that changed nothing keeps the stored one; and the other way round, a stored profile of the
    # kernels does not plan a model configured without them
    import gpuloom
    from gpuloom.runtime.model_profiles import compiled_kind
    from gpuloom.runtime.service import ModelConfig, TensorSpec
    from engine_models import TinySqueezeExcite

    spec = (TensorSpec("x", (3, 6, 6), "float32"),)
    gated = gpuloom.compile(TinySqueezeExcite().eval(), torch.randn(1, 3, 6, 6), max_batch=4, input_names=["x"],
                            fuse_gates=True, fuse_epilogues=True)
    plain_net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 5)).eval()
    plain = gpuloom.compile(plain_net, torch.randn(1, 3, 6, 6), max_batch=4, input_names=["x"], fuse_epilogues=True)
    kernels = ModelConfig("m", spec, max_batch=4, fuse_epilogues=True)
    assert compiled_kind(kernels, gated) == "engine:fuse_epilogues=true"
    assert compiled_kind(kernels, plain) == "engine"  # nothing for the option to fuse: the default's graph
    assert ModelConfig("m", spec, max_batch=4).fuse_epilogues  # on by default
    opted_out = ModelConfig("m", spec, max_batch=4, fuse_epilogues=False)
    assert compiled_kind(opted_out, gated) == "engine"  # (the service refuses it anyway)

    profile, stored, measured, calls = _stored_profile_service(monkeypatch, "engine")
    assert profile(kernels, gated) == measured and calls == ["m"]
    assert profile(kernels, plain) == stored and calls == ["m"]
    assert profile(opted_out, plain) == stored and calls == ["m"]
    profile, stored, measured, calls = _stored_profile_service(monkeypatch, "engine:fuse_epilogues=true")
    assert profile(kernels, gated) == stored and not calls  # a profile made with the same options
    assert profile(opted_out, plain) == measured and calls == ["m"]  # the kernels' profile: not its
    for plain_name in ("graph", ""):  # the eager forward's graph, an older unnamed profile: the plain engine's
        profile, stored, measured, calls = _stored_profile_service(monkeypatch, plain_name)
        assert profile(opted_out, plain) == stored and not calls
    profile, stored, measured, calls = _stored_profile_service(monkeypatch, "graph", measure=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert profile(kernels, gated) == stored and not calls  # not measured: the stored one, said
    assert any("timed 'graph' graphs, the model compiles as 'engine:fuse_epilogues=true'" in str(w.message)
               for w in seen), [str(w.message) for w in seen]
