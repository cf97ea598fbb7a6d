"""The model repository: parsing, sources, safe weights, clear errors."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402,F401  (provides gpuloom.runtime.service until the runtime lands)

import torch  # noqa: E402

from gpuloom.engine.options import ENGINE_DEFAULTS  # noqa: E402
from gpuloom.serve.repository import RepositoryError, load_repository, load_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"


def test_example_repository_reads_and_builds_with_its_weights():
    repo = load_repository(REPO)
    assert repo.names() == ["mobilenet_v3_small", "tiny_cnn", "tiny_mlp"]
    config, module = repo.models["tiny_mlp"].build()
    assert config.max_batch == 16 and config.slo_ms == 50.0 and config.inputs[0].shape == (16,)
    from safetensors.torch import load_file

    want = load_file(str(REPO / "tiny_mlp.safetensors"))
    assert torch.equal(module.state_dict()["net.0.weight"], want["net.0.weight"])
    assert not module.training


def test_channels_last_and_fusion_reach_the_model_config(tmp_path):
    text = (REPO / "tiny_cnn.yaml").read_text() + "\nchannels_last: auto\nfuse_convolutions: channels_last\nsplit_gemms: true\nfuse_epilogues: true\n"
    path = tmp_path / "tiny_cnn.yaml"
    path.write_text(text)
    (tmp_path / "nets.py").write_text((REPO / "nets.py").read_text())
    config, _ = load_repository(path).models["tiny_cnn"].build()
    assert config.channels_last == "auto" and config.fuse_convolutions == "channels_last" and config.split_gemms is True
    assert config.fuse_epilogues is True
    off = text.replace("fuse_epilogues: true", "fuse_epilogues: false")
    path.write_text(off)
    assert load_repository(path).models["tiny_cnn"].build()[0].fuse_epilogues is False
    # a YAML that does not name them gets ModelConfig's defaults: gpuloom's kernels on (the parser once
    # said False for every key, and served models ran without them: H100 run 149)
    default, _ = load_repository(REPO / "tiny_cnn.yaml").models["tiny_cnn"].build()
    assert default.channels_last is False and default.fuse_convolutions is False and default.split_gemms is False
    assert default.fuse_epilogues is True
    from gpuloom.runtime.model_config import ModelConfig, TensorSpec

    bare = ModelConfig("m", inputs=(TensorSpec("x", (4,), "float32"),))
    assert {key: getattr(default, key) for key in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
    assert {key: getattr(bare, key) for key in ENGINE_DEFAULTS} == ENGINE_DEFAULTS


def test_outputs_are_found_by_running_the_model_when_not_written():
    config, _ = load_repository(REPO / "tiny_cnn.yaml").models["tiny_cnn"].build()
    assert [(o.name, o.shape, o.dtype) for o in config.outputs] == [("logits", (10,), "float32"), ("embedding", (8,), "float32")]


def _write(tmp_path, text, name="m.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, needle", [
    ("name: a\nsource: torchvision:resnet18\n", "inputs: expected a non-empty list"),
    ("name: a\ninputs: [{name: x, shape: [3]}]\n", "'source'"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nslo: 5\n", "unknown keys ['slo']"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3], dtype: float99}]\n", "unknown dtype 'float99'"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [0]}]\n", "shape must be a list of positive ints"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shap: [3]}]\n", "'x': unknown keys ['shap']"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\noutputs: [{name: y, type: float32}]\n",
     "outputs[0] 'y': unknown keys ['type']"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3], dtype: float}]\n", "dtype 'float' is ambiguous; write 'float64'"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nmax_batch: 0\n", "max_batch must be a positive integer"),
    ("models: [{name: a, source: 'x:y', inputs: [{name: x}]}, {name: a, source: 'x:y', inputs: [{name: x}]}]\n", "defined twice"),
    ("name: [\n", "not valid YAML"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nchannels_last: yes please\n",
     "channels_last must be true, false or auto"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nfuse_convolutions: nhwc\n",
     "fuse_convolutions must be true, false or channels_last"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nsplit_gemms: 1\n",
     "split_gemms must be true or false, found 1"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nfuse_epilogues: yes please\n",
     "fuse_epilogues must be true or false, found 'yes please'"),
    # a review (sixty-fourth session): each passed the parse and failed later, or took the server down
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nrate_hint: .inf\n",
     "rate_hint must be a positive finite number, found inf"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nslo_ms: 1.0e+12\n",
     "slo_ms must be at most 3600000 (an hour)"),
    # (sixty-fifth session) 1e8 built its batch-bucket table and example inputs for 28 s and 9.3 GB at load
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nmax_batch: 100000000\n",
     "model 'a': max_batch must be at most 65536 rows, found 100000000"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nrate_hint: 1.0e308\n",
     "write 1.0e+308"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nweights: 5\n",
     "'weights' must be a file path (a string), found 5"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3, -1, -1]}]\n",
     "shape must be a list of positive ints per sample (no batch dimension, no -1"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3], dtype: object}]\n",
     "dtype 'object' is not served; one of"),
    ("name: a\nsource: x:y\ninputs: [{name: x, shape: [3], dtype: uint16}]\n",
     "dtype 'uint16' is not served"),
])
def test_repository_mistakes_name_the_field(tmp_path, text, needle):
    with pytest.raises(RepositoryError, match=None) as e:
        load_repository(_write(tmp_path, text))
    assert needle in str(e.value)


def test_missing_repository_and_bad_source_are_clear(tmp_path):
    with pytest.raises(RepositoryError, match="does not exist"):
        load_repository(tmp_path / "nope")
    repo = load_repository(_write(tmp_path, "name: a\nsource: no_such_module_xyz:f\ninputs: [{name: x, shape: [3]}]\n"))
    with pytest.raises(RepositoryError, match="cannot import module 'no_such_module_xyz'"):
        repo.models["a"].build()
    repo = load_repository(_write(tmp_path, "name: a\nsource: 'torch.nn:Identity'\ninputs: [{name: x, shape: [3]}]\nweights: w.pt\n"))
    with pytest.raises(RepositoryError, match="w.pt does not exist"):
        repo.models["a"].build()


class _Evil:
    def __reduce__(self):  # unpickling this would run code
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the attack file: it is refused
def test_weights_are_never_unpickled_as_objects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"w": _Evil()}, f)
    with pytest.raises(RepositoryError, match="weights_only=True"):
        load_weights(bad)
    assert not (tmp_path / "PWNED").exists()
    good = tmp_path / "ok.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), good)
    assert set(load_weights(good)) == {"weight", "bias"}


def test_a_corrupt_safetensors_file_or_a_directory_as_weights_is_named_in_the_error(tmp_path):
    """(Before: safetensors' own "header too large", naming neither file nor model; a directory was said
    not to exist. A review, sixty-fourth session.)"""
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(RepositoryError, match=r"weights .*w\.safetensors: not a readable \.safetensors file"):
        load_weights(bad)
    with pytest.raises(RepositoryError, match="is a directory, not a file"):
        load_weights(tmp_path)


def test_module_factory_with_state_dict_weights_and_torchvision_source(tmp_path):
    lin = torch.nn.Linear(3, 2)
    torch.save(lin.state_dict(), tmp_path / "lin.pt")
    p = _write(tmp_path, "models:\n  - {name: lin, source: 'torch.nn:Linear', kwargs: {in_features: 3, out_features: 2}, weights: lin.pt,"
                         " inputs: [{name: x, shape: [3]}]}\n  - {name: sq, source: 'torchvision:squeezenet1_1', kwargs: {num_classes: 5},"
                         " inputs: [{name: img, shape: [3, 32, 32]}], outputs: [{name: out, shape: [5]}]}\n")
    repo = load_repository(p)
    config, module = repo.models["lin"].build()
    assert torch.equal(module.weight, lin.weight) and config.outputs[0].shape == (2,)
    config, module = repo.models["sq"].build()
    assert config.outputs[0].name == "out" and module(torch.zeros(1, 3, 32, 32)).shape == (1, 5)


FACTORY_CLASS_PY = '''import torch


class Pretrained(torch.nn.Linear):
    @classmethod
    def from_pretrained(cls, path, use_cache=True):  # as transformers' AutoModel.from_pretrained(directory)
        m = cls(3, 2)
        m.load_state_dict(torch.load(path, weights_only=True))
        m.use_cache = use_cache
        return m
'''


def test_a_dotted_factory_reaches_a_class_method_as_transformers_from_pretrained(tmp_path):
    # source: transformers:AutoModel.from_pretrained, kwargs: {pretrained_model_name_or_path: DIR}
    # serves a Hugging Face model without a factory file; shown here with a module of our own
    (tmp_path / "pretrained_mod.py").write_text(FACTORY_CLASS_PY)
    lin = torch.nn.Linear(3, 2)
    torch.save(lin.state_dict(), tmp_path / "w.pt")
    p = _write(tmp_path, "name: a\nsource: pretrained_mod.py:Pretrained.from_pretrained\n"
                         f"kwargs: {{path: '{tmp_path / 'w.pt'}', use_cache: false}}\ninputs: [{{name: x, shape: [3]}}]\n")
    config, module = load_repository(p).models["a"].build()
    assert torch.equal(module.weight, lin.weight) and module.use_cache is False and config.outputs[0].shape == (2,)
    bad = _write(tmp_path, "name: b\nsource: pretrained_mod.py:Pretrained.nope\ninputs: [{name: x, shape: [3]}]\n")
    with pytest.raises(RepositoryError, match="has no callable 'Pretrained.nope'"):
        load_repository(bad).models["b"].build()


# -- re-reading the repository: edited model files, one bad entry, the index, logs, unload ----------
MODEL_PY = '''import torch

SCALE = 1.0
BUILDS = []  # module-level state: one list per build when the file is run afresh


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * SCALE


def make():
    BUILDS.append(1)
    return Scale()


def broken(width=4):
    raise ValueError(f"width {width} is not supported")
'''

MODEL_YAML = """name: {name}
source: model.py:{factory}
inputs: [{{name: x, shape: [4], dtype: float32}}]
outputs: [{{name: y, shape: [4], dtype: float32}}]
max_batch: 4
slo_ms: 2000
"""


def _model_dir(root, name="m", factory="make", text=MODEL_PY):
    """``root/name/config.yaml`` and ``root/name/model.py``: a Triton-like model directory."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(text)
    (d / "config.yaml").write_text(MODEL_YAML.format(name=name, factory=factory))
    return d


