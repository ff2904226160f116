"""Small ASGI helpers: JSON errors, server-sent events, and work that stops when the client
goes away (vLLM cancels a request whose client disconnected; so does the simulator)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engines.sim.errors import ApiError, media_type_error, schema_error

T = TypeVar("T")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def error_response(err: ApiError) -> Response:
    return Json(err.body(), status_code=err.status)


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or vLLM's 400 for anything else."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise media_type_error()
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise schema_error((), "json_invalid", f"JSON decode error: {exc}", None) from None
    if not isinstance(body, dict):
        raise schema_error((), "model_attributes_type", "Input should be a valid dictionary", None)
    return body


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """Run `work`; cancel it (and return None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(receive))
    waiting: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


class EventStream(StreamingResponse):
    """`text/event-stream` from an async iterator of `data:` payloads; the iterator is
    closed (so the engine request aborts) as soon as the client disconnects."""

    def __init__(self, events: AsyncIterator[str], headers: Mapping[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watcher = asyncio.create_task(_disconnected(receive))
        try:
            while (data := await self._next(watcher)) is not None:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not watcher.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-send
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            close: Callable[[], Awaitable[None]] | None = getattr(self.events, "aclose", None)
            if close is not None:
                await close()

    async def _next(self, watcher: asyncio.Task[None]) -> bytes | None:
        nxt: asyncio.Future[str] = asyncio.ensure_future(anext(self.events))
        waiting: set[asyncio.Future[Any]] = {nxt, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            return None
        try:
            return f"data: {nxt.result()}\n\n".encode()
        except StopAsyncIteration:
            return None
