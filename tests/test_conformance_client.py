"""The conformance suite's HTTP client: an idempotent call that a server dropped unanswered
on a reused connection is sent once more; a call on a new connection, and any call that is
not idempotent, are never sent twice."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from conformance.client import client

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@asynccontextmanager
async def dropping(
    answered: int = 1, reset: bool = False
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server that answers each connection's first `answered` requests, then drops the
    connection on the next one unanswered: closed (a keep-alive timer that fired as the
    request came) or, with `reset`, reset."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in range(answered + 1):
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                seen.append(head.split(b" ", 1)[0])
                if n == answered:
                    if reset:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    return
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


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_get_dropped_on_a_reused_connection_is_sent_again_once(reset: bool) -> None:
    async with dropping(reset=reset) as (url, seen), client(url) as http:
        assert (await http.get("/metrics")).text == "ok"
        assert (await http.get("/metrics")).text == "ok"  # dropped, then sent on a new one
        assert seen == [b"GET", b"GET", b"GET"]
        assert http._transport.resent == 1  # type: ignore[attr-defined]


async def test_a_get_dropped_on_a_new_connection_is_not_sent_again() -> None:
    async with dropping(answered=0) as (url, seen), client(url) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/metrics")
        assert seen == [b"GET"]


async def test_a_dropped_post_is_never_sent_again() -> None:
    async with dropping() as (url, seen), client(url) as http:
        assert (await http.post("/v1/completions", json={})).text == "ok"
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/v1/completions", json={})
        assert seen == [b"POST", b"POST"]
