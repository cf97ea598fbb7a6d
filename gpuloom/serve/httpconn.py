"""A lean HTTP/1.1 client for the load generator: keep-alive connections, each request encoded once.

Why: a load generator on the same host as the server it measures competes with it for CPU. On the
H200 host at mix6 x0.75-x1 (runs 84, ``docs/reports/serving.md``) the client processes, on aiohttp,
ran at 0.6-0.9 CPU-s/s each and fell up to 460 ms behind their schedule. On the build VM aiohttp's
client spent about 1.6 ms of CPU per 600 KB request against a plain echo server; the kernel's own
share of sending 600 KB over loopback is about 0.2 ms. This client writes a request's bytes, built
once per distinct request (head and body in one ``bytes``: no join per send), and parses only the
status line and headers.

What it speaks: HTTP/1.1 over plain TCP, to the server's root (a URL with a path is refused);
requests with a body (no HEAD: its answer's length would be misread); responses with
``Content-Length``, chunked, or delimited by the connection's clean close; ``Connection: close``
honoured; 1xx responses skipped. One request at a time per connection (no pipelining); a request
finding no idle connection opens one (no limit, as ``aiohttp.TCPConnector(limit=0)``). A timed-out
or failed connection is closed, never reused; an idle one is closed after ``idle_s`` (below the
usual servers' keep-alive timeouts, so a request rarely meets a connection the server is closing).
A response this client cannot read fails its request with :class:`BadResponse`.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Response", "ConnectionPool", "BadResponse", "encode_request"]

_MAX_HEAD = 64 * 1024  # a response head (or a chunk's size line, or trailers) longer than this is refused
_HEX = re.compile(rb"[0-9A-Fa-f]+")


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lowercased; a repeated header keeps its last value
    body: bytes


def encode_request(method: str, host: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """One request's bytes, head and body together (what ``ConnectionPool.request`` sends)."""
    if method.upper() == "HEAD":
        raise ValueError("HEAD is not supported: its answer carries a Content-Length but no body")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    for k, v in (headers or {}).items():
        if k.lower() in ("host", "content-length", "transfer-encoding"):
            raise ValueError(f"header {k!r} is set by the client itself")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class BadResponse(ValueError):
    """The server's bytes are not an HTTP/1.1 response this client understands."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses the response to the one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # time.monotonic() when its last response was read
        self.waiter: asyncio.Future | None = None
        self._buf = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._status = 0
        self._headers: dict[str, str] = {}
        self._need: int | None = None  # body bytes still expected (Content-Length)
        self._chunked = False
        self._until_close = False
        self._keep = True
        self._body = bytearray()
        self._in_head = True

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # bytes nobody asked for: the stream is lost
            self._fail(BadResponse(f"{len(data)} bytes arrived with no request in flight"))
            return
        self._buf += data
        try:
            self._parse()
        except BadResponse as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        if self._until_close and not self._in_head and exc is None:  # a clean close ends such a body
            self._finish()
            return
        err = ConnectionResetError("the server closed the connection before answering in full")
        err.__cause__ = exc
        w.set_exception(err)

    # -- the request ----------------------------------------------------------------------------
    def send(self, raw: bytes, waiter: asyncio.Future) -> None:
        self.waiter = waiter
        self._reset()
        self.transport.write(raw)

    def abort(self, exc: Exception) -> None:
        """Fail the request in flight with ``exc`` and drop the connection (a timeout)."""
        self._fail(exc)

    def drop(self) -> None:
        """Close the connection now, whatever it was doing (a request abandoned or failed)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        self.drop()
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    # -- parsing --------------------------------------------------------------------------------
    def _parse(self) -> None:
        while True:
            if self._in_head:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > _MAX_HEAD:
                        raise BadResponse(f"response head longer than {_MAX_HEAD} bytes")
                    return
                self._read_head(bytes(self._buf[:end]))
                del self._buf[:end + 4]
                self._in_head = False
                if self._status < 200:  # 100 Continue and friends: the real response follows
                    self._reset()
                    continue
                if self._need == 0 and not self._chunked and not self._until_close:
                    self._finish()
                    return
            if self._chunked:
                if not self._read_chunks():
                    return
                self._finish()
                return
            if self._until_close:
                self._body += self._buf
                self._buf.clear()
                return
            take = min(self._need, len(self._buf))
            self._body += self._buf[:take]
            del self._buf[:take]
            self._need -= take
            if self._need == 0:
                self._finish()
            return

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self._status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise BadResponse(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self._headers = headers
        conn = headers.get("connection", "").lower()
        self._keep = "close" not in conn and (parts[0] != b"HTTP/1.0" or "keep-alive" in conn)
        if self._status < 200 or self._status in (204, 304):
            self._need = 0
        elif headers.get("transfer-encoding", "").lower().rsplit(",", 1)[-1].strip() == "chunked":
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._need = int(headers["content-length"])
            except ValueError:
                raise BadResponse(f"bad Content-Length {headers['content-length']!r}") from None
            if self._need < 0:
                raise BadResponse(f"bad Content-Length {self._need}")
        else:
            self._until_close, self._keep = True, False

    def _read_chunks(self) -> bool:
        """Consume whole chunks from the buffer; True once the last chunk and trailers are in."""
        while True:
            if self._need is None:  # at a size line
                eol = self._line_end()
                if eol < 0:
                    return False
                size_text = bytes(self._buf[:eol]).split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size_text):
                    raise BadResponse(f"bad chunk size {size_text[:20]!r}")
                size = int(size_text, 16)
                del self._buf[:eol + 2]
                if size == 0:
                    self._need = -1  # trailers until an empty line
                else:
                    self._need = size + 2  # the data and its CRLF
            if self._need == -1:
                end = self._line_end()
                while end > 0:  # a trailer line: skip it
                    del self._buf[:end + 2]
                    end = self._line_end()
                if end < 0:
                    return False
                del self._buf[:2]
                return True
            if len(self._buf) < self._need:
                return False
            if self._buf[self._need - 2:self._need] != b"\r\n":
                raise BadResponse("a chunk's data is not followed by CRLF")
            self._body += self._buf[:self._need - 2]
            del self._buf[:self._need]
            self._need = None

    def _line_end(self) -> int:
        """Where the buffer's first line ends (-1: not in yet); a line too long is refused."""
        eol = self._buf.find(b"\r\n")
        if eol < 0 and len(self._buf) > _MAX_HEAD:
            raise BadResponse(f"a chunk size line or trailer longer than {_MAX_HEAD} bytes")
        return eol

    def _finish(self) -> None:
        if self._buf:  # more than the response: the server sent something unasked
            self._fail(BadResponse(f"{len(self._buf)} bytes after the response"))
            return
        w, self.waiter = self.waiter, None
        self.idle_since = time.monotonic()
        if not self._keep:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        w.set_result(Response(self._status, self._headers, bytes(self._body)))