def _core(tmp_path, service=None):
    """A ServeCore over the repository ``tmp_path`` (valid when this is called, as `gpuloom serve` checks)."""
    from gpuloom.serve.core import ServeCore

    return ServeCore(service or serve_fake.FakeService(), load_repository(tmp_path))


def _infer(core, name):
    import numpy as np

    fut, _ = core.submit(name, None, {"x": np.ones((1, 4), np.float32)}, None)
    return fut.result(30)["y"]


def _index(core):
    return {m["name"]: (m["state"], m.get("reason", "")) for m in core.repository_index()}


def test_a_load_runs_the_model_file_as_it_is_on_disk_now(tmp_path):
    import warnings

    d = _model_dir(tmp_path)
    service = serve_fake.make_service()  # the real runtime on CPU: it compiles each build's module
    try:
        core = _core(tmp_path, service)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no latency profile for 'm'
            core.load("m")
            assert _infer(core, "m").tolist() == [[1.0] * 4]
            # the same length, at once: a bytecode cache trusted by mtime (whole seconds) and size would run the old code
            (d / "model.py").write_text(MODEL_PY.replace("SCALE = 1.0", "SCALE = 3.0"))
            core.load("m")
        assert _infer(core, "m").tolist() == [[3.0] * 4]
        assert not (d / "__pycache__").exists()  # nothing written into the user's repository
    finally:
        service.close(drain=False)


