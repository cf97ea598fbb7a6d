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
    """Gates the pass takes, and lookalikes it must leave."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Conv2d(16 if i % 2 == 0 else 4, 4 if i % 2 == 0 else 16, 1) for i in range(12))

    def gate(self, i, p, act1=F.silu, act2=torch.sigmoid):
        return act2(self.fc[i + 1](act1(self.fc[i](p))))

    def forward(self, x):
        p = F.adaptive_avg_pool2d(x, 1)
        a = x * self.gate(0, p)                                   # SiLU / sigmoid, x * gate: fused
        b = self.gate(2, p, F.relu, F.hardsigmoid) * a            # ReLU / hardsigmoid, gate * x: fused
        h = F.silu(self.fc[4](p))
        c = b * torch.sigmoid(self.fc[5](h)) + h.mean()           # the hidden value read twice: left
        d = c * self.gate(6, p, act2=F.gelu)                      # another gate activation: left
        e = d * self.gate(8, x)                                   # not on a pooled map: left
        return e + self.gate(10, p)                               # no multiply: left


def test_the_pass_takes_gates_and_leaves_lookalikes():
    torch.manual_seed(0)
    model = Gates().eval()
    gm = _export(model, (torch.randn(1, 16, 5, 5),), 4)
    assert fold.fuse_gates(gm) == 2
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is excitation.excite]
    assert sorted(n.args[4] for n in calls) == ["hardsigmoid", "sigmoid"]
    hidden = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is excitation.hidden]
    assert sorted(n.args[3] for n in hidden) == ["relu", "silu"]
    assert all(n.args[1] in hidden for n in calls)
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.conv2d.default]
    assert len(convs) == 8
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
    # what compile changed, as a user sees it: only the passes that changed something
    assert cm.rewrites.get("fused_gates", 0) == gates and cm.rewrites.get("fused_epilogues", 0) == epilogues
    assert ("fused_gates=" in repr(cm)) == bool(gates) and "split_linears" not in repr(cm)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)


def test_compile_leaves_gates_alone_on_the_cpu_by_default_and_checks_the_option():
    m = Gates().eval()
    x = torch.randn(1, 16, 5, 5)
    assert gpuloom.compile(m, x, max_batch=2).fused_gates == 0
    assert gpuloom.compile(m, x, max_batch=2, fuse_gates=True).fused_gates == 2
    with pytest.raises(ValueError, match="fuse_gates must be True, False or None"):
        gpuloom.compile(m, x, max_batch=2, fuse_gates=1)


def _operands(n, c, hidden, hw=(5, 3), dtype=torch.float32, fmt=torch.contiguous_format):
    """A gate's operands: x [n, c, *hw], its pooled map, both weights and biases (c -> hidden -> c)."""
    x = torch.randn(n, c, *hw).to(dtype).contiguous(memory_format=fmt)
    p = x.float().mean((2, 3), keepdim=True).to(dtype).contiguous(memory_format=fmt)
    w1 = (torch.randn(hidden, c, 1, 1) / c ** 0.5).to(dtype).contiguous(memory_format=fmt)
    w2 = (torch.randn(c, hidden, 1, 1) / hidden ** 0.5).to(dtype).contiguous(memory_format=fmt)
    return x, p, w1, torch.randn(hidden).to(dtype), w2, torch.randn(c).to(dtype)


