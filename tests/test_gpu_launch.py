"""The raw launch path (gpuloom/gpu/launch.py) on CPU: a fake driver whose "device" is host memory
runs each copy as a real memmove at the addresses the plan computes, and the "graph" as a numpy
function over the static buffers, so wrong offsets or sizes show up as wrong outputs."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from gpuloom.gpu.launch import LaunchPlan, row_bytes


class HostDriver:
    """Driver stand-in: every call is done at once, in host memory, and logged."""

    def __init__(self, graphs: dict) -> None:
        self.graphs = graphs  # graph handle -> callable doing the graph's work
        self.calls: list[tuple] = []

    def copy_in(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("in", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def copy_out(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("out", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        self.calls.append(("graph", graph_exec))
        self.graphs[graph_exec]()

    def record(self, event: int, stream: int) -> None:
        self.calls.append(("event", event))


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def two_input_graph():
    """Static buffers of a bucket of 4: x (4, 3) float32, k (4,) int64 -> y = x * k, s = x.sum(1)."""
    x, k = np.zeros((4, 3), np.float32), np.zeros(4, np.int64)
    y, s = np.zeros((4, 3), np.float32), np.zeros(4, np.float32)

    def run() -> None:
        y[...] = x * k[:, None]
        s[...] = x.sum(1)

    plan = LaunchPlan(stream=7, graph_exec=99,
                      inputs=((addr(x), row_bytes(x.shape, 4)), (addr(k), row_bytes(k.shape, 8))),
                      outputs=((addr(y), row_bytes(y.shape, 4)), (addr(s), row_bytes(s.shape, 4))))
    return plan, HostDriver({99: run})


def test_row_bytes_is_one_row_of_the_buffer():
    assert row_bytes((8, 3, 224, 224), 4) == 3 * 224 * 224 * 4
    assert row_bytes((8,), 8) == 8


def test_rows_in_land_at_their_rows_and_only_n_rows_come_out(two_input_graph):
    plan, drv = two_input_graph
    rng = np.random.default_rng(1)
    rows = [(rng.standard_normal(3).astype(np.float32), np.array(i + 2, np.int64)) for i in range(3)]
    out_y, out_s = np.full((4, 3), -1, np.float32), np.full(4, -1, np.float32)
    plan.copy_inputs(drv, 3, 0, rows_in=[[(addr(a), a.nbytes) for a in r] for r in rows])
    plan.replay(drv, 1, 2)
    plan.copy_outputs(drv, 3, [addr(out_y), addr(out_s)], 3)
    xs = np.stack([r[0] for r in rows])
    ks = np.array([int(r[1]) for r in rows])
    np.testing.assert_array_equal(out_y[:3], (xs * ks[:, None]).astype(np.float32))
    np.testing.assert_array_equal(out_s[:3], xs.sum(1))
    assert (out_y[3] == -1).all() and out_s[3] == -1  # row n is not copied
    # order on the stream: t_in, inputs, t0, graph, t1, outputs, done
    assert [c[0] for c in drv.calls] == ["event"] + ["in"] * 6 + ["event", "graph", "event", "out", "out", "event"]
    assert [c[1] for c in drv.calls if c[0] == "event"] == [0, 1, 2, 3]


def test_batch_in_copies_n_contiguous_rows_per_input(two_input_graph):
    plan, drv = two_input_graph
    xs = np.arange(6, dtype=np.float32).reshape(2, 3)
    ks = np.array([3, 5], np.int64)
    out_y, out_s = np.zeros((4, 3), np.float32), np.zeros(4, np.float32)
    plan.copy_inputs(drv, 2, 0, batch_in=[addr(xs), addr(ks)])
    plan.replay(drv, 1, 2)
    plan.copy_outputs(drv, 2, [addr(out_y), addr(out_s)], 3)
    np.testing.assert_array_equal(out_y[:2], (xs * ks[:, None]).astype(np.float32))
    assert drv.calls[:3] == [("event", 0), ("in", 24), ("in", 16)]


def test_a_row_of_the_wrong_size_is_refused_before_anything_is_copied(two_input_graph):
    plan, drv = two_input_graph
    good = (np.zeros(3, np.float32), np.array(1, np.int64))
    bad = (np.zeros(4, np.float32), np.array(1, np.int64))
    with pytest.raises(ValueError, match="does not fit"):
        plan.copy_inputs(drv, 2, 0, rows_in=[[(addr(a), a.nbytes) for a in r] for r in (good, bad)])
    with pytest.raises(ValueError, match="does not fit"):
        plan.copy_inputs(drv, 1, 0, rows_in=[[(addr(good[0]), 12)]])  # an input missing
    assert drv.calls == []


def test_driver_refuses_a_library_that_is_not_there():
    from gpuloom.gpu.launch import Driver

    with pytest.raises(OSError):
        Driver(0, library="libcuda-not-here.so.0")
