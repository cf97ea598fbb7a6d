"""The model repository: parsing, sources, safe weights, clear errors."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402,F401  (provides gpuloom.runtime.service until the runtime lands)

import torch  # noqa: E402

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
    text = (REPO / "tiny_cnn.yaml").read_text() + "\nchannels_last: auto\nfuse_convolutions: channels_last\n"
    path = tmp_path / "tiny_cnn.yaml"
    path.write_text(text)
    (tmp_path / "nets.py").write_text((REPO / "nets.py").read_text())
    config, _ = load_repository(path).models["tiny_cnn"].build()
    assert config.channels_last == "auto" and config.fuse_convolutions == "channels_last"
    default, _ = load_repository(REPO / "tiny_cnn.yaml").models["tiny_cnn"].build()
    assert default.channels_last is False and default.fuse_convolutions is False


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
