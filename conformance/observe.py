"""kvroute's view of one engine: the real subscriber (`indexer.subscriber.EventSubscriber`)
feeding the real ordered ingest into a real `PrefixIndex`, exactly as the router runs them.

    async with Observer(engine.events_endpoint, engine.replay_endpoint, topic) as obs:
        ...send a request...
        await obs.settle()
        obs.overlap(tokens, Namespace(lora_name="lora-a"))
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import zmq.asyncio

from engines.vllm.events import decode_batch
from indexer.clock import MonotonicClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import IngestCounters, ReplayRequest, WorkerIngest
from indexer.subscriber import EventSubscriber

WORKER = "worker"


class _TrackedIngest(WorkerIngest):
    """The router's ingest, plus whether a replay it asked for is still in flight."""

    replay_in_flight = False

    def on_live(self, seq: int, payload: bytes) -> ReplayRequest | None:
        request = super().on_live(seq, payload)
        if request is not None:
            self.replay_in_flight = True
        return request

    def finish_replay(self, frames: Sequence[tuple[int, bytes]] | None) -> None:
        self.replay_in_flight = False
        super().finish_replay(frames)

    def on_connected(self) -> ReplayRequest | None:
        request = super().on_connected()
        if request is not None:
            self.replay_in_flight = True
        return request

    def finish_connect_replay(self, frames: Sequence[tuple[int, bytes]] | None) -> None:
        self.replay_in_flight = False
        super().finish_connect_replay(frames)


class SyncTimeout(TimeoutError):
    """The index did not reach the expected state in time (events lost or never sent)."""


class Observer:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        *,
        block_size: int,
        model: str = "",
    ) -> None:
        self.block_size = block_size
        self.model = model
        self.index = PrefixIndex()
        self.index.add_worker(WORKER, model)
        self.ingest = _TrackedIngest(WORKER, self.index, decode_batch, MonotonicClock())
        self._ctx = zmq.asyncio.Context()
        self.subscriber = EventSubscriber(
            self.ingest, endpoint, replay_endpoint=replay_endpoint, topic=topic, ctx=self._ctx
        )
        self._task: asyncio.Task[None] | None = None
        self._applied = 0
        self._changed_at = time.monotonic()

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self.subscriber.run(), name="conformance-observer")
        try:
            await self._connected(self._task)
        except BaseException:
            await self.close()
            raise
        # ZMQ slow joiner: let the subscription reach the publisher before traffic starts.
        await asyncio.sleep(0.3)
        return self

    async def _connected(self, task: asyncio.Task[None], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.subscriber.status.connected:
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise SyncTimeout(f"no connection to {self.subscriber.status.endpoint}")
            await asyncio.sleep(0.01)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._ctx.destroy(linger=0)

    @property
    def counters(self) -> IngestCounters:
        return self.ingest.counters

    def _progress(self) -> int:
        c = self.ingest.counters
        return c.batches + c.duplicates + c.replays + c.replay_failures + c.restarts

    async def settle(self, quiet_s: float = 0.04, timeout_s: float = 10.0) -> None:
        """Wait until no batch arrived for `quiet_s` (the engine publishes a step's events
        before it answers the request, so a short quiet period means caught up)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            progress = self._progress()
            if progress != self._applied or self.ingest.replay_in_flight:
                self._applied, self._changed_at = progress, time.monotonic()
            elif time.monotonic() - self._changed_at >= quiet_s:
                return
            await asyncio.sleep(0.005)
        raise SyncTimeout(f"events still arriving after {timeout_s} s")

    async def wait_blocks(
        self, tokens: Sequence[int], ns: Namespace, blocks: int, timeout_s: float = 10.0
    ) -> None:
        """Wait until the index holds the first `blocks` blocks of `tokens`, then settle."""
        deadline = time.monotonic() + timeout_s
        while self.overlap(tokens, ns) < blocks:
            if time.monotonic() > deadline:
                raise SyncTimeout(
                    f"index holds {self.overlap(tokens, ns)} of {blocks} blocks after "
                    f"{timeout_s} s (counters: {self.counter_summary()})"
                )
            await asyncio.sleep(0.005)
        await self.settle()

    def namespace(self, lora_name: str | None = None, cache_salt: str | None = None) -> Namespace:
        return Namespace(self.model, lora_name, cache_salt)

    def overlap(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Leading blocks of `tokens` the index says the engine holds."""
        hashes = hash_request(tokens, self.block_size, ns)
        found = self.index.find_matches(hashes).get(WORKER)
        return found.blocks if found else 0

    def holds(self) -> set[int]:
        return set(self.index.holds(WORKER))

    def counter_summary(self) -> dict[str, Any]:
        c = self.ingest.counters
        keys = ("batches", "blocks_stored", "blocks_removed", "gaps", "replays", "resyncs")
        out: dict[str, Any] = {k: getattr(c, k) for k in keys}
        more = ("restarts", "duplicates", "malformed", "unknown_parent", "unknown_removed")
        out |= {k: getattr(c, k) for k in more}
        out["events"] = dict(c.events)
        return out
