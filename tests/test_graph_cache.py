"""The functionalized-graph cache (gpuloom.engine.graph_cache): hits only where the graph is the same,
with the model's own current weights; misses on an edit; survives a damaged file and an unwritable
directory; can be turned off."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import gpuloom
from gpuloom.engine import graph_cache


class Block(nn.Module):
    """BatchNorm (folded), an in-place ReLU and a residual add: what the decomposition rewrites."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.skip = nn.Conv2d(3, 8, 1)
        self.head = nn.Linear(8, 5)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.conv(x)))
        y += self.skip(x) * self.scale
        return self.head(y.mean(dim=(2, 3)))


def _model(scale: float = 1.0) -> nn.Module:
    m = Block(scale).eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity, so folding them matters
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _compile(m: nn.Module):
    return gpuloom.compile(m, torch.randn(1, 3, 12, 12), max_batch=4)


def _assert_eager(cm, m: nn.Module) -> None:
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-5)


def _counts() -> tuple[int, int]:
    return graph_cache.Stats.hits, graph_cache.Stats.misses


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "graphs"
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", str(d))
    return d


def test_a_model_compiled_again_takes_its_graph_from_the_cache_and_still_equals_eager(cache):
    m = _model()
    h0, m0 = _counts()
    first = _compile(m)
    assert _counts() == (h0, m0 + 1)
    assert len(list(cache.glob("*.json"))) == 1
    assert not first.graph.graph_from_cache
    second = _compile(m)
    assert _counts() == (h0 + 1, m0 + 1)
    assert second.graph.graph_from_cache
    assert [str(o.target) for o in second.graph.ops] == [str(o.target) for o in first.graph.ops]
    assert second.graph.edges == first.graph.edges
    assert second.graph.folded_batchnorms == first.graph.folded_batchnorms == 1
    _assert_eager(second, m)


def test_a_hit_compiles_the_models_own_weights_not_the_ones_it_was_stored_with(cache):
    a, b = _model(), _model()  # same code, other random weights
    _compile(a)
    h0, _ = _counts()
    cm = _compile(b)
    assert _counts()[0] == h0 + 1
    _assert_eager(cm, b)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        assert not torch.allclose(cm(x), a(x))


def test_an_edited_model_misses(cache):
    _compile(_model(scale=1.0))
    h0, m0 = _counts()
    edited = _model(scale=0.5)  # a constant of the forward changed: another graph
    cm = _compile(edited)
    assert _counts() == (h0, m0 + 1)
    assert len(list(cache.glob("*.json"))) == 2
    _assert_eager(cm, edited)


def test_a_damaged_file_is_decomposed_again_and_rewritten(cache, caplog):
    m = _model()
    _compile(m)
    (path,) = cache.glob("*.json")
    path.write_bytes(b'{"not": "a graph"')
    with caplog.at_level(logging.WARNING, logger="gpuloom.engine.graph_cache"):
        cm = _compile(m)
    assert "does not read back" in caplog.text
    _assert_eager(cm, m)
    h0, _ = _counts()
    _compile(m)  # the rewritten file reads back
    assert _counts()[0] == h0 + 1


