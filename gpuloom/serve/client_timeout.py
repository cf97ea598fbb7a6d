"""Closing connections whose client keeps the server waiting: silent, stalled or idle ones.

aiohttp waits for a request's body as long as the client likes, and its keep-alive timer, which also
runs before a connection's first request (aiohttp 3.14), defaults to an hour. So a client that opens
connections and sends nothing, or sends a body that never ends, holds a file descriptor per
connection until the server can accept no more. Measured before this module: a silent connection and
a request with half its body were both still open after 100 s.
:class:`ClientTimeouts` closes a connection that

- has not sent its first request's headers ``timeout_s`` after the server first saw it (aiohttp's
  keep-alive timer, set to ``timeout_s``, closes these too; the sweep does not rely on it),
- has not sent the whole body of a request ``timeout_s`` after that request's headers (only the sweep), or
- has sat idle ``timeout_s`` after an answer (aiohttp's keep-alive timer).

A request that is being computed is never cut: then the server, not the client, is taking its time.
A sweep every ``timeout_s / 4`` (at most every second) looks at the server's connections. A middleware
tells it which request each connection is in, using ``request.protocol``, the connection's handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from aiohttp import web

from . import DEFAULT_CLIENT_TIMEOUT_S, check_client_timeout

log = logging.getLogger("gpuloom.serve.http")


@dataclass
class _Connection:
    handler: Any  # aiohttp's RequestHandler (kept, so that a reused id() is not taken for it)
    seen: float  # when the sweep (or the middleware) first saw the connection
    request: Any = None  # the request being handled, if any
    started: float = 0.0  # when its handler started (its headers had arrived)
    answered: int = 0  # requests answered on this connection

    def overdue(self, now: float, timeout_s: float) -> str | None:
        """Why the client has kept the server waiting too long, or None."""
        if self.request is not None:
            if not self.request.content.is_eof() and now - self.started > timeout_s:
                return "body"
            return None  # the whole body is in: the server is the one taking its time
        if self.answered == 0 and now - self.seen > timeout_s:
            return "headers"
        return None  # idle after an answer: aiohttp's keep-alive timer closes it


@dataclass
class ClientTimeouts:
    """One server's guard: :meth:`runner` sets up the server's app with it; :meth:`stop` it before the
    runner's cleanup."""

    timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    closed: Counter = field(default_factory=Counter)  # connections closed, by reason
    _conns: dict = field(default_factory=dict)  # id(handler) -> _Connection
    _task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.timeout_s = check_client_timeout(self.timeout_s)
        guard = self

        @web.middleware
        async def middleware(request: web.Request, handler):
            conn = guard.begin(request, time.monotonic())
            try:
                return await handler(request)
            finally:
                conn.request = None
                conn.answered += 1

        self.middleware = middleware

    async def runner(self, app: web.Application, **kwargs: Any) -> web.AppRunner:
        """``app``'s runner, set up, with this guard: its middleware outermost, idle keep-alive
        connections closed after the same timeout (aiohttp's own timer), and the sweep started."""
        app.middlewares.insert(0, self.middleware)
        runner = web.AppRunner(app, keepalive_timeout=self.timeout_s, **kwargs)
        await runner.setup()
        self._start(runner.server)
        return runner

    def begin(self, request: Any, now: float) -> _Connection:
        """Note that ``request``'s handler starts at ``now`` (its headers are in) on its connection."""
        conn = self._connection(request.protocol, now)
        conn.request, conn.started = request, now
        return conn

    def _connection(self, handler: Any, now: float) -> _Connection:
        conn = self._conns.get(id(handler))
        if conn is None or conn.handler is not handler:
            conn = self._conns[id(handler)] = _Connection(handler, now)
        return conn

    def sweep(self, handlers: Iterable[Any], now: float | None = None) -> int:
        """Close every connection among ``handlers`` (the server's) whose client is overdue; how many."""
        now = time.monotonic() if now is None else now
        alive, n = set(), 0
        for h in handlers:
            alive.add(id(h))
            conn = self._connection(h, now)
            why = conn.overdue(now, self.timeout_s)
            transport = getattr(h, "transport", None)
            if why is None or transport is None or transport.is_closing():
                continue
            log.debug("closing a connection whose client sent no %s for %.1f s", why, self.timeout_s)
            transport.close()
            self.closed[why] += 1
            n += 1
        for key in [k for k in self._conns if k not in alive]:  # gone: forget them
            del self._conns[key]
        return n

    def _start(self, server: web.Server) -> None:
        """Sweep ``server``'s connections from now on (on the running loop)."""
        every = min(1.0, self.timeout_s / 4)

        async def run() -> None:
            while True:
                await asyncio.sleep(every)
                self.sweep(server.connections)

        self._task = asyncio.get_running_loop().create_task(run(), name="gpuloom-client-timeouts")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
