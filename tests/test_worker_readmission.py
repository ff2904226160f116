"""A worker taken out of rotation and back, over simulated engines on loopback: an ejection
that was a blip keeps what the router knows of its cache (vLLM never announces again the
blocks it holds), a new engine process is forgotten, and a drain outlives a change of its
data-parallel ranks."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import pytest

from engines.base import EngineMetrics
from engines.sim.config import SimConfig
from engines.sim.dp import sim_worker
from engines.sim.worker import SimWorker
from indexer.clock import MonotonicClock
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.core.fleet import FleetState
from router.tokenize import PACKAGED_TOKENIZER
from router.tokenizers import TokenizerSet
from router.worker_checks import restarted
from router.workers import WorkerPool

pytestmark = pytest.mark.timeout(60)

SIM = SimConfig(block_size=16, kv_blocks=512, topic="kv-events")
DOC = " ".join(f"paragraph {i} about caches and routers and blocks." for i in range(40))


@asynccontextmanager
async def pool_of(url: str) -> AsyncIterator[WorkerPool]:
    """A worker pool over one worker; its probes run when a test calls them."""
    cfg = Config(workers=(WorkerConfig(url),), tokenizer=str(PACKAGED_TOKENIZER), mode="events")
    clock = MonotonicClock()
    client = httpx.AsyncClient(timeout=5)
    pool = WorkerPool(cfg, FleetState(clock), client, clock, TokenizerSet.from_config(cfg))
    await pool.set_workers(cfg.workers)
    try:
        yield pool
    finally:
        await pool.stop()
        await client.aclose()


@asynccontextmanager
async def one_worker() -> AsyncIterator[tuple[SimWorker, WorkerPool, str]]:
    """A simulated worker, a pool over it, and its name in the fleet."""
    worker = SimWorker(SIM)
    await worker.start()
    try:
        async with pool_of(worker.url) as pool:
            yield worker, pool, f"127.0.0.1:{worker.port}"
    finally:
        await worker.stop()


async def prompt(worker: SimWorker, text: str) -> None:
    body = {"model": worker.config.model, "prompt": text, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(f"{worker.url}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text


async def until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(250):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def draining(pool: WorkerPool) -> dict[str, bool]:
    return {name: state.draining for name, state in pool.fleet.workers.items()}


def eject_by_connect_failure(pool: WorkerPool, name: str) -> None:
    pool.eject(name, "connect failed: ConnectTimeout")


def eject_by_timeouts(pool: WorkerPool, name: str) -> None:
    for _ in range(pool.config.eject_after_timeouts):
        pool.note_timeout(name, "no response head in 30 s")


@pytest.mark.parametrize(
    "eject",
    [eject_by_connect_failure, eject_by_timeouts],
    ids=["one-connect-failure", "requests-timing-out"],
)
async def test_a_worker_back_from_a_blip_keeps_its_cache_and_subscription(
    eject: Callable[[WorkerPool, str], None],
) -> None:
    async with one_worker() as (worker, pool, name):
        index = pool.fleet.index
        await prompt(worker, DOC)
        await until(lambda: index.entries_of(name) > 0, "the prompt's blocks indexed")
        known, task = index.entries_of(name), pool.handles[name].feeds[0].task
        eject(pool, name)
        assert not pool.handles[name].available
        await pool.checks.health()  # its engine answers: re-admitted
        assert pool.handles[name].available
        assert index.entries_of(name) == known  # the same engine holds the same blocks
        assert pool.handles[name].feeds[0].task is task
        await prompt(worker, "another document entirely. " * 30)
        await until(lambda: index.entries_of(name) > known, "new blocks indexed")


async def test_a_worker_back_in_rotation_does_not_wait_on_requests_it_was_taken_from() -> None:
    """A request sent with a new prefix, then failed over when its worker was ejected,
    stores nothing there: the worker back in rotation is not called silent for it."""
    async with one_worker() as (worker, pool, name):
        await prompt(worker, DOC)
        await until(lambda: pool.fleet.index.entries_of(name) > 0, "blocks indexed")
        health = pool.fleet.workers[name].health
        assert health is not None
        health.grace_s = 0.0  # any block awaited is overdue at once
        health.note_request(True)  # sent with a new prefix (the picker's commit)...
        assert health.report().state.value != "OK"
        eject_by_connect_failure(pool, name)  # ...and failed over at the ejection
        await pool.checks.health()  # its engine answers: re-admitted
        assert pool.handles[name].available
        assert pool.fleet.workers[name].health is health  # what it knew is kept...
        assert health.report().state.value == "OK", health.report()  # ...not the wait


async def test_an_engine_restarted_while_ejected_is_forgotten_at_readmission() -> None:
    worker = SimWorker(SIM)
    await worker.start()
    reborn: SimWorker | None = None
    try:
        async with pool_of(worker.url) as pool:
            name = f"127.0.0.1:{worker.port}"
            await prompt(worker, DOC)
            await until(lambda: pool.fleet.index.entries_of(name) > 0, "blocks indexed")
            await worker.stop()
            await pool.checks.health()
            await pool.checks.health()  # two failed checks: ejected
            assert not pool.handles[name].available
            reborn = SimWorker(SIM.replace(port=worker.port))
            await reborn.start()
            await pool.checks.health()
            assert pool.handles[name].available
            assert pool.fleet.index.entries_of(name) == 0  # the old engine's cache went with it
    finally:
        await worker.stop()
        if reborn is not None:
            await reborn.stop()


async def test_a_worker_drained_while_down_stays_drained_once_its_ranks_appear() -> None:
    """Added while its engine still loads, it is one endpoint; drained, then found to run
    two data-parallel ranks: both are drained too, and the endpoint they replace is gone
    with what was kept of it (its metric series)."""
    port = free_port()
    name = f"127.0.0.1:{port}"
    async with pool_of(f"http://{name}") as pool:
        removed: list[list[str]] = []
        pool.on_removed.append(lambda h, names: removed.append(names))
        pool.handles[name].set_draining(True)  # POST /admin/workers/NAME/drain
        assert draining(pool) == {name: True}
        worker = sim_worker(SIM.replace(port=port, data_parallel_size=2))
        await worker.start()
        try:
            await pool.checks.health()  # its engine answers: discovered at last
        finally:
            await worker.stop()
        assert draining(pool) == {f"{name}#dp0": True, f"{name}#dp1": True}
        assert removed == [[name]]


async def test_a_drained_worker_restarted_without_its_ranks_stays_drained() -> None:
    """A rolling update that drops --data-parallel-size: the one endpoint that replaces
    the ranks is drained as the worker is, and ejected as it is until re-admitted."""
    worker = sim_worker(SIM.replace(data_parallel_size=2))
    await worker.start()
    reborn: SimWorker | None = None
    try:
        name = f"127.0.0.1:{worker.port}"
        async with pool_of(worker.url) as pool:
            removed: list[list[str]] = []
            pool.on_removed.append(lambda h, names: removed.append(names))
            # while it is asked again it is still out of rotation, its new endpoint too
            available: list[list[bool]] = []
            pool.on_removed.append(lambda h, _: available.append([s.available for s in h.states]))
            pool.handles[name].set_draining(True)
            await worker.stop()
            await pool.checks.health()
            await pool.checks.health()  # ejected
            reborn = SimWorker(SIM.replace(port=worker.port))
            await reborn.start()
            await pool.checks.health()  # back, with other publishers: a new engine
            assert draining(pool) == {name: True}
            assert pool.handles[name].available and pool.handles[name].draining
            assert removed == [[f"{name}#dp0", f"{name}#dp1"]] and available == [[False]]
    finally:
        await worker.stop()
        if reborn is not None:
            await reborn.stop()


async def test_a_change_of_ranks_keeps_the_workers_idle_connections() -> None:
    """Endpoints a new rank layout drops go from the fleet; the worker stays, and so do its
    warm connections (closed, every request after the change would connect anew)."""
    cfg = Config(workers=(WorkerConfig("http://127.0.0.1:9"),), tokenizer=str(PACKAGED_TOKENIZER))
    app = RouterApp(cfg)
    await app.pool.set_workers(cfg.workers)
    try:
        h = next(iter(app.pool.handles.values()))
        key = (h.host, h.port, False)
        conn = SimpleNamespace(transport=None)
        app.upstream._idle[key] = [conn]  # type: ignore[list-item]
        app._forget_worker(h, [f"{h.name}#dp1"])  # a rank dropped, the worker still there
        assert app.upstream._idle.get(key) == [conn]
        await app.pool.set_workers(())  # the worker itself left
        assert key not in app.upstream._idle
    finally:
        await app.pool.stop()


async def test_a_data_parallel_rank_is_judged_alive_by_its_own_tokens() -> None:
    """A request that timed out on one rank counts toward ejecting the worker unless that
    rank generated meanwhile: its siblings' tokens say nothing of it (vLLM's `engine`
    label tells the ranks' counters apart)."""
    worker = sim_worker(SIM.replace(data_parallel_size=2))
    await worker.start()
    try:
        name = f"127.0.0.1:{worker.port}"
        async with pool_of(worker.url) as pool:
            await until(lambda: len(pool.fleet.workers) == 2, "both ranks discovered")
            h = pool.handles[name]
            await pool.checks._scrape_now(h)
            since = pool.clock.now()
            body = {"model": worker.config.model, "prompt": DOC, "max_tokens": 4}
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(
                    f"{worker.url}/v1/completions", json=body, headers={"x-data-parallel-rank": "0"}
                )
                assert resp.status_code == 200, resp.text
            await pool.checks._scrape_now(h)
            assert pool.progressed_since(f"{name}#dp0", since)
            assert not pool.progressed_since(f"{name}#dp1", since)
            # rank 1 hung: its requests time out while rank 0's are answered; its siblings'
            # answers do not reset its count, and its timeouts in a row eject the worker
            for _ in range(pool.config.eject_after_timeouts):
                assert h.available
                pool.timed_out(f"{name}#dp1", since, "no first chunk in time")
                pool.note_answered(f"{name}#dp0")
            assert not h.available
    finally:
        await worker.stop()


