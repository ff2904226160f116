"""Fault checks on the router's own life: a rolling restart of one of two replicas under load
(SIGTERM drains it: nothing lost), the restarted replica's index warmed from the workers'
replay buffers (its hit rate in its first minute against a replica that never restarted),
and an opt-in soak that watches the router's RSS."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx

from conformance.faults.harness import Load, SimProcess, figures, prompt, router_for, rss_mb
from conformance.registry import Findings, check
from conformance.session import Context
from router.procs import RouterProcess

DOCS = 8


@check(
    "fault-drain",
    "two router replicas under c=16 load behind a round-robin client: one is SIGTERMed "
    "(drains: none lost) and restarted; its index is warm from the workers' replay buffers",
    targets=("sim",),
    timeout_s=240.0,
    default=False,
)
async def drain(ctx: Context, f: Findings) -> None:
    sims = [await asyncio.to_thread(SimProcess) for _ in range(2)]
    routers = [await asyncio.to_thread(router_for, sims) for _ in range(2)]
    try:
        docs = [prompt(random.Random(100 + i), 400) for i in range(DOCS)]
        steady = await _hit_rate(routers[1].url, docs)  # first pass fills the caches
        load = Load([r.url for r in routers], concurrency=16)
        running = asyncio.create_task(load.run())
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        routers[0].proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(routers[0].proc.wait, 60)
        drained_s = round(time.monotonic() - t0, 2)
        routers[0] = await asyncio.to_thread(router_for, sims)
        load.urls[0] = routers[0].url
        await asyncio.sleep(3.0)
        load.stop.set()
        await asyncio.wait_for(running, 90)
        warm = await _hit_rate(routers[0].url, docs)
        f.note("load", figures(load))
        f.note("drain", {"exit_code": code, "seconds": drained_s, "sigterm_at": round(t0, 1)})
        f.note("replicas", [r.url for r in routers])
        f.note("hit_rate", {"steady_replica": steady, "restarted_replica_first_minute": warm})
        f.require(load.lost() == 0, f"{load.lost()} requests lost across the restart")
        f.require(code == 0, f"the drained replica exited {code}")
        f.require(warm >= steady - 0.05, f"restarted replica hit rate {warm} vs {steady}")
    finally:
        for r in routers:
            await asyncio.to_thread(r.stop)
        for s in sims:
            await asyncio.to_thread(s.stop)


async def _hit_rate(url: str, docs: list[str]) -> float:
    """Each document twice through `url`; the engines' cached fraction of the second pass."""
    cached = total = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for rep in range(2):
            for i, doc in enumerate(docs):
                body = {"model": "kvroute-sim", "prompt": f"{doc} q{rep}{i}", "max_tokens": 1}
                usage = (await client.post("/v1/completions", json=body)).json()["usage"]
                if rep == 1:
                    cached += usage["prompt_tokens_details"]["cached_tokens"]
                    total += usage["prompt_tokens"]
            await asyncio.sleep(0.5)  # events reach the index
    return round(cached / max(total, 1), 3)


@check(
    "fault-soak",
    "c=32 load for KVROUTE_SOAK_MINUTES (default 30): the router's RSS stays flat",
    targets=("sim",),
    timeout_s=3 * 3600.0,
    default=False,
)
async def soak(ctx: Context, f: Findings) -> None:
    minutes = float(os.environ.get("KVROUTE_SOAK_MINUTES", "30"))
    sims = [await asyncio.to_thread(SimProcess) for _ in range(2)]
    router: RouterProcess = await asyncio.to_thread(router_for, sims)
    try:
        load = Load([router.url])
        running = asyncio.create_task(load.run())
        samples: list[float] = []
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            await asyncio.sleep(min(30.0, max(end - time.monotonic(), 0.1)))
            samples.append(round(rss_mb(router.proc.pid), 1))
        load.stop.set()
        await asyncio.wait_for(running, 120)
        f.note("minutes", minutes)
        f.note("rss_mb_samples", samples)
        f.note("load", figures(load))
        base = samples[min(2, len(samples) - 1)]  # after warm-up
        f.require(samples[-1] <= base * 1.1 + 20, f"RSS grew from {base} to {samples[-1]} MB")
        f.require(load.lost() == 0, f"{load.lost()} requests lost")
    finally:
        await asyncio.to_thread(router.stop)
        for s in sims:
            await asyncio.to_thread(s.stop)
