"""The conformance suite's HTTP client: an idempotent call the server dropped unanswered on a
kept-alive connection is sent once more; any other call is never sent twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from conformance.client import client

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@asynccontextmanager
async def second_request_dropped() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server that answers each connection's first request and closes the connection,
    unanswered, on its second: what a server does when its keep-alive timer fires before
    it reads a request already waiting."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answered in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                seen.append(head.split(b" ", 1)[0])
                if answered:
                    return  # closes unanswered
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", seen


async def test_a_dropped_get_is_sent_again_once() -> None:
    async with second_request_dropped() as (url, seen), client(url) as http:
        assert (await http.get("/metrics")).text == "ok"
        assert (await http.get("/metrics")).text == "ok"  # dropped, then sent on a new one
        assert seen == [b"GET", b"GET", b"GET"]
        assert http._transport.retried == 1  # type: ignore[attr-defined]


async def test_a_dropped_post_is_never_sent_again() -> None:
    async with second_request_dropped() as (url, seen), client(url) as http:
        assert (await http.post("/v1/completions", json={})).text == "ok"
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/v1/completions", json={})
        assert seen == [b"POST", b"POST"]
