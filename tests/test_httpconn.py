"""``gpuloom.serve.httpconn``: the load generator's lean HTTP/1.1 client, against scripted servers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gpuloom.serve.httpconn import BadResponse, ConnectionPool, Response, _Connection, encode_request


async def _scripted(replies: list[bytes | None]):
    """A server that answers the i-th request it reads (whole, by Content-Length) with ``replies[i]``
    (None: never answer). Returns (server, port, seen) where ``seen`` lists (connection no., request)."""
    seen: list[tuple[int, bytes]] = []
    conns = 0

    async def handle(reader, writer):
        nonlocal conns
        conns += 1
        me = conns
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                seen.append((me, head + body))
                reply = replies[len(seen) - 1]
                if reply is None:  # never answer (the client times out)
                    await asyncio.sleep(30)
                    return
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply.lower() or b"content-length" not in reply.lower() and \
                        b"chunked" not in reply.lower():
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _run(replies, requests, *, timeout_s=5.0, idle_s=15.0, pause_s=0.0, pool_out=None):
    async def go():
        server, port, seen = await _scripted(replies)
        pool = ConnectionPool(f"http://127.0.0.1:{port}", timeout_s=timeout_s, idle_s=idle_s)
        if pool_out is not None:
            pool_out.append(pool)
        out = []
        try:
            for body in requests:
                try:
                    out.append(await pool.request(pool.encode("POST", "/v2/models/m/infer", body,
                                                              {"Content-Type": "application/octet-stream"})))
                except Exception as e:  # noqa: BLE001 - what a load generator would count
                    out.append(e)
                await asyncio.sleep(pause_s)
        finally:
            pool.close()
            server.close()
        return out, seen

    return asyncio.run(go())


def test_keep_alive_reuses_one_connection_and_the_request_arrives_whole():
    body = bytes(range(256)) * 2400  # 600 KB, as an image tensor
    answer = b"\r\n\r\n".join([b"hello"] * 100_000)  # arrives in pieces, blank lines and all
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nServer-Timing: service;dur=1.5\r\n\r\n" % len(answer) + answer
    out, seen = _run([ok, ok, ok], [body, body, b"x"])
    assert [r.status for r in out] == [200, 200, 200] and all(r.body == answer for r in out)
    assert out[0].headers["server-timing"] == "service;dur=1.5"
    assert [c for c, _ in seen] == [1, 1, 1]  # one connection for all three
    head, _, got = seen[0][1].partition(b"\r\n\r\n")
    assert got == body and b"POST /v2/models/m/infer HTTP/1.1" in head and b"Content-Length: 614400" in head


def test_chunked_close_delimited_and_informational_responses_are_read_in_full():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\nabcd\r\n3\r\nefg\r\n0\r\nX-Trailer: 1\r\n\r\n")
    cont = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\nRetry-After: 1\r\n\r\nno"
    until_close = b"HTTP/1.1 503 Service Unavailable\r\n\r\nbusy, come back"
    out, seen = _run([chunked, cont, until_close, b"HTTP/1.1 204 No Content\r\n\r\n"], [b"a", b"b", b"c", b"d"])
    assert (out[0].status, out[0].body) == (200, b"abcdefg")
    assert (out[1].status, out[1].body, out[1].headers["retry-after"]) == (429, b"no", "1")
    assert (out[2].status, out[2].body) == (503, b"busy, come back")
    assert (out[3].status, out[3].body) == (204, b"")
    assert [c for c, _ in seen] == [1, 1, 1, 2]  # the close-delimited reply ended its connection


def test_connection_close_is_honoured_and_the_next_request_opens_a_new_one():
    close = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nA"
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nB"
    out, seen = _run([close, ok], [b"1", b"2"])
    assert [r.body for r in out] == [b"A", b"B"] and [c for c, _ in seen] == [1, 2]


def test_a_timeout_fails_that_request_only_and_its_connection_is_not_reused():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    out, seen = _run([None, ok], [b"slow", b"next"], timeout_s=0.3)
    assert isinstance(out[0], TimeoutError) and isinstance(out[1], Response) and out[1].status == 200
    assert [c for c, _ in seen] == [1, 2]


@pytest.mark.parametrize("reply, match", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nAB", "after the response"),
])
def test_a_response_that_is_not_http_fails_that_request_with_what_was_wrong(reply, match):
    out, _ = _run([reply], [b"q"])
    assert isinstance(out[0], Exception) and match in str(out[0])


def test_refused_connections_and_https_urls_fail_clearly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there

    async def go():
        pool = ConnectionPool(f"127.0.0.1:{port}", timeout_s=2)
        with pytest.raises(ConnectionRefusedError):
            await pool.request(pool.encode("GET", "/"))

    asyncio.run(go())
    with pytest.raises(ValueError, match="plain http"):
        ConnectionPool("https://example.com")
    with pytest.raises(ValueError, match="set by the client"):
        encode_request("POST", "h", "/", b"", {"Content-Length": "3"})


class _Transport:
    def __init__(self):
        self.aborted = self.closed = False

    def write(self, data):
        pass

    def abort(self):
        self.aborted = True

    def close(self):
        self.closed = True


@pytest.mark.parametrize("raw, status, body", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=1\r\nabcd\r\nA\r\n0123456789\r\n0\r\n"
     b"T: 1\r\nU: 2\r\n\r\n", 200, b"abcd0123456789"),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nxyz", 201, b"xyz"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n\r\n\r\nab\r\n\r\n", 200, b"\r\n\r\nab\r\n\r\n"),
])
def test_a_response_cut_anywhere_into_two_or_into_bytes_parses_the_same(raw, status, body):
    """The parser keeps its state across reads: every cut of the bytes, and one byte per read."""
    async def parse(pieces):
        conn = _Connection()
        conn.connection_made(_Transport())
        fut = asyncio.get_running_loop().create_future()
        conn.send(b"GET", fut)
        for p in pieces:
            conn.data_received(p)
        return fut.result()

    async def every_cut():
        cuts = [[raw[:i], raw[i:]] for i in range(1, len(raw))] + [[raw[i:i + 1] for i in range(len(raw))]]
        return [await parse(c) for c in cuts]

    for r in asyncio.run(every_cut()):
        assert (r.status, r.body) == (status, body)


@pytest.mark.parametrize("raw, match", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x4\r\nabcd\r\n0\r\n\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcdXY0\r\n\r\n", "CRLF"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 70_000, "longer than"),
])
def test_bad_chunked_framing_fails_at_once_instead_of_waiting(raw, match):
    async def go():
        conn = _Connection()
        t = _Transport()
        conn.connection_made(t)
        fut = asyncio.get_running_loop().create_future()
        conn.send(b"GET", fut)
        conn.data_received(raw)
        return fut, t

    fut, t = asyncio.run(go())
    assert fut.done() and isinstance(fut.exception(), BadResponse) and match in str(fut.exception()) and t.aborted


def test_a_body_cut_short_by_a_reset_is_an_error_and_a_clean_close_ends_it():
    async def go(exc):
        conn = _Connection()
        conn.connection_made(_Transport())
        fut = asyncio.get_running_loop().create_future()
        conn.send(b"GET", fut)
        conn.data_received(b"HTTP/1.1 200 OK\r\n\r\npartial")
        conn.connection_lost(exc)
        return fut

    reset = asyncio.run(go(ConnectionResetError("peer reset")))
    assert isinstance(reset.exception(), ConnectionResetError)
    assert isinstance(reset.exception().__cause__, ConnectionResetError)
    assert asyncio.run(go(None)).result().body == b"partial"


def test_idle_connections_expire_and_server_closed_ones_are_forgotten():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    out, seen = _run([ok, ok], [b"1", b"2"], idle_s=0.05, pause_s=0.1)
    assert [r.status for r in out] == [200, 200] and [c for c, _ in seen] == [1, 2]  # the first expired
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"  # then the server closes each connection
    pools = []

    async def closer():
        async def handle(reader, writer):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
                writer.write(closing)
                await writer.drain()
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = ConnectionPool(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pools.append(pool)
        statuses = []
        for _ in range(20):
            statuses.append((await pool.request(pool.encode("POST", "/", b"x"))).status)
            await asyncio.sleep(0.01)  # the server's close arrives
        kept = len(pool._all)
        pool.close()
        server.close()
        return statuses, kept

    statuses, kept = asyncio.run(closer())
    assert statuses == [200] * 20 and kept <= 1


def test_head_requests_and_urls_with_a_path_are_refused():
    with pytest.raises(ValueError, match="HEAD"):
        encode_request("HEAD", "h", "/")
    with pytest.raises(ValueError, match="path"):
        ConnectionPool("http://127.0.0.1:8000/prefix")
