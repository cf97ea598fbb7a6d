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


_CArg = type(ctypes.byref(ctypes.c_int()))  # what ctypes.byref gives: not logged


class FakeGraphApi:
    """The CUDA graph calls ``Driver.wrap_graph`` makes, on graphs of plain Python objects: nodes
    (kind, payload), edges, clones, instances; each call is logged. Handles are small integers."""

    def __init__(self, fail: str = "") -> None:
        self.next = 1000
        self.graphs: dict[int, dict] = {}  # graph -> {"nodes": {node: (kind, payload)}, "edges": set}
        self.log: list[tuple] = []
        self.fail = fail  # name of a call that returns an error

    def new(self) -> int:
        self.next += 1
        return self.next

    def graph(self, nodes: dict, edges: set) -> int:
        g = self.new()
        self.graphs[g] = {"nodes": dict(nodes), "edges": set(edges)}
        return g

    @staticmethod
    def val(v):
        return v.value if isinstance(v, ctypes.c_void_p) else v

    def owner(self, node: int) -> dict:
        return next(g for g in self.graphs.values() if node in g["nodes"])

    def bind(self, drv) -> None:
        api = self

        def call(name, fn):
            def run(*args):
                api.log.append((name,) + tuple(list(a) if isinstance(a, ctypes.Array) else api.val(a)
                                               for a in args if not isinstance(a, _CArg)))
                return 1 if api.fail == name else fn(*args)
            return run

        def clone(out, child):
            g = api.graphs[api.val(child)]
            ren = {n: api.new() for n in g["nodes"]}
            out._obj.value = api.graph({ren[n]: k for n, k in g["nodes"].items()},
                                       {(ren[a], ren[b]) for a, b in g["edges"]})
            return 0

        def create(out, flags):
            out._obj.value = api.graph({}, set())
            return 0

        def listing(select):
            def get(of, arr, count):
                found = select(api.val(of))
                if arr is not None:
                    for i, n in enumerate(found):
                        arr[i] = n
                count._obj.value = len(found)
                return 0
            return get

        roots = listing(lambda g: [n for n in api.graphs[g]["nodes"] if not any(b == n for _, b in api.graphs[g]["edges"])])
        nodes = listing(lambda g: list(api.graphs[g]["nodes"]))
        dependents = listing(lambda n: [b for a, b in api.owner(n)["edges"] if a == n])

        def adder(kind, payload):
            def add(out, graph, deps, ndeps, *args):
                g = api.graphs[api.val(graph)]
                node = api.new()
                g["nodes"][node] = (kind, payload(*args))
                g["edges"] |= {(deps[i], node) for i in range(ndeps)}
                out._obj.value = node
                return 0
            return add

        def memcpy_payload(params, ctx):
            p = params._obj
            return {f: getattr(p, f) for f, _ in p._fields_ if getattr(p, f)}

        def edges(graph, src, dst, n):
            api.graphs[api.val(graph)]["edges"] |= {(src[i], dst[i]) for i in range(n)}
            return 0

        def instantiate(out, graph, flags):
            out._obj.value = api.new()
            return 0

        def error_name(err, name):
            name._obj.value = b"CUDA_ERROR_FAKE"
            return 0

        for attr, name, fn in (
                ("_clone", "cuGraphClone", clone), ("_graph_create", "cuGraphCreate", create),
                ("_root_nodes", "cuGraphGetRootNodes", roots), ("_graph_nodes", "cuGraphGetNodes", nodes),
                ("_dependents", "cuGraphNodeGetDependentNodes", dependents),
                ("_add_record", "cuGraphAddEventRecordNode", adder("record", lambda ev: ev)),
                ("_add_child", "cuGraphAddChildGraphNode", adder("child", lambda g: g)),
                ("_add_memcpy", "cuGraphAddMemcpyNode", adder("memcpy", memcpy_payload)),
                ("_add_edges", "cuGraphAddDependencies", edges),
                ("_instantiate", "cuGraphInstantiateWithFlags", instantiate),
                ("_upload", "cuGraphUpload", lambda exe, st: 0),
                ("_exec_destroy", "cuGraphExecDestroy", lambda exe: 0),
                ("_graph_destroy", "cuGraphDestroy", lambda g: 0)):
            setattr(drv, attr, call(name, fn))
        drv._error_name = error_name


def fake_driver(fail: str = ""):
    import threading

    from gpuloom.gpu.launch import Driver

    drv = object.__new__(Driver)
    drv._local = threading.local()
    drv._local.ready = True  # ensure_context: a context is current
    drv.context = 4242
    api = FakeGraphApi(fail)
    api.bind(drv)
    return drv, api