def test_each_build_runs_the_file_afresh_so_two_models_of_one_file_share_no_module_state(tmp_path):
    from gpuloom.serve.repository import scan_repository

    (tmp_path / "model.py").write_text(MODEL_PY)
    (tmp_path / "a.yaml").write_text(MODEL_YAML.format(name="a", factory="make"))
    (tmp_path / "b.yaml").write_text(MODEL_YAML.format(name="b", factory="make"))
    repo = scan_repository(tmp_path)
    (_, a), (_, b) = repo.models["a"].build(), repo.models["b"].build()
    globals_a, globals_b = type(a).forward.__globals__, type(b).forward.__globals__
    assert globals_a is not globals_b and globals_a["BUILDS"] == [1] and globals_b["BUILDS"] == [1]
    (tmp_path / "model.py").write_text(MODEL_PY.replace("SCALE = 1.0", "SCALE = 2.0"))
    _, a2 = repo.models["a"].build()
    x = torch.ones(1, 4)
    assert a2(x).tolist() == [[2.0] * 4] and a(x).tolist() == [[1.0] * 4]  # the model built before keeps its code


def test_a_model_file_that_does_not_run_is_an_error_naming_it_and_leaves_no_module_behind(tmp_path):
    from gpuloom.serve.repository import scan_repository

    _model_dir(tmp_path, text="import torch\ndef make(:\n")
    before = set(sys.modules)
    with pytest.raises(RepositoryError, match=r"source 'model.py:make': running .*model.py failed: SyntaxError"):
        scan_repository(tmp_path).models["m"].build()
    assert set(sys.modules) == before


