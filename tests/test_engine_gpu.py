"""GPU: compiled graphs equal eager, and independent branches really overlap."""

from __future__ import annotations

import statistics

import pytest
import torch

import gpuloom
from engine_models import Branches, zoo

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    # TF32 would make eager and graph differ by algorithm choice, not by gpuloom
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _flat(v):
    return list(v) if isinstance(v, (tuple, list)) else [v]


@pytest.mark.parametrize("name", sorted(zoo(224)))
def test_graphs_equal_eager_on_gpu(name):
    model, shapes, dtype = zoo(224)[name]
    model = model.eval().cuda()
    mk = lambda b: tuple(torch.randn(b, *s, device="cuda", dtype=dtype) for s in shapes)
    cm = gpuloom.compile(model, mk(1), max_batch=8, streams="auto")
    assert cm.memory_bytes > 0
    graphsets = {"single": cm.capture(streams=1), "multi": cm.capture(streams="max")}
    assert all(e.kind == "multi" for e in graphsets["multi"].buckets.values()) or cm.plan.num_streams == 1
    for batch in (1, 3, 8):
        xs = mk(batch)
        with torch.no_grad():
            want = _flat(model(*xs))
        for g, w in zip(_flat(cm(*xs)), want):  # the user path: pad to bucket 4/8, slice back
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        if batch in cm.buckets:
            for kind, gs in graphsets.items():
                for static, x in zip(gs.inputs(batch), xs):
                    static.copy_(x)
                gs.replay(batch, stream=torch.cuda.current_stream())
                for g, w in zip(_flat(gs.outputs(batch)), want):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind}: {m}")


def _replay_ms(cm, x, iters=200):
    for _ in range(20):
        cm(x)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        cm(x, zero_copy=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def test_independent_branches_overlap():
    k = 4
    x = torch.randn(1, 256, device="cuda")
    one = gpuloom.compile(Branches(k=1, depth=8).eval().cuda(), (x,), max_batch=1, streams=1)
    model = Branches(k=k, depth=8).eval().cuda()
    multi = gpuloom.compile(model, (x,), max_batch=1, streams="max")
    single = gpuloom.compile(model, (x,), max_batch=1, streams=1)
    assert multi.plan.num_streams == k
    t_one, t_multi, t_single = _replay_ms(one, x), _replay_ms(multi, x), _replay_ms(single, x)
    print(f"one branch {t_one:.4f} ms, {k} branches: multi-stream {t_multi:.4f} ms, single-stream {t_single:.4f} ms")
    assert t_single > 0.6 * k * t_one, "single stream should run the branches one after another"
    assert t_multi < 1.6 * t_one, "multi-stream should run the branches side by side"
