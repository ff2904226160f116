"""HTTP for the checks: every call bounded, every failure turned into a value to report."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Fetched:
    """One HTTP exchange: the status (None when nothing answered), the JSON body when there
    was one, and how long it took."""

    url: str
    status: int | None
    body: Any = None
    text: str = ""
    error: str = ""
    ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200

    def describe(self) -> str:
        if self.status is None:
            return self.error
        return f"HTTP {self.status}" + (f": {self.text[:160]}" if self.status >= 400 else "")


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for `token` (an admin token, the workers' API key); none
    without one."""
    return {"authorization": f"Bearer {token}"} if token else {}


async def fetch(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Fetched:
    t0 = time.perf_counter()
    try:
        resp = await client.request(method, url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        ms = (time.perf_counter() - t0) * 1000
        return Fetched(url, None, error=f"{type(exc).__name__}: {exc}".rstrip(": "), ms=ms)
    ms = (time.perf_counter() - t0) * 1000
    return Fetched(url, resp.status_code, _json(resp.text), resp.text, ms=ms)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Streamed:
    """A streamed completion as a client sees it."""

    status: int
    worker: str | None  # the router's chosen-worker header
    ttft_s: float | None  # first SSE data chunk
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, if reported
    prompt_tokens: int | None
    error: str = ""


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    worker_header: str,
    timeout: float,
) -> Streamed:
    """POST a streaming completion, timing the first data chunk and reading the usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            worker = resp.headers.get(worker_header)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return Streamed(resp.status_code, worker, None, None, None, text)
            return await _read_stream(resp, worker, t0)
    except httpx.HTTPError as exc:
        return Streamed(0, None, None, None, None, f"{type(exc).__name__}: {exc}")


async def _read_stream(resp: httpx.Response, worker: str | None, t0: float) -> Streamed:
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if ttft is None:
            ttft = time.perf_counter() - t0
        chunk = _json(data)
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens")
    return Streamed(
        200,
        worker,
        ttft,
        int(cached) if isinstance(cached, int) else None,
        int(prompt) if isinstance(prompt, int) else None,
    )