def test_the_kernels_take_only_what_they_can_index():
    x, p, w1, b1, w2, b2 = _operands(2, 12, 3)
    h = excitation.hidden_reference(p, w1, b1, "relu")
    assert excitation._pooled(p) and excitation._weight_fits(w1, b1, p, 12)
    assert excitation._pooled(p.contiguous(memory_format=torch.channels_last))
    assert excitation._weight_fits(w1.contiguous(memory_format=torch.channels_last), b1, p, 12)
    assert not excitation._pooled(torch.randn(2, 12, 2, 1))  # not pooled
    assert not excitation._pooled(torch.randn(12, 2, 1, 1).transpose(0, 1))  # channels not dense
    assert not excitation._weight_fits(w1.transpose(0, 1).contiguous().transpose(0, 1), b1, p, 12)  # rows not dense
    assert not excitation._weight_fits(w1, torch.randn(4), p, 12)  # a bias per row
    assert not excitation._weight_fits(w1.double(), b1.double(), p, 12)
    assert excitation._excite_fits(x, h, w2, b2)
    assert excitation._excite_fits(x.contiguous(memory_format=torch.channels_last), h, w2, b2)
    assert not excitation._excite_fits(x.transpose(2, 3), h, w2, b2)  # neither layout dense
    assert not excitation._excite_fits(x[:1], h, w2, b2)  # a gate per sample
    assert not excitation._excite_fits(x, h, w2[:6], b2[:6])  # a gate per channel
    wide = _operands(1, 8, 600)
    assert not excitation._excite_fits(wide[0], excitation.hidden_reference(*wide[1:4], "relu"), *wide[4:])


def test_a_gate_kernel_that_fails_falls_back_to_eagers_ops_once_and_for_all(monkeypatch, caplog):
    calls = []

    def broken(kernel, *args):
        calls.append(args)
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(excitation, "_on_gpu", lambda t: True)
    monkeypatch.setattr(excitation, "_kernels", lambda: (object(), object()))
    monkeypatch.setattr(excitation, "_launch_hidden", broken)
    monkeypatch.setattr(excitation, "_launch_excite", broken)
    monkeypatch.setattr(excitation._guard, "failed", False)
    x, p, w1, b1, w2, b2 = _operands(1, 6, 2)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            h = excitation.hidden(p, w1, b1, "silu")
            torch.testing.assert_close(h, excitation.hidden_reference(p, w1, b1, "silu"))
            torch.testing.assert_close(excitation.excite(x, h, w2, b2, "sigmoid"),
                                       excitation.excite_reference(x, h, w2, b2, "sigmoid"))
    assert len(calls) == 1  # neither kernel is tried again
    assert "the fused squeeze-excitation kernel failed (RuntimeError: out of resource" in caplog.text


def _check_gate_kernels(dtype: torch.dtype) -> None:
    hidden_kernel, excite_kernel = excitation._kernels()
    torch.manual_seed(2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    # efficientnet_b0's widest gate; odd sizes (masks); MobileNetV3's widest hidden (several tiles); a
    # map of more pixels than one program's block
    for shape, fmt in (((3, 1152, 48, (7, 7)), torch.contiguous_format), ((2, 7, 3, (5, 3)), torch.channels_last),
                       ((1, 960, 240, (7, 7)), torch.channels_last), ((2, 40, 10, (14, 11)), torch.contiguous_format),
                       ((1, 40, 10, (14, 11)), torch.channels_last)):
        x, p, w1, b1, w2, b2 = _operands(*shape, dtype=dtype, fmt=fmt)
        for act1 in excitation.HIDDEN_ACTIVATIONS:
            h = excitation._launch_hidden(hidden_kernel, p, w1, b1, act1)
            want_h = excitation.hidden_reference(p.float(), w1.float(), b1.float(), act1).to(dtype)
            torch.testing.assert_close(h, want_h, **tol, msg=lambda m: f"{shape} {act1}: {m}")
            for act2 in excitation.GATE_ACTIVATIONS:
                got = excitation._launch_excite(excite_kernel, x, h, w2, b2, act2)
                want = excitation.excite_reference(x.float(), h.float(), w2.float(), b2.float(), act2).to(dtype)
                assert got.shape == want.shape and got.dtype == dtype and got.stride() == x.stride()
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{shape} {fmt} {act2}: {m}")


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


@pytest.mark.parametrize("check", ["_check_gate_kernels", "_check_epilogue_kernel"])
def test_the_triton_kernels_equal_eagers_ops_under_the_interpreter(check):
    # Triton's interpreter runs a kernel on CPU tensors, but only where TRITON_INTERPRET was set
    # before Triton was first imported: a process of its own
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = f"import torch, test_excitation as t\nfor d in (torch.float32, torch.float16): t.{check}(d)"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