def test_a_scan_keeps_the_valid_models_and_gives_each_invalid_one_its_reason(tmp_path):
    from gpuloom.serve.repository import scan_repository

    _model_dir(tmp_path, "good")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.yaml").write_text("name: [\n")  # no name to read: the directory's
    (tmp_path / "bad.yaml").write_text("name: bad\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nmax_batch: 0\n")
    (tmp_path / "twice.yaml").write_text("models: [{name: good, source: 'x:y', inputs: [{name: x, shape: [3]}]},"
                                         " {name: fine, source: 'x:y', inputs: [{name: x, shape: [3]}]}]\n")
    repo = scan_repository(tmp_path)
    assert repo.names() == ["fine"]  # 'good' is defined twice: neither copy is served
    assert sorted(repo.errors) == ["bad", "broken", "good"]
    assert "max_batch must be a positive integer" in repo.errors["bad"]
    assert "broken/config.yaml: not valid YAML" in repo.errors["broken"]
    assert "defined twice" in repo.errors["good"]
    assert repo.require(["fine"]) == ["fine"]
    with pytest.raises(RepositoryError) as e:
        repo.require(["fine", "bad", "nope"])
    assert "max_batch" in str(e.value) and "['nope'] are not in the repository" in str(e.value)
    with pytest.raises(RepositoryError, match="not valid YAML"):  # all of them: what `gpuloom serve` loads by default
        repo.require()
    with pytest.raises(RepositoryError, match="max_batch"):
        load_repository(tmp_path)  # the strict form is unchanged


def test_loading_one_model_needs_only_its_own_entry_to_be_valid(tmp_path):
    from gpuloom.serve.protocol import ProtocolError

    _model_dir(tmp_path, "good")
    core = _core(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: bad\nsource: x:y\ninputs: [{name: x, shape: [3]}]\nslo: 5\n")  # after start
    core.load("good")
    assert _infer(core, "good").tolist() == [[1.0] * 4]
    with pytest.raises(ProtocolError) as e:
        core.load("bad")
    assert e.value.status == 400 and "unknown keys ['slo']" in str(e.value)
    idx = _index(core)
    assert idx["good"] == ("READY", "") and idx["bad"][0] == "UNAVAILABLE" and "unknown keys ['slo']" in idx["bad"][1]


def test_the_index_rescans_the_repository(tmp_path):
    _model_dir(tmp_path, "m")
    core = _core(tmp_path)
    _model_dir(tmp_path, "later")  # added while serving
    assert _index(core) == {"m": ("UNAVAILABLE", "not loaded"), "later": ("UNAVAILABLE", "not loaded")}
    core.load("later")
    assert _index(core)["later"] == ("READY", "")
    import shutil

    shutil.rmtree(tmp_path / "m")
    assert set(_index(core)) == {"later"}


def test_a_failed_load_logs_one_line_naming_the_users_file_and_line(tmp_path, caplog):
    import logging

    from gpuloom.serve.protocol import ProtocolError

    _model_dir(tmp_path, "m", factory="broken")
    core = _core(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="gpuloom.serve"), pytest.raises(ProtocolError) as e:
        core.load("m")
    line = MODEL_PY.splitlines().index('    raise ValueError(f"width {width} is not supported")') + 1
    assert e.value.status == 400 and f"model.py:{line})" in str(e.value)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    msg = errors[0].getMessage()
    assert msg.startswith("loading model m failed: RepositoryError: ") and "ValueError: width 4 is not supported" in msg
    assert msg.endswith(f"{tmp_path / 'm' / 'model.py'}:{line})")
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)  # the traceback, for whoever asks
    assert "width 4 is not supported" in _index(core)["m"][1]


def test_an_unexpected_failure_of_the_runtime_is_logged_with_its_traceback_and_answered_500(tmp_path, caplog):
    import logging

    from gpuloom.serve.protocol import ProtocolError

    class Failing(serve_fake.FakeService):
        def reload(self, config, module):
            raise RuntimeError("lost the device")

    _model_dir(tmp_path, "m")
    core = _core(tmp_path, Failing())
    with caplog.at_level(logging.ERROR, logger="gpuloom.serve"), pytest.raises(ProtocolError) as e:
        core.load("m")
    assert e.value.status == 500 and "RuntimeError: lost the device" in str(e.value)
    assert [bool(r.exc_info) for r in caplog.records] == [True]


def test_unload_answers_as_triton_for_a_model_not_loaded_and_404_for_an_unknown_one(tmp_path):
    from gpuloom.serve.protocol import ProtocolError

    _model_dir(tmp_path, "m")
    core = _core(tmp_path)
    with pytest.raises(ProtocolError) as e:
        core.unload("nope")
    assert e.value.status == 404 and "neither loaded nor in the repository" in str(e.value)
    core.unload("m")  # in the repository, not loaded: success, nothing changes
    assert _index(core)["m"] == ("UNAVAILABLE", "not loaded")
    core.load("m")
    core.unload("m")
    assert _index(core)["m"] == ("UNAVAILABLE", "unloaded")
    core.unload("m")


def test_serve_starts_the_models_asked_for_while_another_entry_is_broken_and_says_which(tmp_path, monkeypatch, capsys):
    """--models a starts though b's YAML is broken (a warning names b and why); without --models every
    entry must be valid, and --models naming the broken one or one missing stops with the reasons."""
    import argparse

    from gpuloom.commands import serve
    from gpuloom.serve.server import Server, ServerAddress

    (tmp_path / "a.yaml").write_text("name: a\nsource: 'torchvision:resnet18'\ninputs: [{name: x, shape: [3, 8, 8], dtype: float32}]\n")
    (tmp_path / "b.yaml").write_text("name: b\nsource: 'torchvision:resnet18'\ninputs: [{name: x, shap: [3], dtype: float32}]\n")
    loaded = []
    monkeypatch.setattr("gpuloom.serve.core.ServeCore.load", lambda self, name: loaded.append(name))
    # started, then stopped as the real one stops: the service closed (a started one left open kept the
    # process's collector settings for the tests after it: test_gcpause failed after this file)
    monkeypatch.setattr(Server, "serve_forever", lambda self, on_started=None: (
        on_started(ServerAddress("127.0.0.1", 1, None)), self.core.service.close()))
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    common = ["--device", "cpu", "--http-port", "0", "--no-grpc"]
    assert serve.run(p.parse_args([str(tmp_path), "--models", "a", *common])) == 0
    err = capsys.readouterr().err
    assert loaded == ["a"] and "warning: model b is not loaded, its entry is invalid:" in err and "shap" in err, err
    for argv in ([], ["--models", "a,b"], ["--models", "a,c"]):
        assert serve.run(p.parse_args([str(tmp_path), *argv, *common])) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and ("shap" in err or "['c'] are not in the repository" in err), err
    assert loaded == ["a"]


def test_the_repository_guides_example_is_a_valid_model_that_builds(tmp_path):
    """docs/model-repository.md's YAML and file.py, as written (its weights file left out)."""
    import re
    from pathlib import Path

    from gpuloom.serve.repository import scan_repository

    text = (Path(__file__).resolve().parents[1] / "docs" / "model-repository.md").read_text()
    yaml_text = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    py_text = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "classifier.yaml").write_text(re.sub(r"(?m)^weights:.*\n", "", yaml_text))
    (tmp_path / "net.py").write_text(py_text)
    repo = scan_repository(tmp_path)
    assert repo.errors == {} and repo.names() == ["classifier"]
    config, module = repo.models["classifier"].build()
    assert config.max_batch == 32 and [t.name for t in config.outputs] == ["logits"]
    import torch

    assert module(torch.zeros(2, 3, 224, 224)).shape == (2, 10)


