"""scripts/diag_branch_overlap.py --branches: its bookkeeping, with the GPU's parts faked (CPU)."""

from __future__ import annotations

import json
import types

import torch

import gpuloom
import test_engine_gpu
from script_loader import load_script


def test_by_branches_times_each_count_and_relates_it_to_the_fewest(monkeypatch, tmp_path, capsys):
    mod = load_script("diag_branch_overlap")

    def fake_compile(model, inputs, max_batch, streams):
        assert model.reduce == "stack" and model.branches[0][0][0].in_features == 64  # the input's width
        return types.SimpleNamespace(k=len(model.branches), plan=types.SimpleNamespace(
            num_streams=len(model.branches) if streams == "max" else 1))

    # the device's time: 0.08 ms a branch alone, 0.03 ms more per further branch; events add 0.01 ms
    monkeypatch.setattr(gpuloom, "compile", fake_compile)
    monkeypatch.setattr(test_engine_gpu, "_replay_ms",
                        lambda cm, x, busy_ahead=False: 0.08 + 0.03 * (cm.k - 1) + (0.0 if busy_ahead else 0.01))
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    out = tmp_path / "b.json"
    assert mod.by_branches([1, 2, 4], 2, torch.zeros(1, 64), str(out), "stack") == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["width"] for r in rows} == {64}
    assert [(r["round"], r["branches"]) for r in rows] == [(0, 1), (0, 2), (0, 4), (1, 4), (1, 2), (1, 1)]
    assert {r["reduce"] for r in rows} == {"stack"}
    four = [r for r in rows if r["branches"] == 4]
    assert all(r["streams"] == 4 and r["busy_over_fewest"] == round(0.17 / 0.08, 3) for r in four)
    assert all(r["streams"] == 1 and r["busy_over_fewest"] == 1.0 for r in rows if r["branches"] == 1)
    assert abs(four[0]["ms"] - 0.18) < 1e-9 and "fake GPU" in capsys.readouterr().out


def test_branches_summed_by_one_kernel_equal_the_chain_of_adds():
    from engine_models import Branches

    chain = Branches(k=3, width=8, depth=2).eval()
    stack = Branches(k=3, width=8, depth=2, reduce="stack").eval()
    stack.load_state_dict(chain.state_dict())
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(stack(x), chain(x))
    try:
        Branches(reduce="tree")
    except ValueError as e:
        assert "'chain' or 'stack'" in str(e)
    else:
        raise AssertionError("an unknown reduce was accepted")
