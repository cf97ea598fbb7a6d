"""Squeeze-excitation gates as one op (``fold.fuse_gates``, ``excitation``): on the CPU the rewritten
graph runs eager's ops, so it must equal eager; the Triton kernels themselves run here under Triton's
interpreter (``TRITON_INTERPRET=1``, where Triton imports) and on the GPU in ``tests/test_engine_gpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuloom
from gpuloom.engine import epilogue, excitation, fold
from gpuloom.engine.dag import _export
from engine_models import randomize_batchnorm


class Gates(nn.Module):
    """A gate the pass takes, and lookalikes it must leave."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Conv2d(16 if i % 2 == 0 else 4, 4 if i % 2 == 0 else 16, 1) for i in range(10))

    def forward(self, x):
        p = F.adaptive_avg_pool2d(x, 1)
        a = x * torch.sigmoid(self.fc[1](F.silu(self.fc[0](p))))            # SiLU / sigmoid: fused
        b = a * F.hardsigmoid(self.fc[3](F.relu(self.fc[2](p))))            # ReLU / hardsigmoid: fused
        h = F.silu(self.fc[4](p))
        c = b * torch.sigmoid(self.fc[5](h)) + h.mean()                     # the hidden value read twice: left
        d = c * F.gelu(self.fc[7](F.silu(self.fc[6](p))))                   # another gate activation: left
        return d * torch.sigmoid(self.fc[9](F.silu(self.fc[8](x))))        # not on a pooled map: left


def test_the_pass_takes_gates_and_leaves_lookalikes():
    torch.manual_seed(0)
    model = Gates().eval()
    gm = _export(model, (torch.randn(1, 16, 5, 5),), 4)
    assert fold.fuse_gates(gm) == 2
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is excitation.gate]
    assert sorted(n.args[5:] for n in calls) == [("relu", "hardsigmoid"), ("silu", "sigmoid")]
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.conv2d.default]
    assert len(convs) == 6
    for batch in (1, 3):
        x = torch.randn(batch, 16, 5, 5)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, gates, epilogues", [("efficientnet_b0", 16, 42), ("mobilenet_v3_small", 9, 6),
                                                    ("mobilenet_v2", 0, 45), ("resnet18", 0, 0)])
def test_compile_with_fused_gates_equals_eager_on_the_cpu(name, gates, epilogues):
    import torchvision

    torch.manual_seed(1)
    model = randomize_batchnorm(getattr(torchvision.models, name)(weights=None))
    cm = gpuloom.compile(model, torch.randn(1, 3, 64, 64), max_batch=4, fuse_gates=True, fuse_epilogues=True)
    # the gates go first: their convolutions are no longer the epilogue pass's (efficientnet_b0 had 74)
    assert (cm.fused_gates, cm.fused_epilogues) == (gates, epilogues)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)


def test_compile_leaves_gates_alone_on_the_cpu_by_default_and_checks_the_option():
    m = nn.Sequential(nn.Conv2d(8, 2, 1), nn.ReLU(), nn.Conv2d(2, 8, 1), nn.Sigmoid()).eval()
    x = torch.randn(1, 8, 1, 1)
    assert gpuloom.compile(m, x, max_batch=2).fused_gates == 0
    assert gpuloom.compile(m, x, max_batch=2, fuse_gates=True).fused_gates == 1
    with pytest.raises(ValueError, match="fuse_gates must be True, False or None"):
        gpuloom.compile(m, x, max_batch=2, fuse_gates=1)


def _gate_operands(n, c, hidden, out, dtype=torch.float32, weight_format=torch.contiguous_format):
    p = torch.randn(n, c, 1, 1).to(dtype)
    w1 = (torch.randn(hidden, c, 1, 1) / c ** 0.5).to(dtype).contiguous(memory_format=weight_format)
    w2 = (torch.randn(out, hidden, 1, 1) / hidden ** 0.5).to(dtype).contiguous(memory_format=weight_format)
    return p, w1, torch.randn(hidden).to(dtype), w2, torch.randn(out).to(dtype)


