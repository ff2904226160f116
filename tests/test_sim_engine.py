"""Scheduling (queueing, preemption, chunked prefill, generated blocks) and the latency model,
asserted on simulated time, never on the wall clock."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from engines.sim.blockpool import BlockPool, CacheKeys, Hasher
from engines.sim.config import SimConfig
from engines.sim.engine import Output, VirtualClock
from engines.sim.kvcache import KVCacheManager
from engines.sim.latency import LatencyModel
from engines.sim.request import Sampling, SimRequest, Status
from engines.sim.scheduler import Scheduler
from engines.sim.worker import SimWorker
from engines.vllm.events import BlockStored

EOS = 1


def scheduler(blocks: int, bs: int = 4, seqs: int = 8, budget: int = 10_000) -> Scheduler:
    pool = BlockPool(blocks, bs)
    return Scheduler(
        KVCacheManager(pool, Hasher(bs)),
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=1000,
        eos_token_id=EOS,
    )


def counting(req: SimRequest) -> int:
    return 100 + len(req.output_ids)


def run(s: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while s.has_work and steps < max_steps:
        s.update(s.schedule(), counting)
        steps += 1
    return steps


def req(rid: str, n: int, max_tokens: int, first: int = 10) -> SimRequest:
    return SimRequest(rid, list(range(first, first + n)), Sampling(max_tokens, ignore_eos=True))


def test_a_request_that_does_not_fit_waits_for_blocks() -> None:
    s = scheduler(blocks=7)  # 6 usable = 24 tokens
    a, b = req("a", 16, 4), req("b", 16, 4, first=500)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), counting)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    run(s)
    assert a.output_ids == b.output_ids == [100, 101, 102, 103]
    assert s.stats.preemptions == 0


def test_a_full_pool_preempts_the_newest_and_it_recomputes() -> None:
    s = scheduler(blocks=9)  # 8 usable = 32 tokens
    a, b = req("a", 12, 12), req("b", 12, 12, first=500)
    s.add(a)
    s.add(b)
    run(s)
    assert s.stats.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_ids == b.output_ids == list(range(100, 112))
    assert b.num_cached_tokens == 0  # recorded at first admission only
    assert s.kv.pool.num_free == 8


def test_chunked_prefill_spreads_a_prompt_over_steps() -> None:
    s = scheduler(blocks=64, budget=32)
    r = req("a", 100, 1)
    s.add(r)
    assert run(s) == 4
    assert r.output_ids == [100]


def test_max_num_seqs_bounds_the_batch() -> None:
    s = scheduler(blocks=64, seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 4, 3, first=100 * i))
    s.update(s.schedule(), counting)
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_a_request_for_another_adapter_waits_deferred_while_the_rest_pass() -> None:
    """vLLM's --max-loras 1: with adapter 1 running, a request for adapter 2 is passed over
    (counted deferred until scheduled) and the base-model request behind it runs."""
    s = scheduler(blocks=64)
    ad1, ad2 = (CacheKeys(lora_name=f"ad{i}", lora_path="/p", lora_id=i) for i in (1, 2))
    a = SimRequest("a", list(range(10, 18)), Sampling(6, ignore_eos=True), keys=ad1)
    b = SimRequest("b", list(range(40, 48)), Sampling(2, ignore_eos=True), keys=ad2)
    c = req("c", 8, 2, first=80)
    s.add(a)
    s.update(s.schedule(), counting)
    s.add(b)
    s.add(c)
    s.update(s.schedule(), counting)
    assert [r.request_id for r in s.running] == ["a", "c"]
    assert list(s.waiting) == [b] and s.lora_deferred == {b}
    run(s)
    assert b.output_ids == [100, 101] and not s.lora_deferred  # ran once adapter 1 left
    s.max_loras = 2
    a2 = SimRequest("a2", list(range(10, 18)), Sampling(4, ignore_eos=True), keys=ad1)
    b2 = SimRequest("b2", list(range(40, 48)), Sampling(2, ignore_eos=True), keys=ad2)
    s.add(a2)
    s.add(b2)
    s.update(s.schedule(), counting)
    assert {r.request_id for r in s.running} == {"a2", "b2"} and not s.lora_deferred


def test_generated_tokens_fill_blocks_that_are_stored_with_their_parent() -> None:
    s = scheduler(blocks=64)
    r = req("a", 6, 8)
    s.add(r)
    events = []
    while s.has_work:
        s.update(s.schedule(), counting)
        events += s.kv.pool.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    # prompt block [10..13]; then [14, 15, 100, 101], [102..105] as the outputs are fed back
    assert [e.token_ids for e in stored] == [
        [10, 11, 12, 13],
        [14, 15, 100, 101],
        [102, 103, 104, 105],
    ]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]


def test_report_mode_full_publishes_a_requests_cache_hits_again() -> None:
    """vllm_xargs {"kv_cache_report_mode": "full"}: as vLLM's scheduler looks a request's
    prefix up, the blocks it found cached are published again, from the root; a request
    without it publishes only what it computes."""
    s = scheduler(blocks=64)

    def stores(r: SimRequest) -> list[BlockStored]:
        s.add(r)
        events = []
        while s.has_work:
            s.update(s.schedule(), counting)
            events += s.kv.pool.take_events()
        return [e for e in events if isinstance(e, BlockStored)]

    [first] = stores(req("a", 13, 1))  # 3 full blocks
    assert stores(req("b", 13, 1)) == []  # all cached (its last token's block is partial)
    full = SimRequest("c", list(range(10, 23)), Sampling(1, ignore_eos=True, report_cached=True))
    [again] = stores(full)
    assert again.parent_block_hash is None
    assert again.block_hashes == first.block_hashes
    assert again.token_ids == first.token_ids == list(range(10, 22))
    assert s.kv.pool.counters.stored == 3  # no block behind the report


def test_eos_and_stop_tokens_finish_a_request() -> None:
    s = scheduler(blocks=64)
    r = SimRequest("a", [5, 6, 7], Sampling(10, stop_token_ids=(102,)))
    s.add(r)
    run(s)
    assert (r.output_ids, r.finish_reason, r.stop_reason) == ([100, 101, 102], "stop", 102)
    r2 = SimRequest("b", [5, 6, 7], Sampling(10))
    s.add(r2)
    while s.has_work:
        s.update(s.schedule(), lambda _: EOS)
    assert (r2.output_ids, r2.finish_reason) == ([EOS], "stop")


def test_reset_refuses_while_running_unless_asked_to_preempt() -> None:
    s = scheduler(blocks=64)
    r = req("a", 8, 5)
    s.add(r)
    s.update(s.schedule(), counting)
    assert not s.reset_prefix_cache()
    assert s.reset_prefix_cache(reset_running=True)
    assert r.status is Status.PREEMPTED
    run(s)
    assert r.output_ids == list(range(100, 105))


# ---- the latency model on simulated time -------------------------------------------------------


def test_calibration_matches_the_seeds_measurements() -> None:
    m = LatencyModel()
    assert m.ttft_ms(1500) == pytest.approx(80, abs=0.5)
    assert m.ttft_ms(1500, cached_tokens=1488) == pytest.approx(15.7, abs=0.5)
    assert m.step_ms([(3500, 0)], decodes=1) == pytest.approx(227, abs=0.5)
    assert m.step_ms([], decodes=5) == 15


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


async def started(clock: VirtualClock, **over: object) -> SimWorker:
    worker = SimWorker(SimConfig(events=False).replace(**over), clock=clock, sleep=clock.sleep)
    await worker.engine.start()
    return worker


def prompt(worker: SimWorker, n: int, salt: int = 0) -> list[int]:
    words = worker.tokenizer.word_ids
    return [0] + [words[(i * 7 + salt) % len(words)] for i in range(n - 1)]


async def first_token_s(worker: SimWorker, clock: VirtualClock, ids: list[int]) -> float:
    start = clock.now()
    handle = worker.engine.submit(ids, Sampling(max_tokens=1))
    async for out in handle.outputs():
        return out.time - start
    raise AssertionError("no output")


async def test_a_cached_prefix_is_faster_than_an_uncached_one(clock: VirtualClock) -> None:
    worker = await started(clock)
    ids = prompt(worker, 1500)
    uncached = await first_token_s(worker, clock, ids)
    cached = await first_token_s(worker, clock, ids)
    other = await first_token_s(worker, clock, prompt(worker, 1500, salt=3))
    await worker.engine.stop()
    assert cached < uncached / 4
    assert uncached == pytest.approx(0.080, abs=0.001)
    assert cached == pytest.approx(0.0157, abs=0.001)
    assert other == pytest.approx(uncached)


async def stream_gaps(worker: SimWorker, clock: VirtualClock) -> tuple[list[float], float]:
    """Inter-token gaps of a running stream while a 3,500-token prompt arrives, and that
    prompt's time to first token."""
    running = worker.engine.submit(prompt(worker, 40), Sampling(40, ignore_eos=True))
    times: list[float] = []
    long_ttft = 0.0

    async def long_request() -> None:
        nonlocal long_ttft
        start = clock.now()
        handle = worker.engine.submit(prompt(worker, 3500, salt=1), Sampling(max_tokens=1))
        async for out in handle.outputs():
            long_ttft = out.time - start

    task = None
    async for out in running.outputs():
        times.append(out.time)
        if len(times) == 5:
            task = asyncio.create_task(long_request())
    assert task is not None
    await task
    return [b - a for a, b in itertools.pairwise(times)], long_ttft


async def test_a_long_prefill_stalls_a_running_stream(clock: VirtualClock) -> None:
    worker = await started(clock)
    gaps, _ = await stream_gaps(worker, clock)
    await worker.engine.stop()
    assert statistics.median(gaps) == pytest.approx(0.015)
    assert max(gaps) == pytest.approx(0.227, abs=0.002)


async def test_a_chunked_prefill_budget_spreads_the_stall(clock: VirtualClock) -> None:
    worker = await started(clock, max_num_batched_tokens=512)
    gaps, long_ttft = await stream_gaps(worker, clock)
    await worker.engine.stop()
    assert max(gaps) < 0.08
    assert long_ttft > 0.227  # the long prompt pays for it instead


async def test_outputs_are_deterministic_across_workers(clock: VirtualClock) -> None:
    a, b = await started(clock), await started(clock)
    ids = prompt(a, 30)
    texts = []
    for w in (a, b):
        handle = w.engine.submit(ids, Sampling(max_tokens=20))
        outs: list[Output] = [o async for o in handle.outputs()]
        texts.append([o.token_id for o in outs])
        await w.engine.stop()
    assert texts[0] == texts[1] and len(texts[0]) >= 1
