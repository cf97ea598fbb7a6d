"""cublas_workspaces_in_pool: torch's cuBLAS workspace map is cleared before and after each capture,
and captures on two threads take turns (another thread's clear would free a capture's workspaces
in the middle of it); and each of the three capture sites (the engine's, a partition's, the
profiler's) clears it right before its capture begins and right after it ends, with ``torch.cuda``
faked so that this runs on the CPU. The GPU half: tests/test_engine_gpu.py."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from gpuloom.engine import capture


def test_the_map_is_cleared_around_a_capture_and_two_threads_take_turns(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("clear"), raising=False)

    def one_capture(name: str) -> None:
        with capture.cublas_workspaces_in_pool():
            log.append(f"{name} begins")
            time.sleep(0.05)  # long enough for the other thread to try to start its own
            log.append(f"{name} ends")

    threads = [threading.Thread(target=one_capture, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, second = (log[1][0], log[5][0])
    assert {first, second} == {"a", "b"}
    assert log == ["clear", f"{first} begins", f"{first} ends", "clear",
                   "clear", f"{second} begins", f"{second} ends", "clear"]


def test_the_map_is_cleared_after_a_capture_that_raised(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("clear"), raising=False)
    try:
        with capture.cublas_workspaces_in_pool():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert log == ["clear", "clear"]
    with capture.cublas_workspaces_in_pool():  # and the next capture is not locked out
        pass
    assert log == ["clear"] * 4


def test_a_failed_capture_keeps_its_own_error_when_the_clear_after_it_fails_too(monkeypatch):
    calls = []

    def clear():
        calls.append(1)
        if len(calls) == 2:  # the clear after the capture: a sticky CUDA error, say
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", clear, raising=False)
    try:
        with capture.cublas_workspaces_in_pool():
            raise ValueError("the capture's own error")
    except ValueError as e:
        assert str(e) == "the capture's own error"
    else:
        raise AssertionError("the capture's error was lost")
    assert len(calls) == 2


class _FakeCuda:
    """Just enough of ``torch.cuda`` for the three capture sites to run on the CPU, logging what a
    capture does in order: the warm-up, the map's clears, the capture's begin and end."""

    def __init__(self, monkeypatch, log: list[str]) -> None:
        self.log = log
        fake = self

        class Stream:
            device = torch.device("cuda", 0)

            def wait_stream(self, other) -> None:
                pass

        class Graph:
            def capture_begin(self, pool=None, **kw) -> None:
                fake.log.append("begin")

            def capture_end(self) -> None:
                fake.log.append("end")

        class Generator:
            def clone_state(self):
                return None

            def graphsafe_set_state(self, state) -> None:
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, **kw):
            g.capture_begin(pool=pool)
            try:
                yield
            finally:
                g.capture_end()

        self.Stream = Stream
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("clear"), raising=False)
        for name, value in {
            "Stream": Stream, "CUDAGraph": Graph, "graph": graph, "default_generators": (Generator(),),
            "current_stream": lambda device=None: Stream(), "current_device": lambda: 0,
            "stream": lambda s: contextlib.nullcontext(), "set_stream": lambda s: None,
            "synchronize": lambda device=None: None, "graph_pool_handle": lambda: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)


def _cleared_right_around_the_capture(log: list[str]) -> None:
    begin = log.index("begin")
    assert log[begin - 1:begin + 3] == ["clear", "begin", "run", "end"], log
    assert log[begin + 3] == "clear", log
    assert "run" in log[:begin - 1], f"the warm-up should run before the first clear: {log}"
    assert log.count("clear") == 2, log


def test_the_engines_capture_clears_the_map_right_around_it(monkeypatch):
    log: list[str] = []
    cuda = _FakeCuda(monkeypatch, log)

    class Executor:
        last_node = None

        def run(self, static_in, streams):
            log.append("run")
            return ["out"]

    graph, out = capture._capture_one(Executor(), [cuda.Stream()], [], pool=None, warmup=1)
    assert out == ["out"]
    _cleared_right_around_the_capture(log)


def test_a_partitions_capture_clears_the_map_right_around_it(monkeypatch):
    from gpuloom.gpu.partition import Partition

    log: list[str] = []
    cuda = _FakeCuda(monkeypatch, log)
    part = Partition(0, 16, 16, "none", 0)
    part.mode, part._streams = "green", [cuda.Stream()]  # as a green context's partition looks
    part.capture_graph(lambda: log.append("run"), warmup=1)
    _cleared_right_around_the_capture(log)


def test_the_profilers_capture_clears_the_map_right_around_it(monkeypatch):
    from gpuloom.profile import profiler

    log: list[str] = []
    _FakeCuda(monkeypatch, log)
    runner = object.__new__(profiler.GraphRunner)  # without __init__'s warm-up on a GPU

    class Spec:
        @staticmethod
        def module(*x):
            log.append("run")
            return x

    runner.spec, runner.buckets, runner.inputs = Spec(), (1,), {1: (torch.zeros(1, 4),)}
    captured = runner.capture(None)
    assert set(captured.graphs) == {1}
    _cleared_right_around_the_capture(log)