def test_a_start_loads_its_models_with_one_layout_build_and_names_a_model_that_fails(tmp_path, monkeypatch):
    import warnings

    from gpuloom.serve.protocol import ProtocolError

    for name in ("a", "b", "c"):
        _model_dir(tmp_path, name)
    service = serve_fake.make_service()
    try:
        core = _core(tmp_path, service)
        before = len(service._runtime._layouts) if service._runtime is not None else 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no latency profiles
            core.load_all(["a", "b", "c"])
        assert len(service._runtime._layouts) == before + 1  # one layout for the three, not three
        assert {n: s for n, (s, _) in _index(core).items()} == {"a": "READY", "b": "READY", "c": "READY"}
        assert all(_infer(core, n).tolist() == [[1.0] * 4] for n in "abc")
    finally:
        service.close(drain=False)
    # a build that fails stops the start before anything loads, naming its model
    _model_dir(tmp_path, "d", factory="broken")
    core = _core(tmp_path)
    with pytest.raises(ProtocolError, match="'d'.*width 4 is not supported"):
        core.load_all(["a", "d"])
    assert not core.service.models()
    index = _index(core)  # "a" was built, never loaded: not left LOADING
    assert index["a"] == ("UNAVAILABLE", "not loaded") and index["d"][0] == "UNAVAILABLE", index
    # a joint load that fails falls back to one model at a time
    core = _core(tmp_path)
    monkeypatch.setattr(type(core.service), "load_many", lambda self, models: (_ for _ in ()).throw(RuntimeError("x")))
    core.load_all(["a", "b"])
    assert sorted(c.name for c in core.service.models()) == ["a", "b"]


