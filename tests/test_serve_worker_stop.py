"""A front-end worker's graceful stop (``frontend.GracefulStop``), on stand-ins for aiohttp's runner
and site: how long it waits before its connections are closed, and what it tells clients. CPU only;
the real worker is in ``test_serve_cli.py``."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuloom.serve.frontend import GracefulStop


class _Site:
    def __init__(self) -> None:
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


class _Runner:
    def __init__(self, connections: int) -> None:
        self.server = type("Server", (), {"connections": [object()] * connections})()


def _stop(graceful: GracefulStop, runner: _Runner, site: _Site) -> float:
    t0 = time.monotonic()
    asyncio.run(graceful.stop(runner, site))
    return time.monotonic() - t0


def test_with_no_connection_open_the_stop_closes_the_listener_and_ends_at_once():
    g, site = GracefulStop(grace_s=2.0), _Site()
    assert _stop(g, _Runner(0), site) < 0.2 and site.stopped and g.stopping


def test_idle_connections_are_kept_for_the_quiet_time_only_and_busy_ones_until_the_grace():
    g, site = GracefulStop(grace_s=0.6), _Site()
    took = _stop(g, _Runner(3), site)  # nothing answered since the stop began
    assert g.QUIET_S - 0.05 <= took < g.QUIET_S + 0.3, took

    async def busy() -> float:  # answers keep coming: held up to the grace, no longer
        stop = asyncio.create_task(g2.stop(_Runner(1), _Site()))
        t0 = time.monotonic()
        while not stop.done():
            g2.last_answer = time.monotonic()
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    g2 = GracefulStop(grace_s=0.6)
    took = asyncio.run(busy())
    assert 0.55 <= took < 1.0, took


def test_grace_zero_stops_at_once_as_before_and_a_bad_setting_keeps_the_default(monkeypatch, caplog):
    g, site = GracefulStop(grace_s=0.0), _Site()
    assert _stop(g, _Runner(5), site) < 0.1 and not site.stopped and not g.stopping  # cleanup does it all
    monkeypatch.setenv("GPULOOM_WORKER_STOP_GRACE_S", "0")
    assert GracefulStop().grace_s == 0.0
    for bad in ("soon", "nan", "-1", "inf"):
        monkeypatch.setenv("GPULOOM_WORKER_STOP_GRACE_S", bad)
        assert GracefulStop().grace_s == GracefulStop.GRACE_S
        assert f"GPULOOM_WORKER_STOP_GRACE_S={bad!r} is not a number of seconds" in caplog.text


@pytest.mark.parametrize("stopping", [False, True])
def test_answers_close_their_connection_only_once_stopping(stopping):
    from aiohttp import web

    g = GracefulStop(grace_s=1.0)
    g.stopping = stopping
    response = web.Response(text="x")
    before = time.monotonic()
    asyncio.run(g.hook()(None, response))
    assert g.last_answer >= before
    assert (response.headers.get("Connection") == "close") is stopping
    assert (response.keep_alive is False) is stopping