def test_the_gate_kernel_takes_only_what_it_can_index():
    p, w1, b1, w2, b2 = _gate_operands(2, 12, 3, 12)
    assert excitation._fits(p, w1, b1, w2, b2)
    assert excitation._fits(p.contiguous(memory_format=torch.channels_last), w1, b1, w2, b2)
    assert excitation._fits(p, w1.contiguous(memory_format=torch.channels_last), b1, w2, b2)
    assert not excitation._fits(torch.randn(2, 12, 2, 1), w1, b1, w2, b2)  # not pooled
    assert not excitation._fits(torch.randn(12, 2, 1, 1).transpose(0, 1), w1, b1, w2, b2)  # channels not dense
    assert not excitation._fits(p, w1, b1, w2.transpose(0, 1).contiguous().transpose(0, 1), b2)  # rows not dense
    assert not excitation._fits(p, w1, torch.randn(4), w2, b2)  # a bias per hidden channel
    assert not excitation._fits(p.double(), w1, b1, w2, b2)
    assert not excitation._fits(*_gate_operands(1, 8, 600, 8))  # hidden wider than one program holds


def test_a_gate_kernel_that_fails_falls_back_to_eagers_ops_once_and_for_all(monkeypatch, caplog):
    calls = []

    def broken(kernel, *args):
        calls.append(args)
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(excitation, "_on_gpu", lambda t: True)
    monkeypatch.setattr(excitation, "_kernel", lambda: object())
    monkeypatch.setattr(excitation, "_launch", broken)
    monkeypatch.setattr(excitation._guard, "failed", False)
    ops = _gate_operands(1, 6, 2, 6)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            torch.testing.assert_close(excitation.gate(*ops, "silu", "sigmoid"),
                                       excitation.reference(*ops, "silu", "sigmoid"))
    assert len(calls) == 1
    assert "the fused squeeze-excitation gate kernel failed (RuntimeError: out of resource" in caplog.text


def _check_gate_kernel(dtype: torch.dtype) -> None:
    kernel = excitation._kernel()
    torch.manual_seed(2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-3)
    # efficientnet_b0's widest gate; odd sizes (masks); MobileNetV3's widest hidden (several tiles)
    for shape, fmt in (((3, 1152, 48, 1152), torch.contiguous_format), ((2, 7, 3, 5), torch.channels_last),
                       ((1, 960, 240, 960), torch.channels_last)):
        ops = _gate_operands(*shape, dtype=dtype, weight_format=fmt)
        for act1 in excitation.HIDDEN_ACTIVATIONS:
            for act2 in excitation.GATE_ACTIVATIONS:
                got = excitation._launch(kernel, *ops, act1, act2)
                want = excitation.reference(*(t.float() for t in ops), act1, act2).to(dtype)
                assert got.shape == want.shape and got.dtype == dtype
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{shape} {act1} {act2}: {m}")


def _check_epilogue_kernel(dtype: torch.dtype) -> None:
    kernel = epilogue._kernel()
    torch.manual_seed(3)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for fmt in (torch.contiguous_format, torch.channels_last):
        y = (3 * torch.randn(2, 7, 5, 9)).to(dtype).contiguous(memory_format=fmt)
        r = torch.randn(2, 7, 5, 9).to(dtype).contiguous(memory_format=fmt)
        b = torch.randn(7).to(dtype)
        for act in epilogue.ACTIVATIONS:
            for res in (None, r):
                got = epilogue._launch(kernel, y, b, act, res)
                want = epilogue.reference(y.float(), b.float(), act, None if res is None else res.float()).to(dtype)
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{fmt} {act} {res is not None}: {m}")


@pytest.mark.parametrize("check", ["_check_gate_kernel", "_check_epilogue_kernel"])
def test_the_triton_kernels_equal_eagers_ops_under_the_interpreter(check):
    # Triton's interpreter runs a kernel on CPU tensors, but only where TRITON_INTERPRET was set
    # before Triton was first imported: a process of its own
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = f"import torch, test_excitation as t\nfor d in (torch.float32, torch.float16): t.{check}(d)"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
