"""ZMQ transport for KV event streams: one task per worker endpoint.

Transport never parses: it yields (topic, seq, payload) and asks the worker's `WorkerIngest`
what to do. ZMQ reconnects on its own with exponential backoff (RECONNECT_IVL..._MAX); a
socket monitor tells us when a (re)connection happened so the first batch after it is treated
as a possible gap (slow joiner). A worker's slow or dead endpoint never blocks another's task.

The task is supervised: `EventSubscriber.run` restarts its receive loop, with backoff, if it
ever fails, and `SubscriberStatus` says so (`restarts`, `last_error`, `running`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.ingest import ReplayRequest, WorkerIngest

log = logging.getLogger("kvroute.subscriber")

END_SEQ = b"\xff" * 8
RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 5000
# ZMTP pings on the subscription: a subscriber sends nothing of its own, so a connection
# left half-open (the engine's node lost power, a NAT or proxy dropped it silently) would
# never be noticed nor dialled again; unanswered for ZMQ_PING_TIMEOUT_MS, it is dropped and
# reconnected (the replay fills what it missed). libzmq answers pings on its I/O thread, so
# an engine busy in a long step still answers.
ZMQ_PING_IVL_MS = 1000
ZMQ_PING_TIMEOUT_MS = 5000
RESTART_BACKOFF_S = (0.1, 30.0)  # first and longest wait before restarting a failed loop
STABLE_S = 60.0  # a loop that ran this long before failing restarts at the first wait again
REPLAY_PART = 256  # replayed batches applied between turns of the event loop (~40 ms)


@dataclass
class SubscriberStatus:
    """What `/health` shows of one worker's event subscription.

    connected       a ZMQ connection to the publisher is up and the loop is running
    connects        connections made (the first one included)
    bad_frames      messages that were not (topic, 8-byte seq, payload)
    last_message_at time.monotonic() of the last message received
    running         the receive loop is running (False before start, and while a failed
                    loop waits for its restart)
    restarts        times the receive loop failed (each one is restarted after a backoff)
    last_error      the exception that last ended the loop ("TypeError: ..."); kept after
                    the restart so an operator can see what happened
    last_error_at   time.monotonic() of that failure
    """

    endpoint: str
    replay_endpoint: str | None
    connected: bool = False
    connects: int = 0
    bad_frames: int = 0
    last_message_at: float | None = None
    running: bool = False
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)


def parse_replay_reply(reply: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply as the DEALER gets it, in either shape vLLM sent:
    `[b"", topic, seq, payload]` (0.32 on, like a live message) or `[b"", seq, payload]`
    (before vllm-project/vllm#45177 put the topic in); the end marker's seq is -1. None:
    neither shape. A bad sequence frame raises ValueError."""
    if len(reply) == 4:
        return parse_seq(reply[2]), reply[3]
    if len(reply) == 3:
        return parse_seq(reply[1]), reply[2]
    return None


