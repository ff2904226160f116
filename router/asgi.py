"""Minimal ASGI helpers: the proxy's hot path skips a web framework's routing and request
objects, which measured as a large share of per-request overhead."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from router.core.errors import KvrouteError, PayloadTooLarge, RequestTimeout

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_json = msgspec.json.Encoder()

JSON_HEADERS = [(b"content-type", b"application/json")]


async def read_body(receive: Receive, limit: int, timeout: float | None = None) -> bytes:
    """The whole request body, at most `limit` bytes, within `timeout` seconds (a client that
    trickles its body must not hold a connection forever)."""
    try:
        async with asyncio.timeout(timeout):
            return await _read(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout:g} s") from None


async def _read(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# Scope key kvroute's HTTP server adds: a list of callbacks it calls when the client's
# connection drops before the response completed (router.server). A door registers one
# instead of keeping a task per request waiting on receive() for the disconnect.
CLIENT_GONE = "kvroute.client_gone"


def check_length(scope: Scope, limit: int) -> None:
    """413 from the declared Content-Length, before a byte of the body is read."""
    raw = header(scope, b"content-length")
    if raw is not None and raw.isdigit() and int(raw) > limit:
        raise PayloadTooLarge(f"request body of {int(raw)} bytes is over the {limit}-byte limit")


class ClientGone(Exception):
    """The client disconnected."""


async def send_json(
    send: Send, status: int, doc: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = _json.encode(doc)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, err: KvrouteError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    own = [(k.encode(), v.encode()) for k, v in err.headers()]
    await send_json(send, err.status, err.body(), [*own, *(headers or [])])


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None
