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


async def test_two_list_changes_at_once_leave_the_worker_in_the_fleet() -> None:
    """The file's watcher and the admin API change one worker's config at once: the first
    removes the old worker and waits for its feeds to stop; the second must not add the new
    one meanwhile, or the first's removal takes the new one's endpoint out of the fleet."""
    pool, wc, fleet, client = await _pool()
    changed = WorkerConfig(url=wc.url, events=wc.events, block_size=32)
    try:
        await asyncio.gather(pool.set_workers((changed,)), pool.set_workers((changed,)))
        assert pool.handles[wc.name].config == changed
        assert wc.name in fleet.workers and fleet.workers[wc.name].block_size == 32
        assert wc.name in fleet.index.workers()
        assert _subscriptions() == [f"events-{wc.name}"]
    finally:
        await pool.stop()
        await client.aclose()


async def test_a_caller_cancelled_while_feeds_stop_is_cancelled() -> None:
    """A loop stopped (the pool's stop) while it waits in `_stop_feeds` must end: were its
    cancellation swallowed, it would subscribe again and the stop wait for it forever."""
    pool, wc, _, client = await _pool()
    h = pool.handles[wc.name]
    feed = h.feeds[0]
    assert feed.task is not None
    subscription = feed.task
    went_on = asyncio.Event()

    async def rediscovering() -> None:
        await pool._stop_feeds(h)
        went_on.set()

    try:
        caller = asyncio.create_task(rediscovering())
        while not subscription.cancelling():  # the caller is in, waiting on the subscription
            await asyncio.sleep(0)
        caller.cancel()
        done, _ = await asyncio.wait([caller], timeout=5)
        assert caller in done and caller.cancelled()
        assert not went_on.is_set()
    finally:
        await pool.stop()
        await client.aclose()
