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


def test_the_forward_candidate_of_auto_is_the_users_own_forward(compiled):
    """streams="auto" also times a plain graph of the model's forward (ForwardExecutor): it must be
    exactly the eager model, on one stream."""
    name, model, shapes, dtype, cm = compiled
    fwd = cm._executors["forward"]
    assert fwd.plan.num_streams == 1 and fwd.module is model
    xs = _inputs(shapes, 3, dtype)
    with torch.no_grad():  # the same values, in the same structure, as the DAG's candidates
        _assert_same(fwd.run(xs), cm._executors["single"].run(xs))


def test_the_forward_is_left_out_where_the_model_is_not_on_the_compile_device():
    from gpuloom.engine.compiled import _all_on

    lin = torch.nn.Linear(4, 2).eval()
    assert _all_on(lin, torch.device("cpu")) and not _all_on(lin, torch.device("cuda", 0))


def test_lanes_and_the_profiler_capture_each_bucket_as_compile_kept_it():
    import types

    from gpuloom.engine.compiled import capture_groups

    cm = types.SimpleNamespace(buckets=(1, 2, 4, 8), stream_choice={1: "forward", 2: "multi", 4: "single"})
    assert capture_groups(cm) == {"forward": [1], "max": [2, 8], 1: [4]}  # no choice (8): Nimble's streams
    assert capture_groups(cm, single=True) == {"forward": [1], 1: [2, 4, 8]}
    assert capture_groups(types.SimpleNamespace(buckets=(1, 2), stream_choice={})) == {"max": [1, 2]}
    # compile(channels_last="auto"): the channels-last kinds are captured again as themselves
    cl = types.SimpleNamespace(buckets=(1, 2, 4), stream_choice={1: "single", 2: "multi_cl", 4: "single_cl"})
    assert capture_groups(cl) == {1: [1], "multi_cl": [2], "single_cl": [4]}
    assert capture_groups(cl, single=True) == {1: [1], "single_cl": [2, 4]}


def test_a_host_read_in_a_forward_is_caught_before_any_capture():
    """The forward candidate's last warm-up runs under a per-thread guard: an op that reads a device
    value on the host would invalidate a CUDA graph capture, so it raises there instead."""
    from gpuloom.engine.capture import _NoHostSync

    x = torch.randn(3, 4)
    with _NoHostSync():
        torch.nn.Linear(4, 2)(x).relu()  # device work only: fine
        for read in (lambda: x.sum().item(), lambda: torch.nonzero(x), lambda: x.unique(), lambda: bool(x.sum() > 0)):
            with pytest.raises(RuntimeError, match="host synchronization"):
                read()
