"""Real ZMQ on loopback: the simulator's publisher (with its replay socket) on one side, the
router's subscriber and ingest on the other. Lost batches, a late subscriber and an engine
restart must all end with the index equal to what the publisher's engine really holds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from engines.sim.events_pub import EventPublisher, PublisherConfig
from engines.vllm import events as wire
from engines.vllm.events import decode_batch
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest
from indexer.subscriber import EventSubscriber

pytestmark = pytest.mark.timeout(60)
BS = 4


class LossyPublisher(EventPublisher):
    """A publisher whose live socket drops chosen sequence numbers (as a full HWM would);
    the replay buffer still has them, as in vLLM."""

    def __init__(self, config: PublisherConfig, drop: set[int]) -> None:
        super().__init__(config)
        self.drop = drop

    async def publish(self, ts: float, events: list[wire.WireEvent]) -> None:
        if self.seq in self.drop:
            self._buffer.append((self.seq, wire.encode_batch(ts, events, 0)))
            self.seq += 1
            return
        await super().publish(ts, events)


class Engine:
    """The publisher side's truth: chains of blocks it holds."""

    def __init__(self, pub: EventPublisher) -> None:
        self.pub = pub
        self.held: dict[int, list[int]] = {}  # chain id -> tokens

    async def store(self, chain: int, n_blocks: int = 3) -> None:
        tokens = [chain * 100 + i for i in range(n_blocks * BS)]
        hashes = [chain * 1000 + i for i in range(n_blocks)]
        event = wire.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        self.held[chain] = tokens
        await self.pub.publish(time.time(), [event])

    async def evict(self, chain: int) -> None:
        n = len(self.held.pop(chain)) // BS
        hashes = [chain * 1000 + i for i in reversed(range(n))]
        await self.pub.publish(time.time(), [wire.BlockRemoved(block_hashes=hashes, medium="GPU")])


async def wait_until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def index_view(index: PrefixIndex, chains: range) -> dict[int, int]:
    out = {}
    for chain in chains:
        tokens = [chain * 100 + i for i in range(3 * BS)]
        match = index.find_matches(hash_request(tokens, BS, Namespace())).get("w")
        if match:
            out[chain] = match.blocks
    return out


def truth(engine: Engine) -> dict[int, int]:
    return {c: len(t) // BS for c, t in engine.held.items()}


@contextlib.asynccontextmanager
async def subscribed(
    pub: EventPublisher, replay: bool = True
) -> AsyncIterator[tuple[PrefixIndex, WorkerIngest, EventSubscriber]]:
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, decode_batch, FakeClock())
    assert pub.endpoint is not None
    sub = EventSubscriber(
        ingest, pub.endpoint, replay_endpoint=pub.replay_endpoint if replay else None
    )
    task = asyncio.create_task(sub.run())
    try:
        await wait_until(lambda: sub.status.connected)
        await asyncio.sleep(0.2)  # let the subscription itself reach the publisher
        yield index, ingest, sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def started(
    drop: set[int], endpoint: str = "tcp://127.0.0.1:0", replay: str | None = "tcp://127.0.0.1:0"
) -> LossyPublisher:
    pub = LossyPublisher(PublisherConfig(endpoint=endpoint, replay_endpoint=replay), drop)
    await pub.start()
    return pub


async def test_lost_batches_and_late_join_recover_through_replay() -> None:
    pub = await started(drop={4, 5})
    engine = Engine(pub)
    try:
        for chain in (1, 2):  # published before anyone listens: the slow joiner's loss
            await engine.store(chain)
        async with subscribed(pub) as (index, ingest, _):
            await engine.store(3)  # seq 2: a gap from 0 -> replay
            await wait_until(lambda: ingest.tracker.last_applied == 2)
            assert ingest.counters.gaps == 1
            await engine.store(4)  # seq 3
            await engine.store(5)  # seq 4: dropped live
            await engine.evict(1)  # seq 5: dropped live
            await engine.store(6)  # seq 6: gap 4..5 -> replay
            await wait_until(lambda: ingest.tracker.last_applied == 6)
            assert index_view(index, range(1, 8)) == truth(engine)
            c = ingest.counters
            assert c.gaps == 2 and c.replays == 2 and c.resyncs == 0 and c.restarts == 0
    finally:
        await pub.stop()


async def test_without_replay_a_gap_resyncs_and_keeps_only_what_it_saw() -> None:
    pub = await started(drop={1}, replay=None)
    engine = Engine(pub)
    try:
        async with subscribed(pub, replay=False) as (index, ingest, _):
            await engine.store(1)  # seq 0
            await engine.store(2)  # seq 1: dropped
            await engine.store(3)  # seq 2: gap, no replay: clear and start over
            await wait_until(lambda: ingest.tracker.last_applied == 2)
            assert index_view(index, range(1, 4)) == {3: 3}
            assert ingest.counters.resyncs == 1
    finally:
        await pub.stop()


async def test_engine_restart_clears_the_worker() -> None:
    pub = await started(drop=set())
    engine = Engine(pub)
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    assert endpoint is not None and replay is not None
    async with subscribed(pub) as (index, ingest, sub):
        for chain in (1, 2, 3):
            await engine.store(chain)
        await wait_until(lambda: ingest.tracker.last_applied == 2)
        assert index_view(index, range(1, 6)) == {1: 3, 2: 3, 3: 3}
        await pub.stop()  # the engine process dies...
        pub = await started(drop=set(), endpoint=endpoint, replay=replay)  # ...and comes back
        engine = Engine(pub)
        await wait_until(lambda: sub.status.connects >= 2, timeout=10)
        await asyncio.sleep(0.2)
        await engine.store(4)  # seq 0 again, cache empty
        await engine.store(5)
        await wait_until(lambda: ingest.counters.restarts == 1 and ingest.tracker.last_applied == 1)
        assert index_view(index, range(1, 6)) == truth(engine) == {4: 3, 5: 3}
    await pub.stop()
