"""The engines' batch limit (vLLM's --max-num-seqs), learned from their /metrics: what
teaches it, what does not, what unlearns it, and the busy filter and flag that use it; end
to end against simulated workers whose batch is small."""

from __future__ import annotations

import asyncio
import re

import pytest
from test_serve import kvroute

from engines.sim.config import SimConfig
from indexer.clock import FakeClock
from indexer.hashing import Namespace
from router.cli import build_parser
from router.core.config import Config
from router.core.decision import RouteRequest
from router.core.errors import Overloaded
from router.core.filters import BusyFilter, BusyParams
from router.core.fleet import FleetState
from router.core.load import LEARN_CONFIRM_S, LEARN_MAX_PREFILL_TOKENS, LoadTracker, LoadView
from router.core.scoring import Candidate
from router.serve_cli import load_config


def tracker() -> tuple[LoadTracker, FakeClock]:
    clock = FakeClock()
    return LoadTracker(clock=clock), clock


def scrape(
    load: LoadTracker, worker: str, running: int, waiting: int, kv: float | None = 0.3
) -> None:
    load.scraped(worker, running, waiting, kv, capacity_blocks=1000)


def queued_twice(
    load: LoadTracker,
    clock: FakeClock,
    worker: str = "w",
    running: int = 12,
    waiting: int = 4,
    waiting2: int = 4,
) -> None:
    """Two scrapes LEARN_CONFIRM_S apart showing `running` requests with a queue."""
    scrape(load, worker, running, waiting)
    clock.advance(LEARN_CONFIRM_S)
    scrape(load, worker, running, waiting2)


def test_a_queue_held_at_the_most_running_teaches_the_limit() -> None:
    load, clock = tracker()
    scrape(load, "w", 6, 0)
    assert load.view("w").batch_limit is None
    queued_twice(load, clock)
    assert load.view("w").batch_limit == 12


def test_two_scrapes_close_together_are_one_moment() -> None:
    load, clock = tracker()
    scrape(load, "w", 12, 4)
    assert load.confirming("w")  # the scrape loop looks again LEARN_CONFIRM_S later
    clock.advance(LEARN_CONFIRM_S / 4)
    scrape(load, "w", 12, 4)
    assert load.view("w").batch_limit is None
    clock.advance(LEARN_CONFIRM_S)
    scrape(load, "w", 12, 4)
    assert load.view("w").batch_limit == 12


@pytest.mark.parametrize(
    ("why", "kw"),
    [
        ("one waiting request: it may have arrived since the engine's last step", {"waiting": 1}),
        ("the queue is for KV blocks", {"kv": 0.95}),
        ("the running count moved between the scrapes", {"running2": 11}),
        ("the queue cleared between the scrapes", {"waiting2": 0}),
    ],
)
def test_queues_a_full_batch_does_not_explain_teach_nothing(why: str, kw: dict[str, float]) -> None:
    load, clock = tracker()
    scrape(load, "w", 12, int(kw.get("waiting", 4)), kw.get("kv", 0.3))
    clock.advance(LEARN_CONFIRM_S)
    running2 = int(kw.get("running2", 12))
    scrape(load, "w", running2, int(kw.get("waiting2", kw.get("waiting", 4))), kw.get("kv", 0.3))
    assert load.view("w").batch_limit is None, why


def test_a_queue_behind_prefill_work_is_the_token_budget_not_the_batch() -> None:
    load, clock = tracker()
    load.start("w", uncached_tokens=LEARN_MAX_PREFILL_TOKENS, blocks=64)
    queued_twice(load, clock)
    assert load.view("w").batch_limit is None


def test_requests_waiting_for_a_prefill_of_their_prefix_are_not_a_full_batch() -> None:
    # the engine holds a request whose cached prefix another request is still prefilling
    load, clock = tracker()
    for _ in range(3):
        load.start("w", uncached_tokens=16, blocks=64, rides=True)
    queued_twice(load, clock, running=1, waiting=4, waiting2=4)
    assert load.view("w").batch_limit is None
    queued_twice(load, clock, running=1, waiting=5, waiting2=5)
    assert load.view("w").batch_limit == 1


def test_a_queue_under_the_most_ever_running_teaches_nothing() -> None:
    load, clock = tracker()
    scrape(load, "w", 16, 0)
    queued_twice(load, clock, running=12)
    assert load.view("w").batch_limit is None


def test_more_running_than_the_limit_unlearns_it_and_a_restart_forgets_it() -> None:
    load, clock = tracker()
    queued_twice(load, clock)
    scrape(load, "w", 13, 0)
    assert load.view("w").batch_limit is None
    queued_twice(load, clock, running=16)
    assert load.view("w").batch_limit == 16
    load.forget_batch("w")  # a restarted engine
    scrape(load, "w", 4, 0)
    assert load.view("w").batch_limit is None
    queued_twice(load, clock, running=8)  # the new engine's smaller batch is learned
    assert load.view("w").batch_limit == 8


def test_a_limit_is_never_below_what_any_worker_was_seen_running() -> None:
    # a limit learned from a queue that was not for slots would hold itself in place: the
    # worker never gets more requests to show it wrong
    load, clock = tracker()
    scrape(load, "big", 12, 0)
    queued_twice(load, clock, worker="small", running=9)
    assert load.view("small").batch_limit == 12
    load.forget("big")
    assert load.view("small").batch_limit == 9