def test_an_unwritable_cache_warns_and_compiles(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", str(blocker / "graphs"))
    m = _model()
    with caplog.at_level(logging.WARNING, logger="gpuloom.engine.graph_cache"):
        cm = _compile(m)
    assert "cannot write" in caplog.text and "GPULOOM_GRAPH_CACHE" in caplog.text
    _assert_eager(cm, m)


@pytest.mark.parametrize("value", ["0", "off", "none"])
def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", value)
    assert graph_cache.cache_dir() is None
    monkeypatch.chdir(tmp_path)
    before = _counts()
    _compile(_model())
    assert _counts() == before
    assert not list(tmp_path.rglob("*.json"))


def test_the_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("GPULOOM_GRAPH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graph_cache.cache_dir() == tmp_path / "gpuloom" / "graphs"


def test_the_key_changes_with_the_batch_range_and_the_dtype():
    m = _model()
    x = torch.randn(2, 3, 12, 12)

    def key(model, inp, top):
        batch = torch.export.Dim("batch", min=1, max=top)
        with torch.no_grad():
            return graph_cache.graph_key(torch.export.export(model, (inp,), dynamic_shapes=({0: batch},)))

    base = key(m, x, 8)
    assert key(m, x, 8) == base  # deterministic
    assert key(m, x, 16) != base
    assert key(m.double(), x.double(), 8) != base


def test_past_its_bound_the_cache_removes_the_least_recently_used_graphs(cache, monkeypatch):
    import os
    import time

    _compile(_model(scale=1.0))
    (a,) = cache.glob("*.json")
    _compile(_model(scale=0.5))
    (b,) = set(cache.glob("*.json")) - {a}
    now = time.time()
    os.utime(a, (now - 120, now - 120))  # a written first, b after it, well apart
    os.utime(b, (now - 60, now - 60))
    _compile(_model(scale=1.0))  # a hit on a: now the more recently used
    assert a.stat().st_mtime > b.stat().st_mtime
    size = max(a.stat().st_size, b.stat().st_size)
    monkeypatch.setattr(graph_cache, "MAX_BYTES", 2 * size + size // 2)  # room for two graphs, not three
    h0, m0 = _counts()
    _compile(_model(scale=0.25))  # a third graph: b, the least recently used, goes
    assert _counts() == (h0, m0 + 1)
    left = set(cache.glob("*.json"))
    assert a in left and b not in left and len(left) == 2


class TupleOrDict(nn.Module):
    """The same ops either way; only the output's structure differs."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        return {"a": y, "b": y * 2} if self.as_dict else (y, y * 2)


def test_a_model_that_returns_another_structure_of_the_same_tensors_misses(cache):
    as_tuple, as_dict = TupleOrDict(False).eval(), TupleOrDict(True).eval()
    gpuloom.compile(as_tuple, torch.randn(1, 4), max_batch=4)
    h0, m0 = _counts()
    cm = gpuloom.compile(as_dict, torch.randn(1, 4), max_batch=4)
    assert _counts() == (h0, m0 + 1)
    x = torch.randn(3, 4)
    with torch.no_grad():
        got, want = cm(x), as_dict(x)
    assert isinstance(got, dict) and got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_a_reload_says_in_the_log_that_its_export_graph_came_from_the_cache(cache, caplog):
    import warnings

    import numpy as np

    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    config = ModelConfig("m", (TensorSpec("x", (4,), "float32"),), max_batch=4, slo_ms=500)
    svc = InferenceService(policy="triton", device="cpu")
    svc.start()
    try:
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="gpuloom"):
            warnings.simplefilter("ignore")
            svc.load(config, model)
            svc.unload("m")
            svc.load(config, model)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model m: compiled in")]
        assert len(said) == 2 and "graph cache" not in said[0], said
        assert "(its export graph from the graph cache)" in said[1], said
        x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(svc.infer("m", {"x": x}, timeout_s=20)["output0"], want, rtol=1e-5, atol=1e-5)
    finally:
        svc.close()


@pytest.mark.parametrize("name", ["resnet18", "googlenet", "inception_v3", "mobilenet_v3_small", "efficientnet_b0",
                                  "densenet121", "transformer_encoder", "two_inputs"])
def test_every_engine_model_compiled_from_the_cache_has_the_same_dag_and_equals_eager(cache, name):
    from engine_models import zoo

    model, shapes, dtype = zoo(64)[name]
    model = model.eval()
    mk = lambda b: tuple(torch.randn(b, *s, dtype=dtype) for s in shapes)
    first = gpuloom.compile(model, mk(1), max_batch=4)
    hits = graph_cache.Stats.hits
    cm = gpuloom.compile(model, mk(1), max_batch=4)
    assert graph_cache.Stats.hits == hits + 1 and cm.graph.graph_from_cache
    assert [str(o.target) for o in cm.graph.ops] == [str(o.target) for o in first.graph.ops]
    assert cm.graph.edges == first.graph.edges and cm.plan.num_streams == first.plan.num_streams
    xs = mk(3)
    with torch.no_grad():
        got, want = cm(*xs), model(*xs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


class WithConstants(nn.Module):
    """A non-persistent buffer and a tensor made in forward (a lifted constant): values, not graph."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), k), persistent=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + torch.tensor([self.k] * 4)


def test_a_hit_takes_buffers_and_lifted_constants_from_the_model_compiled(cache):
    gpuloom.compile(WithConstants(2.0).eval(), torch.randn(1, 4), max_batch=4)
    other = WithConstants(3.0).eval()  # the same graph; other values
    cm = gpuloom.compile(other, torch.randn(1, 4), max_batch=4)
    assert cm.graph.graph_from_cache
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), other(x))
