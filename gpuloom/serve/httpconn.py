"""A lean HTTP/1.1 client for the load generator: keep-alive connections, each request encoded once.

Why: a load generator on the same host as the server it measures competes with it for CPU. On the
H200 host at mix6 x0.75-x1 (runs 84, ``docs/reports/serving.md``) the client processes, on aiohttp,
ran at 0.6-0.9 CPU-s/s each and fell up to 460 ms behind their schedule. On the build VM aiohttp's
client spent about 1.6 ms of CPU per 600 KB request against a plain echo server; the kernel's own
share of sending 600 KB over loopback is about 0.2 ms. This client writes a request's bytes, built
once per distinct request (head and body in one ``bytes``: no join per send), and parses only the
status line and headers.

What it speaks: HTTP/1.1 over plain TCP; responses with ``Content-Length``, chunked, or delimited by
the connection's close; ``Connection: close`` honoured; 1xx responses skipped. One request at a time
per connection (no pipelining); a request finding no idle connection opens one (no limit, as
``aiohttp.TCPConnector(limit=0)``). A timed-out or failed connection is closed, never reused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Response", "ConnectionPool", "encode_request"]

_MAX_HEAD = 64 * 1024  # a response head longer than this is refused (a server speaking something else)


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lowercased; a repeated header keeps its last value
    body: bytes


def encode_request(method: str, host: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """One request's bytes, head and body together (what ``ConnectionPool.request`` sends)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    for k, v in (headers or {}).items():
        if k.lower() in ("host", "content-length", "transfer-encoding"):
            raise ValueError(f"header {k!r} is set by the client itself")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _BadResponse(Exception):
    """The server's bytes are not an HTTP/1.1 response this client understands."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses the response to the one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
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
            self._fail(_BadResponse(f"{len(data)} bytes arrived with no request in flight"))
            return
        self._buf += data
        try:
            self._parse()
        except _BadResponse as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        if self._until_close and not self._in_head:
            self._finish()
        else:
            w.set_exception(ConnectionResetError("the server closed the connection before answering in full"))

    # -- the request ----------------------------------------------------------------------------
    def send(self, raw: bytes, waiter: asyncio.Future) -> None:
        self.waiter = waiter
        self._reset()
        self.transport.write(raw)

    def abort(self, exc: Exception) -> None:
        """Fail the request in flight with ``exc`` and drop the connection (a timeout)."""
        self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
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
                        raise _BadResponse(f"response head longer than {_MAX_HEAD} bytes")
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
            raise _BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self._status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _BadResponse(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self._headers = headers
        conn = headers.get("connection", "").lower()
        self._keep = "close" not in conn and (parts[0] != b"HTTP/1.0" or "keep-alive" in conn)
        if self._status < 200 or self._status in (204, 304):
            self._need = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._need = int(headers["content-length"])
            except ValueError:
                raise _BadResponse(f"bad Content-Length {headers['content-length']!r}") from None
            if self._need < 0:
                raise _BadResponse(f"bad Content-Length {self._need}")
        else:
            self._until_close, self._keep = True, False

    def _read_chunks(self) -> bool:
        """Consume whole chunks from the buffer; True once the last chunk and trailers are in."""
        while True:
            if self._need is None:  # at a size line
                eol = self._buf.find(b"\r\n")
                if eol < 0:
                    return False
                size_text = bytes(self._buf[:eol]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise _BadResponse(f"bad chunk size {size_text[:20]!r}") from None
                del self._buf[:eol + 2]
                if size == 0:
                    self._need = -1  # trailers until an empty line
                else:
                    self._need = size + 2  # the data and its CRLF
            if self._need == -1:
                end = self._buf.find(b"\r\n")
                while end > 0:  # a trailer line: skip it
                    del self._buf[:end + 2]
                    end = self._buf.find(b"\r\n")
                if end < 0:
                    return False
                del self._buf[:2]
                return True
            if len(self._buf) < self._need:
                return False
            self._body += self._buf[:self._need - 2]
            del self._buf[:self._need]
            self._need = None

    def _finish(self) -> None:
        if self._buf:  # more than the response: the server sent something unasked
            self._fail(_BadResponse(f"{len(self._buf)} bytes after the response"))
            return
        w, self.waiter = self.waiter, None
        if not self._keep:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        w.set_result(Response(self._status, self._headers, bytes(self._body)))


class ConnectionPool:
    """Keep-alive connections to one ``http://host:port`` (no TLS): ``await pool.request(raw)``.

    Failures raise what the socket raised (``ConnectionRefusedError``, ``ConnectionResetError``) or
    ``TimeoutError`` after ``timeout_s`` from the send; a load generator counts them by name."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http":
            raise ValueError(f"the lean client speaks plain http://, found {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout must be positive, found {timeout_s}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.netloc = parts.netloc
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    def encode(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
        return encode_request(method, self.netloc, path, body, headers)

    async def request(self, raw: bytes) -> Response:
        loop = asyncio.get_running_loop()
        conn = None
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                conn = c
                break
        if conn is None:
            _, conn = await asyncio.wait_for(loop.create_connection(_Connection, self.host, self.port), self.timeout_s)
            self._all.add(conn)
        fut = loop.create_future()
        timer = loop.call_later(self.timeout_s, conn.abort, TimeoutError(f"no answer within {self.timeout_s:g} s"))
        try:
            conn.send(raw, fut)
            resp = await fut
        except BaseException:
            conn.abort(ConnectionAbortedError("request abandoned"))  # cancelled, or failed: never reused
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
