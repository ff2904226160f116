"""ZMQ probes of a worker's KV event sockets, as the router would see them.

`handshake`: connect and wait for a completed ZMTP handshake (a real peer of the right socket
type answered, not just an open port). `replay_ping`: ask the replay socket for batches from a
sequence number that cannot exist yet and wait for its end marker. `EventTap`: a SUB socket that
records every BlockStored it sees, to match a probe prompt's token ids."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engines.vllm.events import BlockStored, MalformedPayload, decode_wire

END_SEQ = b"\xff" * 8
NO_SUCH_SEQ = (2**63 - 1).to_bytes(8, "big")
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
)


@dataclass(frozen=True)
class Reach:
    endpoint: str
    ok: bool
    ms: float
    detail: str


async def _await_handshake(sock: zmq.asyncio.Socket, endpoint: str, timeout: float) -> Reach:
    monitor = sock.get_monitor_socket(_EVENTS)
    t0 = time.perf_counter()
    retries = 0
    try:
        sock.connect(endpoint)
        while (left := timeout - (time.perf_counter() - t0)) > 0:
            try:
                raw = await asyncio.wait_for(monitor.recv_multipart(), left)
            except TimeoutError:
                break
            event = parse_monitor_message(raw)["event"]
            ms = (time.perf_counter() - t0) * 1000
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return Reach(endpoint, True, ms, f"ZMQ handshake in {ms:.0f} ms")
            if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                why = "the peer is not a ZMQ socket of the matching type (wrong port?)"
                return Reach(endpoint, False, ms, f"handshake failed: {why}")
            retries += event == zmq.EVENT_CONNECT_RETRIED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    ms = (time.perf_counter() - t0) * 1000
    why = f"connection refused, retried {retries} times" if retries else "no ZMQ answer"
    return Reach(endpoint, False, ms, f"{why} in {timeout:g} s")


async def handshake(
    ctx: zmq.asyncio.Context, endpoint: str, timeout: float, kind: int = zmq.SUB
) -> Reach:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        return await _await_handshake(sock, endpoint, timeout)
    finally:
        sock.close(linger=0)


async def replay_ping(ctx: zmq.asyncio.Context, endpoint: str, timeout: float) -> Reach:
    """The replay ROUTER answers a request for sequence 2**63-1 with just its end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        reach = await _await_handshake(sock, endpoint, timeout)
        if not reach.ok:
            return reach
        t0 = time.perf_counter()
        await sock.send_multipart([b"", NO_SUCH_SEQ])
        return await _await_end(sock, endpoint, timeout, t0)
    finally:
        sock.close(linger=0)


async def _await_end(sock: zmq.asyncio.Socket, endpoint: str, timeout: float, t0: float) -> Reach:
    while (left := timeout - (time.perf_counter() - t0)) > 0:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), left)
        except TimeoutError:
            break
        if END_SEQ in frames:
            ms = (time.perf_counter() - t0) * 1000
            return Reach(endpoint, True, ms, f"replay answered in {ms:.0f} ms")
    return Reach(endpoint, False, timeout * 1000, f"replay request unanswered in {timeout:g} s")


@dataclass
class Observation:
    """What a tap saw: counts, topics, block sizes, and every stored block's token ids."""

    batches: int = 0
    stored_events: int = 0
    malformed: int = 0
    topics: set[str] = field(default_factory=set)
    block_sizes: set[int] = field(default_factory=set)
    blocks: set[tuple[int, ...]] = field(default_factory=set)

    @classmethod
    def union(cls, seen: Iterable[Observation]) -> Observation:
        """What several taps (one per data-parallel rank) saw, together."""
        out = cls()
        for o in seen:
            out.batches += o.batches
            out.stored_events += o.stored_events
            out.malformed += o.malformed
            out.topics |= o.topics
            out.block_sizes |= o.block_sizes
            out.blocks |= o.blocks
        return out

    def record(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            return
        self.batches += 1
        self.topics.add(frames[0].decode(errors="replace"))
        try:
            batch, _ = decode_wire(frames[2])
        except MalformedPayload:
            self.malformed += 1
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)

    def _stored(self, event: BlockStored) -> None:
        self.stored_events += 1
        bs = event.block_size
        if bs <= 0:
            return
        self.block_sizes.add(bs)
        ids = event.token_ids
        for i in range(0, len(ids) - bs + 1, bs):
            self.blocks.add(tuple(ids[i : i + bs]))

    def coverage(self, tokens: list[int]) -> tuple[int, int]:
        """(probe blocks seen, probe blocks expected): the prompt's full blocks at the
        block size the events use."""
        found = []
        for bs in self.block_sizes:
            full = [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]
            found.append((sum(1 for b in full if b in self.blocks), len(full)))
        return max(found, key=lambda f: (f[0] / f[1] if f[1] else 0.0, f[0]), default=(0, 0))


class EventTap:
    """A SUB socket on one publisher, subscribed to every topic."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.seen = Observation()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")

    async def connect(self, timeout: float) -> Reach:
        return await _await_handshake(self._sock, self.endpoint, timeout)

    async def until(self, done: Callable[[Observation], bool], timeout: float) -> bool:
        """Record batches until `done(observation)` or the timeout."""
        deadline = time.perf_counter() + timeout
        while not done(self.seen):
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                self.seen.record(await asyncio.wait_for(self._sock.recv_multipart(), left))
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
