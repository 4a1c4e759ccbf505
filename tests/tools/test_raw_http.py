"""``tools/raw_http.py``: the load generator's lean keep-alive client, against a real asyncio HTTP/1.1 peer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest

from tools.raw_http import RawHttpClient, RawHttpError, _parse_head


class _Peer:
    """A tiny HTTP/1.1 server: answers each request with ``answer(method, path, headers, body)`` -> raw bytes;
    records (connection number, method, path, headers, body) per request."""

    def __init__(self, answer) -> None:
        self.answer, self.seen, self.connections = answer, [], 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append((number, method, path, headers, body))
                out, close = self.answer(method, path, headers, body)
                writer.write(out)
                await writer.drain()
                if close:
                    break
        writer.close()


def _json_answer(status: int, payload: dict, *, close: bool = False, extra: str = "") -> tuple[bytes, bool]:
    body = json.dumps(payload).encode()
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
    if close:
        head += "connection: close\r\n"
    return (head + "\r\n").encode() + body, close


def _run(peer: _Peer, body):
    async def main():
        server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await body(f"http://127.0.0.1:{port}")
        finally:
            server.close()
            await server.wait_closed()
    return asyncio.run(main())


def test_requests_share_one_keep_alive_connection_and_carry_body_and_headers():
    peer = _Peer(lambda m, p, h, b: _json_answer(200, {"n": len(b), "path": p}))
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def body(url):
        client = RawHttpClient(url, {"Authorization": "Bearer k"})
        answers = [await client.request("POST", "/track/binary", content=payload,
                                        headers={"Content-Type": "application/octet-stream"}) for _ in range(3)]
        await client.aclose()
        return answers

    answers = _run(peer, body)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json() for a in answers] == [{"n": len(payload), "path": "/track/binary"}] * 3
    assert answers[0].headers["content-type"] == "application/json"
    assert [s[0] for s in peer.seen] == [1, 1, 1]  # one connection for all three
    number, method, path, headers, sent = peer.seen[0]
    assert (method, path, sent) == ("POST", "/track/binary", payload)
    assert headers["authorization"] == "Bearer k" and headers["content-type"] == "application/octet-stream"
    assert headers["host"].startswith("127.0.0.1:") and headers["content-length"] == str(len(payload))


def test_an_error_answer_is_returned_with_its_headers_and_a_closed_connection_is_reopened():
    calls = iter([_json_answer(503, {"error": {"message": "full"}}, close=True, extra="retry-after: 2\r\n"),
                  _json_answer(200, {"ok": True})])
    peer = _Peer(lambda m, p, h, b: next(calls))

    async def body(url):
        client = RawHttpClient(url)
        first = await client.request("POST", "/t", content=b"x")
        second = await client.request("GET", "/t")
        await client.aclose()
        return first, second

    first, second = _run(peer, body)
    assert first.status_code == 503 and first.headers["retry-after"] == "2" and "full" in first.text
    assert second.status_code == 200 and second.json() == {"ok": True}
    assert [s[0] for s in peer.seen] == [1, 2]  # the server closed the first: the second request reconnected
    assert peer.seen[1][3]["content-length"] == "0"


def test_a_kept_alive_connection_the_server_closed_as_the_request_came_is_replaced_once():
    """The server drops a kept-alive connection just as the next request arrives (its idle timeout racing the
    request): nothing of an answer came, so the request goes again, once, on a new connection."""
    seen: list[tuple[int, bytes]] = []
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        number = connections[0]
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                length = int(next(line.split(":")[1] for line in head if line.lower().startswith("content-length")))
                body = await reader.readexactly(length)
                if number == 1 and seen:  # the second request on the first connection: drop it unanswered
                    break
                seen.append((number, body))
                writer.write(_json_answer(200, {"n": len(seen)})[0])
                await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            client = RawHttpClient(url)
            answers = [await client.request("POST", "/t", content=b) for b in (b"x", b"y")]
            await client.aclose()
            return answers
        finally:
            server.close()
            await server.wait_closed()

    first, second = asyncio.run(main())
    assert (first.json(), second.json()) == ({"n": 1}, {"n": 2})
    assert seen == [(1, b"x"), (2, b"y")]  # answered once each; the second on a new connection


def test_an_answer_cut_short_is_an_error_not_a_retry():
    peer = _Peer(lambda m, p, h, b: (b"HTTP/1.1 200 OK\r\ncontent-le", True))

    async def body(url):
        with pytest.raises(RawHttpError, match=r"^GET /t: IncompleteReadError"):
            await RawHttpClient(url).request("GET", "/t")

    _run(peer, body)
    assert len(peer.seen) == 1


def test_a_chunked_answer_is_an_error_naming_it():
    peer = _Peer(lambda m, p, h, b: (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n", True))

    async def body(url):
        with pytest.raises(RawHttpError, match="without Content-Length"):
            await RawHttpClient(url).request("GET", "/t")

    _run(peer, body)


def test_a_refused_connection_is_a_raw_http_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RawHttpError, match=r"^POST /track/binary: "):
        asyncio.run(RawHttpClient(f"http://127.0.0.1:{port}").request("POST", "/track/binary", content=b"x"))


@pytest.mark.parametrize("url", ["https://127.0.0.1:1", "127.0.0.1:8000", "http://"])
def test_only_http_urls_are_taken(url):
    with pytest.raises(ValueError, match="http://host:port"):
        RawHttpClient(url)


def test_status_line_and_headers_parse():
    assert _parse_head(b"HTTP/1.1 429 Too Many\r\nRetry-After: 1\r\nX-A:  b \r\n\r\n") == \
        (429, {"retry-after": "1", "x-a": "b"})
    with pytest.raises(ValueError, match="status line"):
        _parse_head(b"SPDY/3 200\r\n\r\n")
    with pytest.raises(ValueError, match="malformed header"):
        _parse_head(b"HTTP/1.1 200 OK\r\nnocolon\r\n\r\n")
