"""Check 3: replay and restart. A subscriber that starts late, one whose stream loses
batches (a relay drops some), and one that starts after the last batch (no live batch ever
reaches it: the replay it fetches on connect must) all recover through the engine's replay
socket to the same index as one that saw everything; an engine restart (sequence back to
0, cache empty) clears the worker's index in all four."""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import httpx
import zmq
import zmq.asyncio

from conformance.client import client, complete
from conformance.observe import Observer, SyncTimeout
from conformance.procs import free_port
from conformance.registry import Findings, check
from conformance.scenarios import BLOCK
from conformance.session import Context
from conformance.targets import KV_EVENTS, REPLAY, RESTART, Engine
from conformance.traffic import token_source, tokens
from indexer.hashing import Namespace, hash_request

DROP = frozenset({1, 4, 5, 9})  # relay message numbers lost, one of them a run of two


class LossyRelay:
    """SUB from the engine, PUB to a subscriber, losing the messages numbered in `drop`."""

    def __init__(self, upstream: str, drop: frozenset[int] = DROP) -> None:
        self.upstream = upstream
        self.drop = drop
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.dropped: list[int] = []
        self._ctx = zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint)
        self._task = asyncio.create_task(self._pump(sub, pub))
        await asyncio.sleep(0.3)
        return self

    async def _pump(self, sub: Any, pub: Any) -> None:
        n = 0
        try:
            while True:
                frames = await sub.recv_multipart()
                if n in self.drop:
                    self.dropped.append(int.from_bytes(frames[1], "big"))
                else:
                    await pub.send_multipart(frames)
                n += 1
        finally:
            sub.close(linger=0)
            pub.close(linger=0)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)


def _observer(engine: Engine, endpoint: str | None = None) -> Observer:
    return Observer(
        endpoint or engine.events_endpoint, engine.replay_endpoint, engine.topic, block_size=BLOCK
    )


async def _traffic(http: httpx.AsyncClient, engine: Engine, seed: str, n: int) -> list[list[int]]:
    """n prompts, half of them extending an earlier one, one at a time."""
    rng = token_source(seed)
    sent: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(sent)[: 2 * BLOCK] if sent and rng.random() < 0.5 else []
        prompt = base + tokens(rng, rng.randint(1, 5) * BLOCK + 3)
        await complete(http, engine.model, prompt)
        sent.append(prompt)
    return sent


async def _settled(*observers: Observer) -> None:
    await asyncio.sleep(0.2)
    for obs in observers:
        await obs.settle(quiet_s=0.2)


def _same_index(f: Findings, named: dict[str, Observer], prompts: list[list[int]]) -> None:
    sets = {name: obs.holds() for name, obs in named.items()}
    f.note("blocks_held", {name: len(s) for name, s in sets.items()})
    full = sets["full"]
    f.require(bool(full), "the full subscriber's index is empty")
    for name, held in sets.items():
        f.require(held == full, f"{name} subscriber holds {len(held)} blocks, full {len(full)}")
    ns = Namespace()
    for name, obs in named.items():
        diffs = [
            i for i, p in enumerate(prompts) if obs.overlap(p, ns) != named["full"].overlap(p, ns)
        ]
        f.require(not diffs, f"{name}: overlaps differ from full for prompts {diffs[:10]}")


@check(
    "replay",
    "late and lossy subscribers recover through the replay socket to the index of one that "
    "saw everything; an engine restart (seq back to 0, cache empty) clears the worker's index",
    needs=(KV_EVENTS, REPLAY, RESTART),
    engines=("main",),
)
async def replay(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(client(engine.url))
        full = await stack.enter_async_context(_observer(engine))
        relay = await stack.enter_async_context(LossyRelay(engine.events_endpoint))
        lossy = await stack.enter_async_context(_observer(engine, relay.endpoint))
        prompts = await _traffic(http, engine, "replay-1", 8)
        late = await stack.enter_async_context(_observer(engine))
        prompts += await _traffic(http, engine, "replay-2", 12)
        # subscribed after the last batch: no live one comes to reveal what it missed (a
        # router restarted beside a warm engine), so the replay on connect must
        warm = await stack.enter_async_context(_observer(engine))
        await _settled(full, lossy, late, warm)
        named = {"full": full, "late": late, "lossy": lossy, "warm": warm}
        f.note("relay_dropped_seqs", relay.dropped)
        f.note("before_restart", {n: o.counter_summary() for n, o in named.items()})
        _same_index(f, named, prompts)
        f.require(late.counters.replays >= 1, "the late subscriber never asked for a replay")
        f.require(len(relay.dropped) == len(DROP), f"relay dropped only {relay.dropped}")
        f.require(lossy.counters.replays >= 1, "the lossy subscriber never asked for a replay")
        await _restart(engine, http, f, named, prompts)


async def _restart(
    engine: Engine,
    http: httpx.AsyncClient,
    f: Findings,
    named: dict[str, Observer],
    old: list[list[int]],
) -> None:
    started = time.monotonic()
    await asyncio.to_thread(engine.restart)
    f.note("restart_s", round(time.monotonic() - started, 1))
    direct = [o for o in named.values() if o.subscriber.status.endpoint == engine.events_endpoint]
    await _reconnected(direct)
    fresh = await _traffic(http, engine, "replay-3", 3)
    ns = Namespace()
    want = {h for p in fresh for h in hash_request(p, BLOCK, ns)}
    for name, obs in named.items():
        try:
            for p in fresh:
                await obs.wait_blocks(p, ns, len(p) // BLOCK, timeout_s=15.0)
        except SyncTimeout as exc:
            f.problems.append(f"{name}: after the restart: {exc}")
            continue
        c = obs.counters
        f.require(c.restarts == 1, f"{name}: {c.restarts} restarts detected, expected 1")
        held = obs.holds()
        f.require(
            held == want, f"{name}: holds {len(held)} blocks after restart, expected {len(want)}"
        )
        stale = [i for i, p in enumerate(old) if obs.overlap(p, ns)]
        f.require(not stale, f"{name}: prompts {stale[:10]} from before the restart still match")
    f.note("after_restart", {n: o.counter_summary() for n, o in named.items()})


async def _reconnected(observers: list[Observer], timeout_s: float = 30.0) -> None:
    """Every subscriber reconnected to the new engine process (and the subscription had time
    to reach it), so its first batches are heard live. (The relay's own SUB reconnects on
    its own; a batch it loses then is recovered by replay like any other gap.)"""
    deadline = time.monotonic() + timeout_s
    for obs in observers:
        status = obs.subscriber.status
        while not (status.connected and status.connects >= 2):
            if time.monotonic() > deadline:
                return  # the counters then show what was missed
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
