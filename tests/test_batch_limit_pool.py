"""The learned batch limit through the real worker pool and its probes, over an in-process
vLLM-shaped /metrics (httpx's MockTransport): restarts, removals, shutdown, scrape rate."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from indexer.clock import FakeClock
from router.core.config import Config, WorkerConfig
from router.core.fleet import FleetState
from router.core.load import LEARN_CONFIRM_S
from router.workers import WorkerPool

BIG, SMALL = "10.0.0.1:8000", "10.0.0.2:8000"


@dataclass
class Engine:
    running: int = 0
    waiting: int = 0
    kv: float = 0.3
    queries: int = 1000  # vllm:prefix_cache_queries_total: going back reads as a restart
    healthy: bool = True
    scrapes: int = 0
    gate: asyncio.Event | None = None  # /metrics answers once it is set
    # vllm:num_requests_waiting_by_reason{reason="deferred"} (vLLM >= 0.32); None: not exported
    deferred: int | None = None
    adapter: bool = False  # serves a LoRA adapter beside its base model

    def metrics(self) -> str:
        page = (
            f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
            f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv}\n'
            f'vllm:prefix_cache_queries_total{{engine="0"}} {self.queries}\n'
            f'vllm:prefix_cache_hits_total{{engine="0"}} 0\n'
        )
        if self.deferred is not None:
            capacity = self.waiting - self.deferred
            page += (
                f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} {capacity}\n'
                f'vllm:num_requests_waiting_by_reason{{engine="0",reason="deferred"}} '
                f"{self.deferred}\n"
            )
        return page

    # data-parallel ranks: (running, waiting, deferred) of each, on one page, each rank
    # publishing its own events (vLLM's /kv_event_sources); empty: one engine
    ranks: list[tuple[int, int, int]] = field(default_factory=list)

    def rank_page(self) -> str:
        page = ""
        for r, (running, waiting, deferred) in enumerate(self.ranks):
            labels = f'engine="{r}",model_name="m"'
            page += (
                f"vllm:num_requests_running{{{labels}}} {running}\n"
                f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
                f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv}\n"
                f"vllm:prefix_cache_queries_total{{{labels}}} {self.queries}\n"
                f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} {deferred}\n'
            )
        return page

    def event_sources(self) -> dict[str, Any]:
        return {
            str(r): {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{9 + r}"}
            for r in range(len(self.ranks))
        }

    def models(self) -> list[dict[str, Any]]:
        base = {"id": "m", "max_model_len": 4096}
        return [base, {"id": "m-lora", "parent": "m"}] if self.adapter else [base]


@dataclass
class Fleet:
    engines: dict[str, Engine] = field(default_factory=dict)

    async def handle(self, req: httpx.Request) -> httpx.Response:
        e = self.engines[req.url.netloc.decode()]
        if not e.healthy:
            raise httpx.ConnectError("down", request=req)
        if req.url.path == "/metrics":
            e.scrapes += 1
            if e.gate is not None:
                await e.gate.wait()
            return httpx.Response(200, text=e.rank_page() if e.ranks else e.metrics())
        if req.url.path == "/kv_event_sources":
            return httpx.Response(200, json=e.event_sources())
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": e.models()})
        return httpx.Response(404)


class _NoTokenizers:
    def local(self, model: str) -> None:
        return None


async def pool_of(
    *hosts: str, engine: Engine | None = None, **config: Any
) -> tuple[WorkerPool, Fleet, FakeClock]:
    fleet = Fleet({h: Engine(**vars(engine)) if engine else Engine() for h in hosts})
    clock = FakeClock()
    workers = tuple(WorkerConfig(f"http://{h}") for h in hosts)
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handle))
    cfg = Config(workers=workers, **({"mode": "approx"} | config))
    pool = WorkerPool(cfg, FleetState(clock), client, clock, _NoTokenizers())  # type: ignore[arg-type]
    await pool.set_workers(workers)
    return pool, fleet, clock


async def learn(pool: WorkerPool, clock: FakeClock) -> None:
    await pool.checks.scrape()
    clock.advance(LEARN_CONFIRM_S)
    await pool.checks.scrape()


async def test_an_engine_restart_the_health_checks_see_first_forgets_its_limit() -> None:
    pool, fleet, clock = await pool_of(BIG)
    e = fleet.engines[BIG]
    e.running, e.waiting = 4, 3
    await learn(pool, clock)
    assert pool.fleet.load.batch_limit(BIG) == 4
    e.healthy = False
    for _ in range(3):
        await pool.checks.health()
    assert not pool.handles[BIG].available
    # back with fresh counters (and maybe another --max-num-seqs): the health loop
    # rediscovers it before any scrape compares its counters
    e.healthy, e.queries, e.waiting = True, 5, 0
    await pool.checks.health()
    await pool.checks.scrape()
    assert pool.fleet.load.batch_limit(BIG) is None
    await pool.client.aclose()


async def test_a_removed_workers_late_scrape_does_not_hold_the_floor_up() -> None:
    pool, fleet, clock = await pool_of(BIG, SMALL)
    fleet.engines[BIG].running = 64
    fleet.engines[SMALL].running, fleet.engines[SMALL].waiting = 12, 4
    gate = fleet.engines[BIG].gate = asyncio.Event()
    scrape = asyncio.create_task(pool.checks.scrape())
    await asyncio.sleep(0.05)  # BIG's scrape is in flight ...
    await pool.set_workers((WorkerConfig(f"http://{SMALL}"),))  # ... when it is removed
    gate.set()
    await scrape
    clock.advance(LEARN_CONFIRM_S)
    await pool.checks.scrape()
    assert pool.fleet.load.batch_limit(SMALL) == 12  # not the removed worker's 64
    await pool.client.aclose()


async def test_stopping_the_pool_cancels_a_crowded_workers_scrape() -> None:
    pool, fleet, _ = await pool_of(BIG)
    load = pool.fleet.load
    fleet.engines[BIG].running, fleet.engines[BIG].waiting = 1, 3
    load.scraped(BIG, 1, 0, 0.3, 1000)
    load.start(BIG, 10, 1)
    load.start(BIG, 10, 1)  # 2 sent, 1 ever seen running: scraped at once
    tasks = set(pool.checks._crowded_tasks)
    assert tasks
    await asyncio.sleep(0.05)  # scraped; now waiting to confirm
    await pool.stop()
    await pool.client.aclose()
    assert all(t.done() for t in tasks)


async def test_a_worker_that_stays_crowded_is_scraped_at_most_twice_an_interval() -> None:
    # queueing for KV blocks: more requests than it ever ran, and it never teaches a limit
    pool, fleet, _ = await pool_of(BIG, scrape_interval_s=0.5, health_check_interval_s=60)
    e = fleet.engines[BIG]
    e.running, e.waiting, e.kv = 20, 10, 0.97
    await pool.start(pool.config.workers)
    load = pool.fleet.load
    tickets = [load.start(BIG, 100, 10) for _ in range(30)]
    e.scrapes = 0
    for _ in range(150):  # 1.5 s at 100 requests a second
        load.finish(tickets.pop(0))
        tickets.append(load.start(BIG, 100, 10))
        await asyncio.sleep(0.01)
    await pool.stop()
    await pool.client.aclose()
    assert load.batch_limit(BIG) is None
    assert e.scrapes <= 2 * (1.5 / 0.5) + 2  # periodic ones, and one at once between each


async def test_prefill_and_decode_workers_learn_no_limit() -> None:
    # a handoff's decode engine holds requests whose KV is on its way while its batch has room
    pool, fleet, clock = await pool_of(BIG)
    e = fleet.engines[BIG]
    e.running, e.waiting = 4, 3
    pool.fleet.workers[BIG].role = "decode"
    await learn(pool, clock)
    assert pool.fleet.load.batch_limit(BIG) is None
    pool.fleet.workers[BIG].role = "both"
    clock.advance(LEARN_CONFIRM_S)
    await learn(pool, clock)
    assert pool.fleet.load.batch_limit(BIG) == 4
    await pool.client.aclose()


async def test_a_lora_worker_learns_its_limit_where_its_engine_counts_deferred_apart() -> None:
    # the queue an adapter without a slot builds is vLLM 0.32's "deferred"; without that
    # split a LoRA worker's queue teaches nothing, with it only the requests for slots do
    for deferred, learned in ((None, None), (3, None), (1, 4)):
        pool, fleet, clock = await pool_of(BIG, engine=Engine(adapter=True))
        assert pool.handles[BIG].feeds[0].state.adapters
        e = fleet.engines[BIG]
        e.running, e.waiting, e.deferred = 4, 4, deferred
        await learn(pool, clock)
        assert pool.fleet.load.batch_limit(BIG) == learned, deferred
        await pool.client.aclose()


async def test_a_plain_worker_learns_from_a_queue_vllm_counts_as_deferred() -> None:
    # vLLM keeps every request with a JSON schema or a required tool "deferred" (for its
    # grammar) until it is scheduled: behind a full batch they wait for a slot all the same
    pool, fleet, clock = await pool_of(BIG)
    e = fleet.engines[BIG]
    e.running, e.waiting, e.deferred = 4, 6, 6
    await learn(pool, clock)
    assert pool.fleet.load.batch_limit(BIG) == 4
    await pool.client.aclose()


async def test_a_lora_worker_that_cannot_learn_says_so_once(caplog: Any) -> None:
    pool, fleet, clock = await pool_of(BIG, engine=Engine(adapter=True))
    e = fleet.engines[BIG]
    e.running, e.waiting = 4, 4  # vLLM before 0.32: no split of the queue
    with caplog.at_level(logging.INFO, logger="kvroute.workers"):
        await learn(pool, clock)
        await pool.checks.scrape()
    told = [r.getMessage() for r in caplog.records if "learns no batch limit" in r.getMessage()]
    assert len(told) == 1 and BIG in told[0] and "--busy-max-requests" in told[0], told
    assert pool.fleet.load.batch_limit(BIG) is None
    await pool.client.aclose()


async def test_each_data_parallel_rank_learns_from_its_own_split_queue() -> None:
    # a LoRA engine with two ranks: rank 0's queue is mostly deferred (an adapter without a
    # slot), rank 1's waits for slots; each rank is its own endpoint and learns alone
    engine = Engine(adapter=True, ranks=[(4, 4, 3), (6, 4, 1)])
    pool, _, clock = await pool_of(BIG, engine=engine, mode="events")
    feeds = pool.handles[BIG].feeds
    names = [f.state.name for f in feeds]
    assert names == [f"{BIG}#dp0", f"{BIG}#dp1"]
    # each rank serves the adapter from discovery on, not from the next health check
    assert all(f.state.adapters and f.state.models for f in feeds)
    await learn(pool, clock)
    assert [pool.fleet.load.batch_limit(n) for n in names] == [None, 6]
    await pool.stop()
    await pool.client.aclose()


async def test_under_a_lora_resolver_only_its_base_models_workers_read_the_split() -> None:
    # --lora-resolver: a worker of that base may hold requests for adapters it has no slot
    # for, so only its queue for slots teaches; a worker of another model, whose whole
    # queue is "deferred" (JSON requests waiting on their grammar), still learns from it
    for base, learned in (("m", None), ("another-model", 4)):
        pool, fleet, clock = await pool_of(BIG)
        pool.fleet.lora_resolver = base
        e = fleet.engines[BIG]
        e.running, e.waiting, e.deferred = 4, 6, 6
        await learn(pool, clock)
        assert pool.fleet.load.batch_limit(BIG) == learned, base
        await pool.client.aclose()
