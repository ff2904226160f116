"""KV-event publisher, byte-compatible with vLLM 0.32's `ZmqEventPublisher`.

- PUB: one message per engine step that had events: `[topic, seq (8 bytes big-endian,
  from 0), payload]`, payload = msgpack `[ts, [events...], dp_rank]` (`encode_batch`).
- ROUTER replay: a DEALER sends `[b"", start_seq]`; the answer is one
  `[b"", topic, seq, payload]` per buffered batch with `seq >= start_seq` (the last
  `buffer_steps`, byte-identical to what was published), then `[b"", b"", -1, b""]`.

Sockets bind loopback only; an endpoint ending in `:*` or `:0` takes a free port and
`endpoint`/`replay_endpoint` then name the one bound. Start and stop belong to the owner's
lifespan; sockets close with linger 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from engines.vllm.events import WireEvent, encode_batch

log = logging.getLogger("kvroute.sim.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000


class EndpointError(ValueError):
    """An events endpoint the simulator will not bind (not tcp on loopback, busy port)."""


def loopback_endpoint(endpoint: str) -> str:
    """Validate an endpoint and turn a port of 0 into zmq's wildcard port."""
    if not endpoint.startswith("tcp://"):
        raise EndpointError(f"{endpoint!r}: the simulator binds tcp://127.0.0.1:PORT only")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host not in ("127.0.0.1", "localhost") or not (port == "*" or port.isdigit()):
        raise EndpointError(f"{endpoint!r}: use tcp://127.0.0.1:PORT (or :0 for a free port)")
    return f"tcp://127.0.0.1:{'*' if port in ('0', '*') else port}"


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str = "tcp://127.0.0.1:*"
    replay_endpoint: str | None = "tcp://127.0.0.1:*"
    topic: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    dp_rank: int = 0


class EventPublisher:
    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.seq = 0
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> None:
        """Bind both sockets (idempotent), so that a busy port fails before serving."""
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self.config.hwm)
            self.endpoint = self._bind(self._pub, self.config.endpoint)
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._bind(self._replay, self.config.replay_endpoint)
        except BaseException:
            self._close()
            raise

    async def start(self) -> None:
        """Bind if needed and start answering replay requests (owned by a lifespan)."""
        self.bind()
        if self._replay is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay(), name="sim-replay")

    @staticmethod
    def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(loopback_endpoint(endpoint))
        except zmq.ZMQError as exc:
            raise EndpointError(f"cannot bind {endpoint}: {exc}") from None
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def publish(self, ts: float, events: list[WireEvent]) -> None:
        """Publish one step's batch; the sequence number counts batches from 0."""
        payload = encode_batch(ts, events, self.config.dp_rank)
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def buffered(self, start_seq: int = 0) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self._buffer if s >= start_seq]

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffered(start_seq):
                await sock.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))
