"""The routing bench's own client: drives a workload's waves of chains through one or more
router URLs (alternating per request, the round-robin load balancer in front of replicas)
with streaming completions, and keeps what the engine reported per request.

Measured per request: time to the first content chunk (TTFT), the gaps between content
chunks (inter-token latency), and the engine's `usage.prompt_tokens_details.cached_tokens`
and `prompt_tokens` from the final usage chunk; a non-200 answer or a broken stream is an
error. Which worker served a request is counted on the engines (`/metrics`), not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.bench.workloads import Chain, Request, Workload

MODEL = "kvroute-sim"


@dataclass
class Sample:
    ttft_ms: float
    gaps_ms: list[float]
    cached_tokens: int
    prompt_tokens: int
    group: str = ""
    worker: str | None = None  # kvroute's x-kvroute-worker header; peers name none
    sent: float = 0.0  # time.perf_counter() when the request was sent


@dataclass
class DriveResult:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    error_texts: list[str] = field(default_factory=list)


async def drive(
    w: Workload,
    urls: list[str],
    timeout: float = 120.0,
    route: Callable[[Request], str] | None = None,
    model: str = MODEL,
) -> DriveResult:
    """Run every wave to completion, one after the other. Requests alternate over `urls`,
    unless `route` names the URL of each (the oracle placement, straight to the workers).
    `model` is the served model name (the simulated fleet's by default)."""
    result = DriveResult()
    cycle = itertools.cycle(urls)
    pick = route or (lambda _: next(cycle))
    # idle connections are not reused near the servers' keep-alive timeouts (uvicorn's, and
    # the oracle's workers', 5 s): a request sent as one closes is lost, and fails the row
    limits = httpx.Limits(max_connections=w.concurrency * 2 + 4, keepalive_expiry=2.0)
    # trust_env=False: loopback traffic must never go through a configured HTTP proxy
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        await warm_client(client, urls)
        for wave in w.waves:
            slots = asyncio.Semaphore(w.concurrency)
            chains = (_chain(client, pick, c, slots, result, model) for c in wave)
            await asyncio.gather(*chains)
    return result


async def warm_client(client: httpx.AsyncClient, urls: list[str]) -> None:
    """One GET /health per URL before the clock starts: a client's first request costs it
    ~20 ms of its own set-up (measured with httpx here), which the first prompt's TTFT
    counted on every router and which let a later request to the same worker overtake it.
    A health check touches no cache."""
    for url in dict.fromkeys(urls):
        with contextlib.suppress(httpx.HTTPError):
            await client.get(f"{url}/health")


async def _chain(
    client: httpx.AsyncClient,
    pick: Callable[[Request], str],
    chain: Chain,
    slots: asyncio.Semaphore,
    result: DriveResult,
    model: str,
) -> None:
    async with slots:
        for r in chain:
            try:
                result.samples.append(await one(client, pick(r), r, model))
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                result.errors += 1
                if len(result.error_texts) < 5:
                    result.error_texts.append(f"{type(exc).__name__}: {exc}"[:300])


async def one(client: httpx.AsyncClient, url: str, r: Request, model: str = MODEL) -> Sample:
    body = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        worker = resp.headers.get("x-kvroute-worker")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("choices"):
                stamps.append(time.perf_counter())
            if doc.get("usage"):
                usage = doc["usage"]
    if not stamps or not usage:
        raise RuntimeError("stream ended without tokens or usage")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        ttft_ms=(stamps[0] - t0) * 1000,
        gaps_ms=[(b - a) * 1000 for a, b in itertools.pairwise(stamps)],
        cached_tokens=int(details.get("cached_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        group=r.group,
        worker=worker,
        sent=t0,
    )


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def engine_counters(worker_url: str) -> dict[str, float]:
    """Totals from one engine's /metrics: requests finished, prefix-cache queries and hits
    (tokens). Summed over label sets."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        if name in WANTED:
            out[name] = out.get(name, 0.0) + float(value)
    return out


WANTED = (
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)
