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

# Scope key kvroute's HTTP server adds: a callable that ends the response without its last
# chunk (router.server), so the client sees a truncated transfer. A body that is not an
# event stream has no in-band way to say it was cut short (a JSON answer, a stream of
# bytes): ending it cleanly would hand the client a short body as if complete.
CUT_RESPONSE = "kvroute.cut_response"

# Scope key kvroute's HTTP server sets (to True) on a request still running when the drain
# timeout expires, just before it cancels the request's task (router.server): the app then
# ends the response itself, in OpenAI's shape, rather than leave uvicorn's plain-text 500 or
# a reset connection to a client that could have retried elsewhere.
DRAIN_EXPIRED = "kvroute.drain_expired"
# the outcomes of a request whose task was cancelled: by its client, or by the drain
CLIENT_GONE_OUTCOME = "client_disconnected"
DRAIN_CUT_OUTCOME = "drain_timeout"
CANCELLED_OUTCOMES = (CLIENT_GONE_OUTCOME, DRAIN_CUT_OUTCOME)


def cancelled_outcome(scope: Scope) -> str:
    """Why a request's task was cancelled: the drain timeout marked it, or its client left."""
    return DRAIN_CUT_OUTCOME if scope.get(DRAIN_EXPIRED) else CLIENT_GONE_OUTCOME


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


class ResponseState:
    """A `send` that remembers how far the response got: whether its head went out, whether
    it is an SSE stream, whether its body ended."""

    __slots__ = ("_send", "ended", "sse", "started", "tail")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = self.sse = self.ended = False
        self.tail = b""  # the body's last bytes: whether an SSE event was left unfinished

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        else:
            body = message.get("body", b"")
            if body:
                self.tail = (self.tail + body)[-2:]
            if not message.get("more_body", False):
                self.ended = True
        await self._send(message)


def sse_error(err: KvrouteError, tail: bytes = b"") -> bytes:
    """The last events of a stream the router cut short: the error, then [DONE]. `tail`:
    the stream's last bytes so far; an event they leave unfinished is ended first (blank
    lines between events are ignored), or the error would be glued onto it."""
    event_break = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
    return event_break + b"data: " + _json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"


async def end_with_error(response: ResponseState, err: KvrouteError) -> None:
    """End a response the router cuts short: the error in OpenAI's shape when no head went
    out yet; an SSE stream gets it as its last event then [DONE] (as the forwarder ends a
    stream whose worker failed), and any other body that started just ends."""
    if response.ended:
        return
    if not response.started:
        await send_error(response, err)
        return
    if response.sse:
        body = sse_error(err, response.tail)
        await response({"type": "http.response.body", "body": body, "more_body": True})
    await response({"type": "http.response.body", "body": b""})


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None
