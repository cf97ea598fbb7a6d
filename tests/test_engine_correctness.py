"""gpuloom.compile computes what the eager model computes, element by element (CPU path)."""

from __future__ import annotations

import pytest
import torch

import gpuloom
from engine_models import zoo

MODELS = zoo()


def _inputs(shapes, batch, dtype, device="cpu"):
    return tuple(torch.randn(batch, *s, dtype=dtype, device=device) for s in shapes)


def _assert_same(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request):
    model, shapes, dtype = MODELS[request.param]
    model = model.eval()
    cm = gpuloom.compile(model, _inputs(shapes, 2, dtype), max_batch=4)
    return request.param, model, shapes, dtype, cm


def test_outputs_equal_eager_on_fresh_inputs(compiled):
    name, model, shapes, dtype, cm = compiled
    for batch in (1, 3, 4):
        xs = _inputs(shapes, batch, dtype)
        with torch.no_grad():
            want = model(*xs)
        _assert_same(cm(*xs), want)


def test_single_stream_order_equals_eager(compiled):
    name, model, shapes, dtype, cm = compiled
    xs = _inputs(shapes, 2, dtype)
    with torch.no_grad():
        want = model(*xs)
        got = cm.run_eager_plan(*xs, streams=1)
    _assert_same(got, want)


def test_plan_covers_every_op(compiled):
    name, model, shapes, dtype, cm = compiled
    assert cm.plan.num_nodes == len(cm.graph.ops) > 0
    assert cm.graph.method == "export"
    assert 1 <= cm.plan.num_streams <= cm.plan.num_nodes
    assert cm.single_plan.num_streams == 1 and cm.single_plan.num_syncs == 0


def test_branchy_models_get_several_streams():
    model, shapes, dtype = MODELS["googlenet"]
    cm = gpuloom.compile(model.eval(), _inputs(shapes, 1, dtype), max_batch=2)
    # an inception block has 4 parallel branches
    assert cm.plan.num_streams >= 4
    assert cm.plan.num_syncs >= 1