def test_a_flat_launch_graph_puts_the_events_and_copies_around_a_clone_of_the_captured_graph():
    """Driver.wrap_graph(flat=True): t0 before every root of a clone of the captured graph; t1 after
    every leaf; each output copy (device to host, its bytes) after t1; done after every copy;
    instantiated and uploaded on the lane's stream. The captured graph itself is left alone."""
    drv, api = fake_driver()
    a, b, c = 1, 2, 3
    child = api.graph({a: ("kernel", "a"), b: ("kernel", "b"), c: ("kernel", "c")}, {(a, b), (a, c)})
    before = {k: set(v) if isinstance(v, set) else dict(v) for k, v in api.graphs[child].items()}
    graph, exe = drv.wrap_graph(child, 11, 12, [(0x7000, 0x9000, 16), (0x7100, 0x9100, 8)], 13, 5, flat=True)
    assert api.graphs[child] == before
    g = api.graphs[graph]
    kind = {n: k for n, k in g["nodes"].items()}
    by = {k: n for n, k in kind.items() if k[0] == "record"}
    t0, t1, done = by[("record", 11)], by[("record", 12)], by[("record", 13)]
    copies = sorted((n for n, k in kind.items() if k[0] == "memcpy"), key=lambda n: kind[n][1]["dstHost"])
    kernels = {kind[n][1]: n for n, k in kind.items() if k[0] == "kernel"}
    assert len(g["nodes"]) == 3 + 3 + 2
    assert g["edges"] == {(kernels["a"], kernels["b"]), (kernels["a"], kernels["c"]), (t0, kernels["a"]),
                          (kernels["b"], t1), (kernels["c"], t1), (t1, copies[0]), (t1, copies[1]),
                          (copies[0], done), (copies[1], done)}
    assert [kind[n][1] for n in copies] == [
        {"srcMemoryType": 2, "srcDevice": 0x9000, "srcPitch": 16, "srcHeight": 1, "dstMemoryType": 1,
         "dstHost": 0x7000, "dstPitch": 16, "dstHeight": 1, "WidthInBytes": 16, "Height": 1, "Depth": 1},
        {"srcMemoryType": 2, "srcDevice": 0x9100, "srcPitch": 8, "srcHeight": 1, "dstMemoryType": 1,
         "dstHost": 0x7100, "dstPitch": 8, "dstHeight": 1, "WidthInBytes": 8, "Height": 1, "Depth": 1}]
    assert [e[-1] for e in api.log if e[0] == "cuGraphAddMemcpyNode"] == [4242, 4242]  # in the driver's context
    assert ("cuGraphInstantiateWithFlags", graph, 0) in api.log and ("cuGraphUpload", exe, 5) in api.log
    assert api.log.index(("cuGraphUpload", exe, 5)) > max(i for i, e in enumerate(api.log) if e[0].startswith("cuGraphAdd"))

    # around a child graph node instead: t0 -> child -> t1 -> copy -> done, in a graph of its own
    graph2, _ = drv.wrap_graph(child, 11, 12, [(0x7000, 0x9000, 16)], 13, 5)
    g2 = api.graphs[graph2]
    k2 = {k[0] if k[0] != "record" else k: n for n, k in g2["nodes"].items()}
    assert g2["nodes"][k2["child"]] == ("child", child)
    assert g2["edges"] == {(k2[("record", 11)], k2["child"]), (k2["child"], k2[("record", 12)]),
                           (k2[("record", 12)], k2["memcpy"]), (k2["memcpy"], k2[("record", 13)])}

    # an empty captured graph: t1 still follows t0
    empty = api.graph({}, set())
    graph3, _ = drv.wrap_graph(empty, 11, 12, [], 13, 5, flat=True)
    g3 = api.graphs[graph3]
    r = {k: n for n, k in g3["nodes"].items()}
    assert g3["edges"] == {(r[("record", 11)], r[("record", 12)]), (r[("record", 12)], r[("record", 13)])}


def test_a_launch_graph_that_fails_part_way_is_destroyed_and_names_the_call():
    from gpuloom.gpu.errors import DriverError

    for call in ("cuGraphAddMemcpyNode", "cuGraphInstantiateWithFlags", "cuGraphUpload"):
        drv, api = fake_driver(fail=call)
        child = api.graph({1: ("kernel", "a")}, set())
        with pytest.raises(DriverError, match=f"{call}.*CUDA_ERROR_FAKE"):
            drv.wrap_graph(child, 11, 12, [(0x7000, 0x9000, 16)], 13, 5, flat=True)
        clone = next(g for g in api.graphs if g != child)
        assert ("cuGraphDestroy", clone) in api.log, call
        made_exec = call == "cuGraphUpload"  # instantiated before the upload failed
        assert any(e[0] == "cuGraphExecDestroy" for e in api.log) is made_exec, call
