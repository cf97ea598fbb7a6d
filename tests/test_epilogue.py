"""A convolution's bias (+ residual) + activation as one op (``fold.fuse_epilogues``, ``epilogue``): on
the CPU the rewritten graph runs eager's ops, so it must equal eager; the Triton kernel is checked
against them on the GPU (``tests/test_engine_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gpuloom
from gpuloom.engine import epilogue, fold
from gpuloom.engine.dag import _export
from engine_models import randomize_batchnorm


class Patterns(nn.Module):
    """One of each pattern the pass takes, and the ones it must leave."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(9))
        self.bns = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(9))
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def c(self, i, x):
        return self.bns[i](self.convs[i](x))

    def forward(self, x):
        a = torch.nn.functional.silu(self.c(0, x))          # silu: fused
        b = torch.sigmoid(self.c(1, a))                      # sigmoid: fused
        d = torch.nn.functional.relu6(self.c(2, b))          # relu6: fused
        e = self.c(3, d) + d                                 # residual add: fused
        f = torch.nn.functional.silu(e + self.c(4, e))       # add then silu: fused (one op)
        g = torch.relu(self.c(5, f) + f)                     # add then ReLU: left to cuDNN
        h = torch.relu(self.c(6, g))                         # ReLU: left to cuDNN
        y = self.c(7, h)
        k = torch.nn.functional.silu(y) * y                  # two readers: left
        m = torch.nn.functional.silu(self.dw(k))             # a depthwise convolution: fused
        return self.c(8, m) * 2.0                            # a multiply: left


def _fused_graph(model, x):
    gm = _export(model, (x,), 4)
    fold.fold_batchnorm(gm)
    fold.restore_batchnorm(gm)
    return gm, fold.fuse_epilogues(gm)


def test_the_pass_takes_each_pattern_it_may_and_leaves_the_rest():
    torch.manual_seed(0)
    model = randomize_batchnorm(Patterns())
    gm, fused = _fused_graph(model, torch.randn(1, 8, 12, 12))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is epilogue.bias_act]
    got = sorted((n.args[2], n.args[3] is not None) for n in calls)
    assert fused == len(calls) == 6
    assert got == sorted([("silu", False), ("sigmoid", False), ("relu6", False), ("none", True), ("silu", True),
                          ("silu", False)])
    # every fused convolution lost its bias; the others kept theirs
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.conv2d.default]
    assert sum(n.args[2] is None for n in convs) == 6 and len(convs) == 10
    for batch in (1, 3):
        x = torch.randn(batch, 8, 12, 12)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, want", [("efficientnet_b0", 74), ("mobilenet_v2", 45), ("resnet18", 0)])
def test_compile_with_fused_epilogues_equals_eager_on_the_cpu(name, want):
    import torchvision

    torch.manual_seed(1)
    model = randomize_batchnorm(getattr(torchvision.models, name)(weights=None))
    cm = gpuloom.compile(model, torch.randn(1, 3, 64, 64), max_batch=4, fuse_epilogues=True)
    assert cm.fused_epilogues == want  # resnet18: its convolutions end in ReLUs, cuDNN's to fuse
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)


def test_compile_leaves_epilogues_alone_on_the_cpu_by_default_and_checks_the_option():
    m = randomize_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU()))
    assert gpuloom.compile(m, torch.randn(1, 3, 8, 8), max_batch=2).fused_epilogues == 0
    assert gpuloom.compile(m, torch.randn(1, 3, 8, 8), max_batch=2, fuse_epilogues=True).fused_epilogues == 1
    with pytest.raises(ValueError, match="fuse_epilogues must be True, False or None"):
        gpuloom.compile(m, torch.randn(1, 3, 8, 8), max_batch=2, fuse_epilogues="yes")


@pytest.mark.parametrize("act", epilogue.ACTIVATIONS)
@pytest.mark.parametrize("residual", [False, True])
def test_bias_act_is_the_eager_ops_in_order(act, residual):
    torch.manual_seed(2)
    y, b, r = torch.randn(2, 5, 3, 4), torch.randn(5), torch.randn(2, 5, 3, 4)
    v = y + b.view(1, 5, 1, 1)
    if residual:
        v = v + r
    want = {"none": v, "relu6": v.clamp(0, 6), "silu": v * torch.sigmoid(v), "sigmoid": torch.sigmoid(v)}[act]
    got = epilogue.bias_act(y, b, act, r if residual else None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_kernel_takes_only_what_it_can_index():
    y = torch.randn(2, 4, 3, 3)
    assert epilogue._fits(y, torch.randn(4), None)
    assert epilogue._fits(y.contiguous(memory_format=torch.channels_last), torch.randn(4), None)
    assert not epilogue._fits(y.transpose(2, 3), torch.randn(4), None)  # not dense in either layout
    assert not epilogue._fits(y, torch.randn(3), None)  # one bias per channel
    assert not epilogue._fits(y, torch.randn(4).double(), None)
    assert not epilogue._fits(y, torch.randn(4), y.contiguous(memory_format=torch.channels_last))  # other strides
    assert not epilogue._fits(y.int(), torch.randn(4).int(), None)


def test_a_kernel_that_fails_falls_back_to_eagers_ops_once_and_for_all(monkeypatch, caplog):
    # a GPU Triton cannot compile for must not stop a model: the first failure is logged, and from
    # then on every call runs eager's ops (here the CPU stands in for the GPU, a raising launch for
    # the kernel)
    calls = []

    def broken(kernel, *args):
        calls.append(args)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(epilogue, "_on_gpu", lambda y: True)
    monkeypatch.setattr(epilogue, "_kernel", lambda: object())
    monkeypatch.setattr(epilogue, "_launch", broken)
    monkeypatch.setattr(epilogue._guard, "failed", False)
    y, b = torch.randn(1, 3, 4, 4), torch.randn(3)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            torch.testing.assert_close(epilogue.bias_act(y, b, "silu"), epilogue.reference(y, b, "silu"))
    assert len(calls) == 1
    assert "the fused convolution epilogue kernel failed (RuntimeError: no kernel image" in caplog.text


@pytest.mark.parametrize("options", [{"channels_last": True}, {"reinplace": True}])
def test_fused_epilogues_compose_with_channels_last_and_reinplace(options):
    # the NHWC pass runs after the epilogues (their inputs become channels-last), reinplace after both
    import torchvision

    torch.manual_seed(3)
    model = randomize_batchnorm(torchvision.models.mobilenet_v2(weights=None))
    cm = gpuloom.compile(model, torch.randn(1, 3, 64, 64), max_batch=2, fuse_epilogues=True, streams=1, **options)
    assert cm.fused_epilogues == 45
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)
