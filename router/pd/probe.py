"""A probe handoff between one prefill and one decode worker, straight to the workers (no
router in between): what `kvroute serve` runs at start to measure the link (auto splits
nothing until it knows it) and what `router-check`'s pd-path check runs.

A fresh prompt (unique from its first block) goes to the prefill worker as a prefill leg,
its `kv_transfer_params` (checked for shape) to the decode worker with the same prompt;
the decode worker's /metrics before and after say what really moved: bytes, transfer time,
tokens pulled (`external_kv_transfer`) or recomputed (`local_compute`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from engines.sim.pd_metrics import PDSnapshot, pd_snapshot
from router.check.prompts import sized_text
from router.pd.wire import PREFILL_PARAMS, params_problem

PROVED_FRACTION = 0.9  # the decode worker's external tokens against the probe's prompt


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass
class ProbeResult:
    prefill: str
    decode: str
    prompt_tokens: int = 0
    prefill_leg_ms: float = 0.0
    decode_ttft_ms: float | None = None
    moved: PDSnapshot = field(default_factory=PDSnapshot)
    error: str | None = None

    @property
    def proved(self) -> bool:
        m = self.moved
        return (
            self.error is None
            and m.bytes_transferred > 0
            and m.external_kv_transfer >= PROVED_FRACTION * self.prompt_tokens
        )

    @property
    def link_bytes_per_s(self) -> float | None:
        return self.moved.link_bytes_per_s

    @property
    def kv_bytes_per_token(self) -> float | None:
        m = self.moved
        return m.bytes_transferred / m.external_kv_transfer if m.external_kv_transfer else None

    def describe(self) -> str:
        m = self.moved
        if self.error is not None:
            return f"probe handoff {self.prefill} -> {self.decode} failed: {self.error}"
        link = self.link_bytes_per_s
        return (
            f"probe handoff {self.prefill} -> {self.decode}: {self.prompt_tokens} tokens, "
            f"{m.bytes_transferred / 1e6:.2f} MB in {m.xfer_seconds * 1000:.1f} ms "
            f"({'?' if link is None else f'{link / 1e6:.0f}'} MB/s), decode worker pulled "
            f"{m.external_kv_transfer:.0f} tokens and computed {m.local_compute:.0f}; prefill "
            f"leg {self.prefill_leg_ms:.0f} ms, decode TTFT {self.decode_ttft_ms or 0:.0f} ms"
        )


async def probe_handoff(
    client: httpx.AsyncClient,
    prefill: Endpoint,
    decode: Endpoint,
    *,
    model: str = "",
    tokens: int = 1024,
    block_size: int = 16,
    timeout_s: float = 60.0,
) -> ProbeResult:
    """One handoff by hand; never raises for what the workers do (`error` says it)."""
    out = ProbeResult(prefill.name, decode.name)
    try:
        await _run(client, prefill, decode, out, model, tokens, block_size, timeout_s)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _run(
    client: httpx.AsyncClient,
    prefill: Endpoint,
    decode: Endpoint,
    out: ProbeResult,
    model: str,
    tokens: int,
    block_size: int,
    timeout_s: float,
) -> None:
    prompt = await sized_text(tokens, lambda t: count_tokens(client, decode, model, t), "pd")
    out.prompt_tokens = await count_tokens(client, decode, model, prompt) or tokens
    before = await snapshot(client, decode)
    rid = f"kvroute-pd-probe-{uuid.uuid4().hex[:12]}"
    params, out.prefill_leg_ms = await _prefill(client, prefill, model, prompt, rid, timeout_s)
    problem = params_problem(params, out.prompt_tokens, block_size)
    if problem is not None:
        out.error = f"the prefill worker's answer: {problem}"
        return
    status, out.decode_ttft_ms = await stream_ttft(
        client, decode, _body(model, prompt, 2, params), rid, timeout_s
    )
    if status != 200:
        out.error = f"the decode leg answered HTTP {status}"
        return
    out.moved = await snapshot(client, decode) - before


async def probe_local(
    client: httpx.AsyncClient,
    worker: Endpoint,
    *,
    model: str = "",
    tokens: int = 1024,
    timeout_s: float = 60.0,
) -> tuple[int, float | None]:
    """Prompt tokens and time to first token of a fresh prompt prefilled on `worker`."""
    prompt = await sized_text(tokens, lambda t: count_tokens(client, worker, model, t), "local")
    n = await count_tokens(client, worker, model, prompt) or tokens
    rid = f"kvroute-pd-local-{uuid.uuid4().hex[:12]}"
    status, ttft = await stream_ttft(client, worker, _body(model, prompt, 2), rid, timeout_s)
    return n, ttft if status == 200 else None


def _body(model: str, prompt: str, max_tokens: int, params: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if model:
        body["model"] = model
    if params is not None:
        body["kv_transfer_params"] = params
    return body


async def _prefill(
    client: httpx.AsyncClient, w: Endpoint, model: str, prompt: str, rid: str, timeout_s: float
) -> tuple[Any, float]:
    body = {**_body(model, prompt, 1), "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    start = time.perf_counter()
    resp = await client.post(
        f"{w.url}/v1/completions",
        json=body,
        headers={**w.headers, "x-request-id": rid},
        timeout=timeout_s,
    )
    ms = (time.perf_counter() - start) * 1000
    if resp.status_code != 200:
        raise ValueError(f"the prefill leg answered HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json().get("kv_transfer_params"), ms


async def stream_ttft(
    client: httpx.AsyncClient, w: Endpoint, body: dict[str, Any], rid: str, timeout_s: float
) -> tuple[int, float | None]:
    """A streamed completion: its status and ms to its first token."""
    start = time.perf_counter()
    ttft = None
    headers = {**w.headers, "x-request-id": rid}
    body = {**body, "stream": True}
    async with client.stream(
        "POST", f"{w.url}/v1/completions", json=body, headers=headers, timeout=timeout_s
    ) as resp:
        async for line in resp.aiter_lines():
            if ttft is None and _has_choices(line):
                ttft = (time.perf_counter() - start) * 1000
        return resp.status_code, ttft


def _has_choices(line: str) -> bool:
    if not line.startswith("data: {") or '"choices"' not in line:
        return False
    return bool(json.loads(line[6:]).get("choices"))


async def count_tokens(client: httpx.AsyncClient, w: Endpoint, model: str, text: str) -> int | None:
    body = {"prompt": text, **({"model": model} if model else {})}
    try:
        resp = await client.post(f"{w.url}/tokenize", json=body, headers=w.headers, timeout=10)
        count = resp.json().get("count") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return count if isinstance(count, int) else None


async def snapshot(client: httpx.AsyncClient, w: Endpoint) -> PDSnapshot:
    resp = await client.get(f"{w.url}/metrics", headers=w.headers, timeout=10)
    resp.raise_for_status()
    return pd_snapshot(resp.text)
