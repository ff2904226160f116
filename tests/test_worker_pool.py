"""The worker pool's discovery under overlap: the health and scrape loops can both rediscover
a restarted engine, and an operator can remove a worker while that is in flight. Each
worker must end with exactly one KV event subscription, or none once removed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from indexer.clock import MonotonicClock
from router.core.config import Config, WorkerConfig
from router.core.fleet import FleetState
from router.tokenizers import TokenizerSet
from router.workers import WorkerPool

pytestmark = pytest.mark.timeout(30)


async def _slow_worker(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(0.05)  # every control-plane call takes a moment
    return httpx.Response(404)


def _subscriptions() -> list[str]:
    return sorted(
        t.get_name()
        for t in asyncio.all_tasks()
        if t.get_name().startswith("events-") and not t.done()
    )


async def _pool() -> tuple[WorkerPool, WorkerConfig, FleetState, httpx.AsyncClient]:
    # events on a port nobody listens on: ZMQ keeps trying, which is all a task needs
    wc = WorkerConfig(url="http://127.0.0.1:9", events="tcp://127.0.0.1:9")
    cfg = Config(workers=(wc,))
    clock = MonotonicClock()
    fleet = FleetState(clock)
    client = httpx.AsyncClient(transport=httpx.MockTransport(_slow_worker))
    pool = WorkerPool(cfg, fleet, client, clock, TokenizerSet.from_config(cfg))
    await pool.set_workers((wc,))
    return pool, wc, fleet, client


async def test_overlapping_rediscoveries_leave_one_subscription() -> None:
    pool, wc, _, client = await _pool()
    try:
        h = pool.handles[wc.name]
        assert _subscriptions() == [f"events-{wc.name}"]
        await asyncio.gather(pool.rediscover(h, "metrics went back"), pool.rediscover(h, "back"))
        await asyncio.sleep(0)
        assert _subscriptions() == [f"events-{wc.name}"]
        await pool.set_workers(())
        await asyncio.sleep(0)
        assert _subscriptions() == []
    finally:
        await pool.stop()
        await client.aclose()


async def test_a_worker_removed_during_its_rediscovery_keeps_no_subscription() -> None:
    pool, wc, fleet, client = await _pool()
    try:
        h = pool.handles[wc.name]
        await asyncio.gather(pool.rediscover(h, "engine restart"), pool.set_workers(()))
        await asyncio.sleep(0)
        assert pool.handles == {} and fleet.index.workers() == []
        assert _subscriptions() == []
    finally:
        await pool.stop()
        await client.aclose()