class ReplayClient:
    """DEALER side of vLLM's replay protocol: [b"", start] -> one reply per buffered batch
    from `start` (`parse_replay_reply`), then an end marker whose seq is -1.

    vLLM sends a whole replay in one loop on a ROUTER socket, whose queue to a peer holds
    1,000 messages and drops the rest without a word; its buffer holds 10,000 batches. Read
    one message at a time by an event loop, a replay of more than ~2,000 batches came back
    with holes and often without its end marker (measured: 5,465 of 10,000 batches, 4 holes;
    or 8,000 and no end, all discarded). So the socket's own queue is unbounded (libzmq's I/O
    thread drains the connection whatever the loop does), and a replay that still comes back
    short, where the engine's sending outran the network, is asked again from its first
    missing batch (`ROUNDS` times in all) instead of losing everything after it."""

    ROUNDS = 4

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float = 2.0) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock: zmq.asyncio.Socket | None = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: the publisher drops what overflows
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    async def fetch(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from `start_seq` the engine returned, in order; None if it
        answered nothing. Batches before the first one returned are out of its buffer; a
        hole after it, or a reply cut short, is asked for again."""
        got: dict[int, bytes] = {}
        floor = start_seq  # batches below it are out of the engine's buffer
        start: int | None = start_seq
        ended = False
        for _ in range(self.ROUNDS):
            if start is None:
                break
            frames, ended = await self._fetch_once(start)
            if frames and frames[0][0] > start:
                floor = max(floor, frames[0][0])  # the buffer starts there now
            got.update(frames)
            if not frames and not ended:
                break  # the engine does not answer: asking again waits as long again
            start = _first_missing(got, floor, ended)
        if not got:
            return [] if ended else None
        return sorted(got.items())

    async def _fetch_once(self, start_seq: int) -> tuple[list[tuple[int, bytes]], bool]:
        """One request: the batches returned, and whether the end marker came."""
        sock = self._socket()
        try:
            await sock.send_multipart([b"", seq_bytes(start_seq)])
            frames: list[tuple[int, bytes]] = []
            while True:
                try:
                    # not wait_for: on Python 3.11 it swallows a cancellation that comes as
                    # the reply does, and the subscriber's stop then waited forever
                    async with asyncio.timeout(self.timeout_s):
                        reply = await sock.recv_multipart()
                except TimeoutError:
                    self.close()  # late replies must not leak into the next request
                    return frames, False
                parsed = parse_replay_reply(reply)
                if parsed is None:
                    log.warning(
                        "replay %s: reply with %d frames ignored", self.endpoint, len(reply)
                    )
                    continue
                if parsed[0] == -1:
                    return frames, True
                frames.append(parsed)
        except BaseException:
            # a bad frame or a cancellation leaves the rest of this reply queued on the
            # socket, and every later fetch would read the reply before its own
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _first_missing(got: dict[int, bytes], floor: int, ended: bool) -> int | None:
    """The first batch from `floor` a replay still lacks: a hole between batches it
    returned, or, when its end marker never came, the one after the last. None: whole."""
    held = sorted(s for s in got if s >= floor)
    if not held:
        return None if ended else floor
    for want, seq in enumerate(held, start=held[0]):
        if seq != want:
            return want
    return None if ended else held[-1] + 1


class EventSubscriber:
    """Subscribes to one worker's KV events and feeds its ingest, in order."""

    def __init__(
        self,
        ingest: WorkerIngest,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        on_batch: Callable[[], None] | None = None,
        restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S,
    ) -> None:
        self.ingest = ingest
        self.topic = topic
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.status = SubscriberStatus(endpoint, replay_endpoint)
        self._replay = (
            ReplayClient(self._ctx, replay_endpoint, replay_timeout_s) if replay_endpoint else None
        )
        ingest.has_replay = self._replay is not None
        self._on_batch = on_batch
        self._backoff = restart_backoff_s
        # live batches and the replay fetched on connect reach the ingest one at a time
        self._serial = asyncio.Lock()

    async def run(self) -> None:
        """Runs until cancelled (or until its ZMQ context is terminated). A failure of the
        receive loop, whatever its cause, is logged and counted, and the loop restarts
        after a backoff that doubles while failures keep coming."""
        wait = self._backoff[0]
        while True:
            started = time.monotonic()
            try:
                await self._run_once()
            except zmq.ContextTerminated:
                return
            except Exception as exc:
                self._failed(exc)
            if time.monotonic() - started >= STABLE_S:
                wait = self._backoff[0]
            await asyncio.sleep(wait)
            wait = min(wait * 2, self._backoff[1])

    def _failed(self, exc: Exception) -> None:
        self.status.restarts += 1
        self.status.last_error = f"{type(exc).__name__}: {exc}"[:500]
        self.status.last_error_at = time.monotonic()
        log.error(
            "worker %s: KV event subscriber for %s failed; restarting it (failure %d)",
            self.ingest.worker,
            self.status.endpoint,
            self.status.restarts,
            exc_info=exc,
        )

    async def _run_once(self) -> None:
        """One subscription: receive until something fails (or the task is cancelled)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_PING_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_PING_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        tasks = [asyncio.create_task(self._watch(monitor)), asyncio.create_task(self._receive(sub))]
        try:
            sub.connect(self.status.endpoint)
            self.ingest.resubscribed()
            self.status.running = True
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises what ended it
            raise RuntimeError("KV event loop ended without an error")
        finally:
            self.status.running = self.status.connected = False
            await _cancel(tasks)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if self._replay is not None:
                self._replay.close()

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            await self._handle(frames)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self.status.connected = True
                self.status.connects += 1
                async with self._serial:
                    self.ingest.reconnected()
                    request = self.ingest.on_connected()
                    if request is not None:
                        frames = await self._in_parts(await self._fetch(request))
                        self.ingest.finish_connect_replay(frames)
                if request is not None and self._on_batch is not None:
                    self._on_batch()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.status.connected = False
                log.warning(
                    "worker %s: KV event stream %s disconnected; ZMQ will reconnect",
                    self.ingest.worker,
                    self.status.endpoint,
                )

    async def _handle(self, frames: list[bytes]) -> None:
        self.status.last_message_at = time.monotonic()
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
            seq = parse_seq(frames[1])
        except ValueError as exc:
            self.status.bad_frames += 1
            self.ingest.malformed_frame(str(exc))
            return
        async with self._serial:  # a replay on connect applies its batches first
            request = self.ingest.on_live(seq, frames[2])
            if request is not None:
                self.ingest.finish_replay(await self._in_parts(await self._fetch(request)))
        if self._on_batch is not None:
            self._on_batch()

    async def _in_parts(
        self, frames: list[tuple[int, bytes]] | None
    ) -> list[tuple[int, bytes]] | None:
        """Apply all but the last part of a long replay, giving the event loop back between
        parts; the last part is left for the ingest's `finish_*` (which then applies the
        live batches held meanwhile). Applied at once, 10,000 batches of 64 blocks held
        every request and /health up for 1.5 s (the lock keeps live batches out)."""
        if frames is None or len(frames) <= REPLAY_PART:
            return frames
        last = len(frames) - REPLAY_PART
        for at in range(0, last, REPLAY_PART):
            self.ingest.apply_replayed(frames[at : min(at + REPLAY_PART, last)])
            await asyncio.sleep(0)
        return frames[last:]

    async def _fetch(self, request: ReplayRequest) -> list[tuple[int, bytes]] | None:
        assert self._replay is not None  # the ingest asks only when it has one
        try:
            return await self._replay.fetch(request.start_seq)
        except (zmq.ZMQError, ValueError) as exc:
            log.warning(
                "worker %s: replay from %d failed: %s", request.worker, request.start_seq, exc
            )
            return None


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    # What ended them was already raised; a cancellation of our own still propagates.
    await asyncio.gather(*tasks, return_exceptions=True)
