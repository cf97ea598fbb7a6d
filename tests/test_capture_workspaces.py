"""cublas_workspaces_in_pool: torch's cuBLAS workspace map is cleared before and after each capture,
and captures on two threads take turns (another thread's clear would free a capture's workspaces
in the middle of it). The GPU half: tests/test_engine_gpu.py."""

from __future__ import annotations

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