class ConnectionPool:
    """Keep-alive connections to one ``http://host:port`` (no TLS, no path): ``await pool.request(raw)``.

    Failures raise what the socket raised (``ConnectionRefusedError``, ``ConnectionResetError``),
    :class:`BadResponse`, or ``TimeoutError`` when connecting and answering took more than
    ``timeout_s`` together (as aiohttp's ``ClientTimeout(total=...)``); a load generator counts them
    by name. ``idle_s``: an idle connection older than this is closed instead of reused (aiohttp's
    client: 15 s; servers' keep-alive timeouts are mostly 60-75 s)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, idle_s: float = 15.0) -> None:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http":
            raise ValueError(f"the lean client speaks plain http://, found {url!r}")
        if parts.path not in ("", "/"):
            raise ValueError(f"the lean client sends to the server's root; found the path {parts.path!r} in {url!r}")
        if not (timeout_s > 0 and idle_s > 0):
            raise ValueError(f"timeout and idle time must be positive, found {timeout_s}, {idle_s}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.netloc = parts.netloc
        self.timeout_s, self.idle_s = timeout_s, idle_s
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    def encode(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
        return encode_request(method, self.netloc, path, body, headers)

    def _idle_connection(self) -> _Connection | None:
        """The most recently used idle connection still open and young enough; the others closed."""
        stale = time.monotonic() - self.idle_s
        while self._idle:
            c = self._idle.pop()
            if not c.closed and c.idle_since >= stale:
                return c
            c.drop()
            self._all.discard(c)
        return None

    async def request(self, raw: bytes) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s  # connecting and answering together
        conn = self._idle_connection()
        if conn is None:
            try:
                _, conn = await asyncio.wait_for(loop.create_connection(_Connection, self.host, self.port),
                                                 self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no connection within {self.timeout_s:g} s") from None
            self._all.add(conn)
        fut = loop.create_future()
        timer = loop.call_at(deadline, conn.abort, TimeoutError(f"no answer within {self.timeout_s:g} s"))
        try:
            conn.send(raw, fut)
            resp = await fut
        except BaseException:
            conn.drop()  # cancelled, timed out or failed: the stream's state is unknown, never reused
            self._all.discard(conn)
            raise
        finally:
            timer.cancel()
        if conn.closed:
            self._all.discard(conn)
        else:
            self._idle.append(conn)
        return resp

    def close(self) -> None:
        for c in self._all:
            if c.transport is not None:
                c.transport.close()
        self._all.clear()
        self._idle.clear()
