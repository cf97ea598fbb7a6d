"""ServeCore.submit checks a request's inputs once: a request whose layout already matched the
model's config exactly (checked_for) skips the protocol's check, and the runtime skips its own."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_fake  # noqa: E402

from gpuloom.serve import core as core_module  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.protocol import ProtocolError  # noqa: E402


@pytest.fixture
def served():
    service = serve_fake.make_service()
    cfg, module = serve_fake.slow_net(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        service.load(cfg, module)
    yield ServeCore(service), service
    service.close(drain=False)


def test_the_first_exact_request_is_checked_and_says_so_and_a_later_one_of_that_layout_is_not(served, monkeypatch):
    core, service = served
    calls = []
    check = core_module.check_inputs
    monkeypatch.setattr(core_module, "check_inputs", lambda c, i: calls.append(1) or check(c, i))
    x = {"x": np.ones((2, 4), np.float32)}
    fut, matched = core.submit("slow", None, x, None)
    assert matched is service.config("slow") and len(calls) == 1
    fut.result(10)
    fut, again = core.submit("slow", None, x, None, checked_for=matched)
    assert again is matched and len(calls) == 1  # not checked again
    assert fut.result(10)["y"].shape == (2, 4)


def test_a_config_that_is_no_longer_the_models_does_not_let_bad_inputs_through(served):
    core, service = served
    _, matched = core.submit("slow", None, {"x": np.ones((1, 4), np.float32)}, None)
    import dataclasses

    stale = dataclasses.replace(matched)  # equal, but not the model's config object (a reload's)
    with pytest.raises(ProtocolError, match="datatype"):
        core.submit("slow", None, {"x": np.ones((1, 4), np.float64)}, None, checked_for=stale)
    assert core.books.snapshot()["slow"].rejected["invalid_input"] == 1


def test_until_done_returns_once_the_future_is_done_from_any_thread_and_a_cancelled_wait_cancels_it():
    import asyncio
    import concurrent.futures
    import threading

    from gpuloom.serve.core import until_done

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        seen = []
        done = concurrent.futures.Future()
        done.set_result(1)
        await until_done(done)  # already done: at once
        seen.append("done")
        own = concurrent.futures.Future()
        loop.call_later(0.01, own.set_result, 2)  # on the loop's own thread (the hosted runtime)
        await asyncio.wait_for(until_done(own), 5)
        seen.append(own.result())
        other = concurrent.futures.Future()
        threading.Timer(0.01, other.set_exception, (ValueError("x"),)).start()  # from another thread
        await asyncio.wait_for(until_done(other), 5)  # returns; the caller reads the outcome
        seen.append(type(other.exception()).__name__)
        left = concurrent.futures.Future()
        task = asyncio.ensure_future(until_done(left))
        await asyncio.sleep(0.01)
        task.cancel()  # the handler cancelled (a client gone): the future is cancelled, as wrap_future does
        try:
            await task
        except asyncio.CancelledError:
            seen.append("cancelled")
        seen.append(left.cancelled())
        return seen

    assert asyncio.run(scenario()) == ["done", 2, "ValueError", "cancelled", True]