async def test_a_hold_follows_timeout_ejections_with_no_answer_or_token_between() -> None:
    """An engine hung behind a live API server passes every /health: from its second
    ejection for timeouts in a row it is held out though /health answers. An answer after
    a re-admission starts the count anew (that was a stall), and a token its engine
    generates ends a hold early."""
    async with one_worker() as (worker, pool, name):
        h = pool.handles[name]
        await pool.checks.scrape()  # the engine's token count so far
        eject_by_timeouts(pool, name)
        await pool.checks.health()
        assert h.available  # the first ejection ends at a passing /health
        pool.note_answered(name)
        eject_by_timeouts(pool, name)
        await pool.checks.health()
        assert h.available  # an answer came between: the first in a row again
        eject_by_timeouts(pool, name)
        await pool.checks.health()
        assert not h.available  # the second in a row: held
        assert 8 < pool.held(h) <= pool.config.timeout_hold_s
        assert "--timeout-hold" in h.last_error
        await pool.checks.scrape()
        await pool.checks.health()
        assert not h.available  # no token yet
        await prompt(worker, DOC)
        await pool.checks.scrape()  # its engine generated: not hung after all
        await pool.checks.health()
        assert h.available and pool.held(h) == 0


async def test_a_health_check_under_way_at_an_ejection_does_not_undo_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker ejected while a health check awaits its answers stays out: the check's
    answers came before the fault (else a hold, or any ejection, lasts until whichever
    check happened to be in flight)."""
    async with one_worker() as (_, pool, name):
        h = pool.handles[name]
        await pool.checks.health()
        asking, go_on = asyncio.Event(), asyncio.Event()
        refresh = pool.checks.refresh_models

        async def slow_refresh(*args: object, **kw: object) -> None:
            asking.set()
            await go_on.wait()
            await refresh(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(pool.checks, "refresh_models", slow_refresh)
        check = asyncio.create_task(pool.checks.health())
        await asyncio.wait_for(asking.wait(), 5)
        eject_by_timeouts(pool, name)  # while the check waits on the worker
        go_on.set()
        await check
        assert not h.available
        await pool.checks.health()  # a check begun after the ejection re-admits it
        assert h.available


async def test_a_whole_engine_hung_over_its_ranks_is_held_at_its_second_ejection() -> None:
    """A hung engine's timeouts land on whichever data-parallel rank each request went to:
    every rank that timed out with no answer since counts the ejection, so the second is
    a hold whichever rank tipped each (counted by the tipping rank alone, K ranks could
    cost K+1 ejections, each a round of requests timing out)."""
    worker = sim_worker(SIM.replace(data_parallel_size=2))
    await worker.start()
    try:
        async with pool_of(worker.url) as pool:
            name = f"127.0.0.1:{worker.port}"
            dp0, dp1 = f"{name}#dp0", f"{name}#dp1"
            h = pool.handles[name]
            eject_by_timeouts(pool, dp0)
            await pool.checks.health()
            assert h.available and pool.held(h) == 0
            pool.note_timeout(dp0, "no response head in 30 s")
            eject_by_timeouts(pool, dp1)  # dp1 tips it; dp0 timed out too, unanswered
            assert not h.available and pool.held(h) > 0
            await pool.checks.health()
            assert not h.available
    finally:
        await worker.stop()


def test_generated_tokens_going_back_are_a_restart() -> None:
    """With prefix caching off vLLM counts no prefix-cache queries: its generated-token
    count going back still shows a new engine process (a held worker is let go for it)."""
    before = EngineMetrics(prefix_queries=0.0, generation_tokens=5_000.0)
    assert restarted(before, EngineMetrics(prefix_queries=0.0, generation_tokens=12.0))
    assert not restarted(before, EngineMetrics(prefix_queries=0.0, generation_tokens=5_001.0))
    assert not restarted(before, EngineMetrics(prefix_queries=None, generation_tokens=None))
    assert restarted(EngineMetrics(prefix_queries=9.0), EngineMetrics(prefix_queries=2.0))