def test_a_worker_sent_more_than_it_ever_ran_is_scraped_now() -> None:
    load, clock = tracker()
    crowded: list[str] = []
    load.on_crowded = crowded.append
    load.start("w", 10, 1)
    assert crowded == []  # never scraped: nothing to compare with
    scrape(load, "w", 1, 0)
    load.start("w", 10, 1)
    assert crowded == ["w"]  # 2 sent, at most 1 seen running
    queued_twice(load, clock, running=2)
    load.start("w", 10, 1)
    assert crowded == ["w"]  # the limit is known


def request() -> RouteRequest:
    return RouteRequest(model="", namespace=Namespace(), prompt_tokens=48)


def fleet() -> FleetState:
    return FleetState(FakeClock())


def cand(requests: int, limit: int | None) -> Candidate:
    return Candidate("w", 16, {}, LoadView(requests, 0, 0, None, batch_limit=limit), 0, 100)


def test_the_busy_filter_holds_a_worker_at_its_learned_batch() -> None:
    on = BusyFilter(BusyParams())
    assert on._why(cand(11, 12)) is None
    why = on._why(cand(12, 12))
    assert why is not None and "its engine's batch of 12, learned from its /metrics" in why
    assert on._why(cand(50, None)) is None
    assert BusyFilter(BusyParams(learn_batch=False))._why(cand(12, 12)) is None
    tighter = BusyFilter(BusyParams(max_requests=8))._why(cand(8, 12))
    assert tighter is not None and "busy_max_requests 8" in tighter


def test_a_learned_limit_never_sheds() -> None:
    # a 429 at kvroute's own inference would refuse work the engine can queue, and a limit
    # learned too low could never show itself wrong
    shed = BusyFilter(BusyParams(max_kv_usage=0.95, shed=True))
    learned = {"w": shed._why(cand(12, 12)) or ""}
    assert learned["w"].endswith("learned from its /metrics")
    assert shed.when_empty(request(), learned, fleet()) is None
    bound = BusyFilter(BusyParams(max_requests=8, shed=True))
    assert isinstance(
        bound.when_empty(request(), {"w": bound._why(cand(12, 12)) or ""}, fleet()), Overloaded
    )


def test_a_worker_serving_lora_adapters_learns_no_limit() -> None:
    # vLLM holds requests for an adapter it has no slot for (--max-loras) while its batch
    # has room: that queue teaches nothing
    load, clock = tracker()
    for _ in range(2):
        load.scraped("w", 5, 4, 0.3, capacity_blocks=1000, deferred=None)
        clock.advance(LEARN_CONFIRM_S)
    assert load.view("w").batch_limit is None


def test_requests_the_engine_defers_are_not_a_queue_for_slots() -> None:
    # vLLM 0.32 counts the requests it holds for a LoRA slot, KV in transfer or a grammar
    # apart ("deferred"); only the rest of the queue can show a full batch
    load, clock = tracker()
    for _ in range(2):
        load.scraped("w", 5, 4, 0.3, capacity_blocks=1000, deferred=3)
        clock.advance(LEARN_CONFIRM_S)
    assert load.view("w").batch_limit is None  # one request waits for a slot
    for _ in range(2):
        load.scraped("w", 5, 4, 0.3, capacity_blocks=1000, deferred=2)
        clock.advance(LEARN_CONFIRM_S)
    assert load.view("w").batch_limit == 5


def test_learning_is_on_by_default_and_a_flag_turns_it_off() -> None:
    assert Config().busy_learn_batch is True
    args = build_parser("serve").parse_args(
        ["serve", "--worker", "http://a:1", "--no-busy-learn-batch"]
    )
    config = load_config(args, {})
    assert config.busy_learn_batch is False
    busy = config.profile("default").filters
    assert any(isinstance(f, BusyFilter) and not f.params.learn_batch for f in busy)


# ---- end to end: kvroute serve over a simulated worker running 2 requests at once -----

SMALL_BATCH = SimConfig(block_size=16, kv_blocks=512, topic="kv-events", max_num_seqs=2)


async def test_a_full_batch_is_learned_from_the_engines_metrics() -> None:
    async with kvroute(1, sim=SMALL_BATCH) as s:
        body = {"model": "kvroute-sim", "max_tokens": 3000, "ignore_eos": True}
        held = [
            asyncio.create_task(s.client.post("/v1/completions", json={**body, "prompt": f"q{i}"}))
            for i in range(5)
        ]
        try:
            limit = None
            for _ in range(100):  # 2 run, 3 wait: learned within ~2 scrapes
                metrics = (await s.client.get("/metrics")).text
                limit = re.search(r'kvroute_worker_batch_limit\{worker="([^"]+)"\} (\S+)', metrics)
                if limit:
                    break
                await asyncio.sleep(0.05)
            assert limit is not None, "the batch limit was never learned"
            assert float(limit.group(2)) == 2.0
            route = (await s.client.post("/debug/route", json={"prompt": "q9"})).json()
            (w,) = route["workers"]
            assert "its engine's batch of 2" in (w["excluded"] or w["relaxed"] or "")
        finally:
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_no_limit_is_learned_where_the_batch_never_fills() -> None:
    async with kvroute(1) as s:  # the simulator's default batch of 64
        body = {"model": "kvroute-sim", "max_tokens": 64, "ignore_eos": True}
        done = await asyncio.gather(
            *(s.client.post("/v1/completions", json={**body, "prompt": f"q{i}"}) for i in range(8))
        )
        assert all(r.status_code == 200 for r in done)
        assert "kvroute_worker_batch_limit{" not in (await s.client.get("/metrics")).text
