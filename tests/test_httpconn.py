"""``gpuloom.serve.httpconn``: the load generator's lean HTTP/1.1 client, against scripted servers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gpuloom.serve.httpconn import ConnectionPool, Response, encode_request


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
                if reply is None:
                    await asyncio.sleep(30)
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply.lower() or b"content-length" not in reply.lower() and \
                        b"chunked" not in reply.lower():
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _run(replies, requests, *, timeout_s=5.0):
    async def go():
        server, port, seen = await _scripted(replies)
        pool = ConnectionPool(f"http://127.0.0.1:{port}", timeout_s=timeout_s)
        out = []
        try:
            for body in requests:
                try:
                    out.append(await pool.request(pool.encode("POST", "/v2/models/m/infer", body,
                                                              {"Content-Type": "application/octet-stream"})))
                except Exception as e:  # noqa: BLE001 - what a load generator would count
                    out.append(e)
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
