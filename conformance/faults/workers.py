"""Fault checks on the workers' side, under c=32 streaming load through `kvroute serve`:
a worker killed, hung (SIGSTOP) and restarted. No request that had not started streaming
may be lost; a stream that had started ends with kvroute's error event and [DONE]."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from conformance.faults.harness import Load, SimProcess, figures, router_for, unavailable, until
from conformance.registry import Findings, check
from conformance.session import Context
from router.procs import RouterProcess

WARMUP_S = 2.0
AFTER_S = 6.0


@asynccontextmanager
async def two_workers() -> AsyncIterator[tuple[list[SimProcess], RouterProcess]]:
    sims = [await asyncio.to_thread(SimProcess) for _ in range(2)]
    router = None
    try:
        router = await asyncio.to_thread(router_for, sims, "--first-byte-timeout", "10")
        yield sims, router
    finally:
        if router is not None:
            await asyncio.to_thread(router.stop)
        for s in sims:
            await asyncio.to_thread(s.stop)


async def under_load(
    router: RouterProcess, fault: Callable[[], Awaitable[dict[str, object]]], f: Findings
) -> Load:
    """Load for WARMUP_S, the fault, load for AFTER_S more; the fault's figures noted."""
    load = Load([router.url])
    running = asyncio.create_task(load.run())
    await asyncio.sleep(WARMUP_S)
    before = sum(load.fates.values())
    f.note("fault", await fault())
    await asyncio.sleep(AFTER_S)
    load.stop.set()
    await asyncio.wait_for(running, 90)
    f.note("requests_before_fault", before)
    f.note("load", figures(load))
    f.require(load.lost() == 0, f"{load.lost()} requests lost: {figures(load)}")
    f.require(load.fates["truncated"] == 0, "a stream ended without [DONE] or an error event")
    f.require(load.fates["ok"] > before, "no request succeeded after the fault")
    return load


@check(
    "fault-worker-killed",
    "a worker SIGKILLed under c=32 load: none lost that had not started; cut streams end "
    "with an error event; the worker is ejected",
    targets=("sim",),
    timeout_s=180.0,
    default=False,
)
async def worker_killed(ctx: Context, f: Findings) -> None:
    async with two_workers() as (sims, router):

        async def fault() -> dict[str, object]:
            await asyncio.to_thread(sims[1].kill)
            gone = await until(lambda: unavailable(router.url, sims[1].name), 10)
            return {"killed": sims[1].name, "ejected_after_s": gone}

        await under_load(router, fault, f)
        f.require(f.evidence["fault"]["ejected_after_s"] is not None, "never ejected")


@check(
    "fault-worker-hung",
    "a worker SIGSTOPped under c=32 load: ejected within seconds, requests waiting on it "
    "fail over, none lost that had not started",
    targets=("sim",),
    timeout_s=180.0,
    default=False,
)
async def worker_hung(ctx: Context, f: Findings) -> None:
    async with two_workers() as (sims, router):

        async def fault() -> dict[str, object]:
            sims[1].signal(signal.SIGSTOP)
            gone = await until(lambda: unavailable(router.url, sims[1].name), 15)
            return {"stopped": sims[1].name, "ejected_after_s": gone}

        await under_load(router, fault, f)
        sims[1].signal(signal.SIGCONT)
        ejected = f.evidence["fault"]["ejected_after_s"]
        f.require(ejected is not None and ejected <= 5, f"hung worker ejected after {ejected} s")


@check(
    "fault-worker-restarted",
    "a worker killed and restarted on its port under c=32 load: none lost that had not "
    "started; it is re-admitted and rediscovered (its new event endpoints)",
    targets=("sim",),
    timeout_s=180.0,
    default=False,
)
async def worker_restarted(ctx: Context, f: Findings) -> None:
    async with two_workers() as (sims, router):

        async def fault() -> dict[str, object]:
            await asyncio.to_thread(sims[1].kill)
            await until(lambda: unavailable(router.url, sims[1].name), 10)
            await asyncio.to_thread(sims[1].start)

            async def back() -> bool:
                return not await unavailable(router.url, sims[1].name)

            return {"restarted": sims[1].name, "readmitted_after_s": await until(back, 15)}

        await under_load(router, fault, f)
        f.require(f.evidence["fault"]["readmitted_after_s"] is not None, "never re-admitted")
