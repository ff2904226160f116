"""The few OpenAI-server calls the checks make, against an engine or the router."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class EngineCallError(RuntimeError):
    """A call to the engine or router answered with an error status."""


@dataclass(frozen=True)
class Completion:
    prompt_tokens: int
    cached_tokens: int
    worker: str | None = None  # the router's x-kvroute-worker header
    ttft_s: float | None = None


# Idle connections are not reused past this: well under the servers' keep-alive timeouts
# (vLLM's and the simulator's 5 s), which httpx's own 5 s equals, so that the two ends do not
# time the same idle connection out together and a call cross the server's close.
KEEPALIVE_S = 2.0
LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
)
IDEMPOTENT = frozenset({"GET", "HEAD"})
log = logging.getLogger("kvroute.conformance")


class _ResendIdempotent(httpx.AsyncBaseTransport):
    """Sends a GET or HEAD again, once, when it went out on a reused connection that the
    server closed or reset before a byte of its answer, as browsers do (RFC 9110 9.2.2): a
    check reading vLLM's /metrics once crashed on "Server disconnected without sending a
    response", about the connection, not the page under test. A request on a new connection
    and any request that is not idempotent are never sent twice; a resend is logged."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=LIMITS, trust_env=False)
        self.resent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method not in IDEMPOTENT:
            return await self._inner.handle_async_request(request)
        connected = False
        outer = request.extensions.get("trace")

        async def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal connected
            connected |= event.startswith("connection.connect_tcp")
            if outer is not None:
                await outer(event, info)

        request.extensions["trace"] = trace
        try:
            return await self._inner.handle_async_request(request)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if connected:
                raise
            self.resent += 1
            log.info(
                "%s %s: resent once (%s on a reused connection)",
                request.method,
                request.url.path,
                type(exc).__name__,
            )
            return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def client(base_url: str, timeout_s: float = 120.0) -> httpx.AsyncClient:
    # trust_env=False: loopback calls must never go through a configured HTTP proxy.
    return httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, trust_env=False, transport=_ResendIdempotent()
    )


def completion_body(
    model: str,
    prompt: Sequence[int] | str,
    *,
    cache_salt: str | None = None,
    max_tokens: int = 1,
    stream: bool = False,
    xargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    body["temperature"] = 0.0
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if xargs:
        body["vllm_xargs"] = dict(xargs)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _json(resp: httpx.Response) -> Any:
    if resp.status_code != 200:
        raise EngineCallError(f"{resp.request.url.path}: {resp.status_code} {resp.text[:300]}")
    return resp.json()


def _usage(doc: Mapping[str, Any]) -> Completion:
    usage = doc.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0))


async def complete(
    http: httpx.AsyncClient,
    model: str,
    prompt: Sequence[int] | str,
    *,
    cache_salt: str | None = None,
    max_tokens: int = 1,
    xargs: Mapping[str, Any] | None = None,
) -> Completion:
    """One non-streaming completion; returns what the engine reports it had cached."""
    body = completion_body(model, prompt, cache_salt=cache_salt, max_tokens=max_tokens, xargs=xargs)
    return _usage(_json(await http.post("/v1/completions", json=body)))


async def stream_completion(
    http: httpx.AsyncClient, model: str, prompt: str | Sequence[int], *, max_tokens: int = 4
) -> Completion:
    """A streaming completion: time to the first content chunk, usage from the last one."""
    body = completion_body(model, prompt, max_tokens=max_tokens, stream=True)
    started = time.perf_counter()
    ttft: float | None = None
    usage: Completion | None = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise EngineCallError(f"stream: {resp.status_code} {(await resp.aread())[:300]!r}")
        worker = resp.headers.get("x-kvroute-worker")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if ttft is None and doc.get("choices"):
                ttft = time.perf_counter() - started
            if doc.get("usage"):
                usage = _usage(doc)
    base = usage or Completion(0, 0)
    return Completion(base.prompt_tokens, base.cached_tokens, worker, ttft)


async def tokenize_prompt(http: httpx.AsyncClient, model: str, prompt: str) -> list[int]:
    doc = _json(await http.post("/tokenize", json={"model": model, "prompt": prompt}))
    return [int(t) for t in doc["tokens"]]


async def tokenize_chat(
    http: httpx.AsyncClient, model: str, messages: Sequence[Mapping[str, Any]]
) -> list[int]:
    body = {"model": model, "messages": list(messages), "add_generation_prompt": True}
    doc = _json(await http.post("/tokenize", json=body))
    return [int(t) for t in doc["tokens"]]


async def reset_prefix_cache(http: httpx.AsyncClient) -> None:
    resp = await http.post("/reset_prefix_cache")
    if resp.status_code != 200:
        raise EngineCallError(f"/reset_prefix_cache: {resp.status_code} {resp.text[:200]}")
