"""Split-K linear layers (``gpuloom.engine.gemm``, compile's ``split_gemms``): the split equals
``F.linear``, the choice keeps a split only where it was timed faster, and a graph whose linear layers
split runs its DAG equal to eager (CPU; the timing itself is on the GPU, tests/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuloom
from gpuloom.engine import fold, gemm
from gpuloom.engine.dag import capture_graph
from gpuloom.engine.executor import StreamExecutor
from gpuloom.engine.streams import assign_streams


@pytest.fixture(autouse=True)
def _fresh_choices():
    gemm.clear()
    yield
    gemm.clear()


@pytest.mark.parametrize("parts", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("layout", ["2d", "3d", "seq_first_view", "no_bias"])
def test_a_split_linear_equals_linear(parts, layout):
    torch.manual_seed(parts)
    w = torch.randn(40, 96, dtype=torch.float64)
    b = None if layout == "no_bias" else torch.randn(40, dtype=torch.float64)
    if layout == "2d":
        x = torch.randn(7, 96, dtype=torch.float64)
    elif layout == "seq_first_view":  # as nn.MultiheadAttention's in-projection reads a batch-first input
        x = torch.randn(3, 5, 96, dtype=torch.float64).transpose(0, 1)
    else:
        x = torch.randn(3, 5, 96, dtype=torch.float64)
    got = gemm.split_k_linear(x, w, b, parts)
    assert got.shape == (*x.shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_a_split_that_does_not_divide_k_is_refused():
    with pytest.raises(ValueError, match="K=96 is not a multiple of parts=5"):
        gemm.split_k_linear(torch.randn(2, 96), torch.randn(4, 96), None, 5)


def test_candidates_divide_k_in_parts_of_at_least_64():
    assert gemm.candidates(768) == [1, 2, 3, 4, 6, 8]
    assert gemm.candidates(3072) == [1, 2, 3, 4, 6, 8]
    assert gemm.candidates(256) == [1, 2, 4]
    assert gemm.candidates(100) == [1]


def test_on_the_cpu_linear_is_atens_and_chooses_nothing():
    x, w, b = torch.randn(4, 768), torch.randn(8, 768), torch.randn(8)
    torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    assert gemm.choices() == {}


def _assert_within_float32_rounding(out, x, w, b) -> None:
    """``out`` is ``linear(x, w, b)`` to float32 rounding: within the bound a float32 sum of K products
    can be off by whatever the order of its additions (K u sum|x w|, u = 2^-24) of the exact (float64)
    result. A fixed 1e-5 was not such a bound: random 768-long rows failed it once in CI (2.9e-5 on
    an element of 0.84), the split and aten's call rounding differently; a wrong split is off by O(1)."""
    k = x.shape[-1]
    exact = F.linear(x.double(), w.double(), b.double())
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"off by {float((err - bound).max()):+.3g} beyond float32 rounding"
    # the bound is loose (about 0.02 here); 15,000 random splits of this shape were off by 9e-5 at most
    assert float(err.max()) < 1e-3, f"off by {float(err.max()):.3g} from the exact result"


def _cpu_as_cuda(monkeypatch, times: dict[int, float]) -> None:
    """Make ``gemm`` choose for CPU tensors too, with ``times`` (parts -> ms) as its timings."""
    monkeypatch.setattr(gemm, "_on_gpu", lambda x: True)
    monkeypatch.setattr(gemm, "_time", lambda fn: (fn(), times[fn.args[-1]])[1])  # fn: partial(linear_with, .., parts)


@pytest.mark.parametrize("times, chosen", [
    ({1: 10.0, 2: 6.0, 3: 7.0, 4: 5.0, 6: 8.0, 8: 9.0}, 4),  # the fastest split
    ({1: 10.0, 2: 9.6, 3: 9.9, 4: 9.7, 6: 9.8, 8: 9.9}, 1),  # 4% faster: within the margin, not kept
    ({1: 5.0, 2: 6.0, 3: 7.0, 4: 8.0, 6: 9.0, 8: 9.5}, 1),  # cuBLAS's own call is the fastest
])
def test_a_shape_keeps_the_split_timed_fastest_by_the_margin_and_times_once(monkeypatch, times, chosen):
    _cpu_as_cuda(monkeypatch, times)
    x, w, b = torch.randn(16, 768), torch.randn(32, 768), torch.randn(32)
    out = gemm.linear(x, w, b)
    _assert_within_float32_rounding(out, x, w, b)
    assert list(gemm.choices().values()) == [chosen]
    monkeypatch.setattr(gemm, "_time", lambda fn: pytest.fail("a shape is timed once"))
    gemm.linear(x, w, b)


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True), 2,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def test_a_graph_with_split_linears_runs_its_dag_equal_to_eager(monkeypatch):
    # every float32 linear becomes gemm.linear; forced to split (as a GPU's timing may choose), the DAG
    # run in its stream plan's order equals eager on fresh inputs
    _cpu_as_cuda(monkeypatch, {1: 10.0, 2: 4.0, 4: 5.0})
    torch.manual_seed(0)
    model = _Encoder().eval()
    graph = capture_graph(model, (torch.randn(2, 16, 128),), max_batch=8, split_gemms=True)
    assert graph.split_linears == 2 * 4 + 1  # in-projection, out-projection, two FFN layers per layer; the head
    assert sum(n.target is gemm.linear for n in graph.ops) == graph.split_linears
    ex = StreamExecutor(graph, assign_streams(len(graph.ops), graph.edges))
    for batch in (1, 3, 8):
        x = torch.randn(batch, 16, 128)
        with torch.no_grad():
            torch.testing.assert_close(ex.run([x]), model(x), rtol=1e-5, atol=1e-5)
    assert set(gemm.choices().values()) == {2}


def test_split_linears_leaves_half_precision_alone():
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    graph = capture_graph(model.to(torch.float64), (torch.randn(2, 128, dtype=torch.float64),), max_batch=4)
    assert fold.split_linears(graph.module) == 0  # float64 (and float16): not float32, unchanged


def test_compile_refuses_split_gemms_on_the_cpu():
    model = nn.Linear(128, 4).eval()
    with pytest.raises(ValueError, match="split_gemms=True times its GEMMs on the GPU"):
        gpuloom.compile(model, torch.randn(1, 128), max_batch=2, split_gemms=True)
    with pytest.raises(ValueError, match="split_gemms must be True, False or None"):
        gpuloom.compile(model, torch.randn(1, 128), max_batch=2, split_gemms="yes")
    assert gpuloom.compile(model, torch.randn(1, 128), max_batch=2).split_linears == 0  # None: off on the CPU


def test_a_scope_keeps_its_own_choices_apart_from_the_whole_gpus(monkeypatch):
    # a partition's capture (gemm.scope(its SMs)) times its shapes again: what wins on 132 SMs may
    # lose on 16; the whole GPU's choice is untouched
    times = {1: 10.0, 2: 4.0, 4: 5.0}
    _cpu_as_cuda(monkeypatch, times)
    x, w, b = torch.randn(16, 256), torch.randn(32, 256), torch.randn(32)
    gemm.linear(x, w, b)
    times.update({1: 4.0, 2: 10.0})  # on the partition cuBLAS's call wins
    with gemm.scope(16):
        gemm.linear(x, w, b)
        with gemm.scope(None):  # nested: back to the whole GPU's choices
            gemm.linear(x, w, b)
    gemm.linear(x, w, b)
    assert sorted((k[-1] is None, p) for k, p in gemm.choices().items()) == [(False, 1), (True, 2)]
