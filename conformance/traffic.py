"""Traffic that makes an engine publish every kind of KV event, and the raw frames it
published (live from the PUB socket, and everything since start from the replay socket)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import TracebackType
from typing import Any, Self

import httpx
import zmq
import zmq.asyncio

from conformance.client import complete, reset_prefix_cache
from conformance.scenarios import BLOCK, VOCAB
from conformance.targets import Engine
from indexer.subscriber import ReplayClient, parse_seq


def token_source(seed: str) -> random.Random:
    return random.Random(f"kvroute-traffic-{seed}")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


async def mixed_traffic(engine: Engine, http: httpx.AsyncClient, seed: str) -> int:
    """Plain, LoRA, cache_salt and LoRA+salt prompts, generated tokens filling blocks, a
    prefix-cache reset, then enough distinct prompts to evict. Returns requests sent."""
    rng = token_source(seed)
    model, lora = engine.model, engine.lora_name
    shared = tokens(rng, 2 * BLOCK)
    sent = [
        (model, shared + tokens(rng, BLOCK + 3), None, 1),
        (model, shared + tokens(rng, 5), "tenant-a", 1),
        (model, tokens(rng, 40), None, 2 * BLOCK),  # generated tokens fill blocks too
    ]
    if lora is not None:
        sent += [(lora, shared + tokens(rng, 9), None, 1), (lora, tokens(rng, 70), "tenant-b", 1)]
    for m, prompt, salt, max_tokens in sent:
        await complete(http, m, prompt, cache_salt=salt, max_tokens=max_tokens)
    await reset_prefix_cache(http)
    capacity = engine.spec.num_gpu_blocks
    fill = [tokens(rng, 16 * BLOCK + 1) for _ in range(capacity // 16 + 2)]
    for prompt in fill:
        await complete(http, model, prompt)
    return len(sent) + len(fill)


async def replayed_frames(engine: Engine, start: int = 0) -> list[tuple[int, bytes]]:
    """Everything the engine still buffers from `start` (byte-identical to what went live)."""
    ctx = zmq.asyncio.Context()
    try:
        frames = await ReplayClient(ctx, engine.replay_endpoint, timeout_s=10.0).fetch(start)
    finally:
        ctx.destroy(linger=0)
    if frames is None:
        raise RuntimeError(f"replay socket {engine.replay_endpoint} did not answer")
    return frames


class FrameTap:
    """Collects (seq -> payload) from a PUB socket while open."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.frames: dict[int, bytes] = {}
        self.topics: set[bytes] = set()
        self._ctx = zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._task = asyncio.create_task(self._collect(sock))
        await asyncio.sleep(0.5)  # ZMQ slow joiner
        return self

    async def _collect(self, sock: Any) -> None:
        try:
            while True:
                topic, seq, payload = await sock.recv_multipart()
                self.topics.add(topic)
                self.frames[parse_seq(seq)] = payload
        finally:
            sock.close(linger=0)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.sleep(0.2)  # the last step's batch
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)