def test_a_model_that_names_only_its_source_and_inputs_gets_every_default_of_model_config(tmp_path):
    """The parser's defaults are ModelConfig's: batch, SLO, weight, rate hint and the engine keys (a
    default written twice drifts: the engine keys' once did, H100 run 149)."""
    import dataclasses

    from gpuloom.runtime.model_config import ModelConfig, TensorSpec

    (tmp_path / "m.yaml").write_text("name: m\nsource: 'x.py:f'\ninputs: [{name: x, shape: [4], dtype: float32}]\n")
    entry = load_repository(tmp_path / "m.yaml").models["m"]
    bare = ModelConfig("m", inputs=(TensorSpec("x", (4,), "float32"),))
    keys = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("name", "inputs", "outputs")]
    assert {"max_batch", "slo_ms", "weight", "rate_hint", *ENGINE_DEFAULTS} <= set(keys)
    assert {k: getattr(entry, k) for k in keys} == {k: getattr(bare, k) for k in keys}


def test_the_model_repository_guides_examples_parse_and_build_as_written(tmp_path):
    """docs/model-repository.md's YAML examples are valid repository entries, and its classifier (YAML
    plus net.py) builds and runs as written (its weights file aside, which the guide does not ship)."""
    import re

    guide = (Path(__file__).resolve().parents[1] / "docs" / "model-repository.md").read_text()
    yamls = re.findall(r"```yaml\n(.*?)```", guide, re.S)
    net = re.search(r"```python\n# my_models/net.py\n(.*?)```", guide, re.S).group(1)
    assert len(yamls) >= 2
    for k, text in enumerate(yamls):
        (tmp_path / f"m{k}.yaml").write_text(text)
        assert len(load_repository(tmp_path / f"m{k}.yaml").models) == 1, text
    classifier = load_repository(tmp_path / "m0.yaml").models["classifier"]
    assert classifier.fuse_epilogues is True and classifier.max_batch == 32 and classifier.slo_ms == 50
    (tmp_path / "net.py").write_text(net)
    (tmp_path / "built.yaml").write_text(re.sub(r"(?m)^weights:.*\n", "", yamls[0]))
    config, module = load_repository(tmp_path / "built.yaml").models["classifier"].build()
    assert [(t.name, t.shape) for t in config.inputs] == [("image", (3, 224, 224))]
    assert [(t.name, t.shape) for t in config.outputs] == [("logits", (10,))]
    assert tuple(module(torch.zeros(2, 3, 224, 224)).shape) == (2, 10)
