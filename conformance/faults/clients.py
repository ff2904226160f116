"""Fault checks on the clients' side against `kvroute serve` in a child process: an HTTP fuzz
of malformed requests, slowloris connections, and 2 MB prompts while a probe times /ready
(with the router's RSS before and after)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from conformance.faults.harness import SimProcess, router_for, rss_mb
from conformance.registry import Findings, check
from conformance.session import Context

FUZZ_REQUESTS = 2000
SLOW_CONNECTIONS = 100
HEADER_TIMEOUT_S = 2


def junk(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """One malformed request: method, path, body, headers."""
    method = rng.choice(["POST", "POST", "POST", "GET", "PUT", "DELETE", "HEAD"])
    path = rng.choice(
        ["/v1/completions", "/v1/chat/completions", "/debug/route", "/admin/workers", "/health"]
    )
    values: list[Any] = [None, 5, -1, 1e308, "x", [], {}, [1, "a"], {"a": [None]}, True]
    doc: Any = {
        k: rng.choice(values)
        for k in rng.sample(["model", "prompt", "messages", "max_tokens", "n", "stream"], 3)
    }
    shapes = [
        json.dumps(doc).encode(),
        bytes(rng.randrange(256) for _ in range(rng.randrange(64))),
        b"[" * rng.randrange(1, 50_000),
        json.dumps({"messages": [{"role": "user", "content": rng.choice(values)}]}).encode(),
        b'{"prompt": "\\ud800"}',
    ]
    headers = rng.choice([{}, {"content-type": "text/plain"}, {"connection": "x-a", "x-a": "1"}])
    return method, path, rng.choice(shapes), headers


@check(
    "fault-http-fuzz",
    f"{FUZZ_REQUESTS} malformed requests: the router answers every one itself with an "
    "OpenAI-shaped 4xx, never a 5xx or a traceback",
    targets=("sim",),
    timeout_s=300.0,
    default=False,
)
async def http_fuzz(ctx: Context, f: Findings) -> None:
    sim = await asyncio.to_thread(SimProcess)
    router = await asyncio.to_thread(router_for, [sim])
    try:
        rng = random.Random(7)
        statuses: dict[str, int] = {}
        bad: list[str] = []
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            for _ in range(FUZZ_REQUESTS):
                method, path, body, headers = junk(rng)
                resp = await client.request(method, path, content=body, headers=headers)
                statuses[str(resp.status_code)] = statuses.get(str(resp.status_code), 0) + 1
                own = "x-kvroute-worker" not in resp.headers
                if (own and resp.status_code >= 500) or "Traceback" in resp.text:
                    bad.append(f"{method} {path} {body[:80]!r} -> {resp.status_code}")
        f.note("statuses", statuses)
        f.note("router_5xx_or_traceback", bad[:10])
        f.require(not bad, f"{len(bad)} requests got a 5xx or a traceback from the router")
        f.require(
            sum(statuses.values()) == FUZZ_REQUESTS, "the router did not answer every request"
        )
    finally:
        await asyncio.to_thread(router.stop)
        await asyncio.to_thread(sim.stop)


@check(
    "fault-slowloris",
    f"{SLOW_CONNECTIONS} connections that never finish their request head are closed after "
    "the header timeout while normal requests keep being served",
    targets=("sim",),
    timeout_s=120.0,
    default=False,
)
async def slowloris(ctx: Context, f: Findings) -> None:
    sim = await asyncio.to_thread(SimProcess)
    router = await asyncio.to_thread(router_for, [sim], "--header-timeout", str(HEADER_TIMEOUT_S))
    try:
        host, port = router.url.removeprefix("http://").split(":")
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(SLOW_CONNECTIONS)]
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        latencies = await _serve_meanwhile(router.url, HEADER_TIMEOUT_S + 1)
        closed = await asyncio.gather(*(_closed(r, 10) for r, _ in conns))
        for _, writer in conns:
            writer.close()
        f.note("closed", sum(closed))
        f.note("seconds_until_closed", round(time.monotonic() - t0, 2))
        f.note("normal_request_ms_p50", round(statistics.median(latencies), 1))
        f.require(all(closed), f"{closed.count(False)} slow connections were never closed")
        f.require(len(latencies) > 0, "no normal request was served meanwhile")
    finally:
        await asyncio.to_thread(router.stop)
        await asyncio.to_thread(sim.stop)


async def _serve_meanwhile(url: str, seconds: float) -> list[float]:
    out: list[float] = []
    body = {"model": "kvroute-sim", "prompt": "still served", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            if (await client.post("/v1/completions", json=body)).status_code == 200:
                out.append((time.monotonic() - t0) * 1e3)
            await asyncio.sleep(0.05)
    return out


async def _closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except (TimeoutError, ConnectionError):
        return False


@check(
    "fault-big-prompts",
    "three 2 MB prompts at once: refused before tokenization (over max_model_len), /ready "
    "never stalls over 100 ms meanwhile, the router's RSS returns to its baseline",
    targets=("sim",),
    timeout_s=120.0,
    default=False,
)
async def big_prompts(ctx: Context, f: Findings) -> None:
    sim = await asyncio.to_thread(SimProcess, None, ("--max-model-len", "8192"))
    router = await asyncio.to_thread(router_for, [sim])
    try:
        huge = "lorem ipsum dolor sit amet " * 80_000
        body = {"model": "kvroute-sim", "prompt": huge, "max_tokens": 1}
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            await client.post("/v1/completions", json={**body, "prompt": "warm up"})
            before = rss_mb(router.proc.pid)
            stalls: list[float] = []
            sent = asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(3)))
            answers, _ = await asyncio.gather(sent, _probe(client, stalls))
            await asyncio.sleep(1.0)
            after = rss_mb(router.proc.pid)
        f.note("statuses", [r.status_code for r in answers])
        f.note("ready_ms_max", round(max(stalls), 1))
        f.note("ready_ms_p50", round(statistics.median(stalls), 1))
        f.note("rss_mb", {"before": round(before, 1), "after": round(after, 1)})
        f.require(all(r.status_code == 400 for r in answers), "a 2 MB prompt was not refused")
        f.require(max(stalls) <= 100, f"/ready stalled {max(stalls):.0f} ms")
        f.require(after <= before + 50, f"RSS grew from {before:.0f} to {after:.0f} MB")
    finally:
        await asyncio.to_thread(router.stop)
        await asyncio.to_thread(sim.stop)


async def _probe(client: httpx.AsyncClient, out: list[float], n: int = 100) -> None:
    for _ in range(n):
        t0 = time.monotonic()
        await client.get("/ready")
        out.append((time.monotonic() - t0) * 1e3)
        await asyncio.sleep(0.01)
