"""Real ZMQ on loopback: the simulator's publisher (with its replay socket) on one side, the
router's subscriber and ingest on the other. Lost batches, a late subscriber and an engine
restart must all end with the index equal to what the publisher's engine really holds; junk
on the socket and a failure inside the subscriber's loop must not stop the stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq
import zmq.asyncio
from replay_shapes import TopiclessReplay

from engines.sim.events_pub import EventPublisher, PublisherConfig
from engines.vllm import events as wire
from engines.vllm.events import decode_batch
from engines.vllm.fuzz import hostile_payloads
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import ReplayRequest, WorkerIngest
from indexer.subscriber import END_SEQ, EventSubscriber, ReplayClient, seq_bytes

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


class RawPublisher(LossyPublisher):
    """Also sends messages of its own making, with sequence numbers of its own choosing."""

    async def send_raw(self, *frames: bytes) -> None:
        assert self._pub is not None
        await self._pub.send_multipart(list(frames))


class TopiclessReplayPublisher(TopiclessReplay, RawPublisher):
    """RawPublisher answering replays in the older 3-frame shape (tests/replay_shapes.py)."""


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


PROBE = [b"kvroute-test-probe"]  # one frame: no publisher's message looks like it


class ProbedSubscriber(EventSubscriber):
    """The router's subscriber, but the test's probes stop here, counted: they are no part
    of the stream (its ingest and counters never see them)."""

    probes = 0

    async def _handle(self, frames: list[bytes]) -> None:
        if frames == PROBE:
            self.probes += 1
            return
        await super()._handle(frames)


async def heard(pub: RawPublisher, sub: ProbedSubscriber) -> None:
    """Returns once `pub` delivers to `sub`. A PUB socket drops what it sends before the
    subscription has reached it (ZMQ's slow joiner), and nothing on either side says when
    that is: the TCP connection and even the handshake come before the subscription. So
    probe until one arrives; the ones after it arrive too, in order, before what the test
    sends next."""
    before = sub.probes
    deadline = time.monotonic() + 10
    while sub.probes == before:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        await pub.send_raw(*PROBE)
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def subscribed(
    pub: RawPublisher, replay: bool = True
) -> AsyncIterator[tuple[PrefixIndex, WorkerIngest, ProbedSubscriber]]:
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, decode_batch, FakeClock())
    assert pub.endpoint is not None
    sub = ProbedSubscriber(
        ingest,
        pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
        restart_backoff_s=(0.05, 0.2),
    )
    task = asyncio.create_task(sub.run())
    try:
        await wait_until(lambda: sub.status.connected)
        await heard(pub, sub)
        yield index, ingest, sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def started(
    drop: set[int],
    endpoint: str = "tcp://127.0.0.1:0",
    replay: str | None = "tcp://127.0.0.1:0",
    kind: type[RawPublisher] = RawPublisher,
) -> RawPublisher:
    pub = kind(PublisherConfig(endpoint=endpoint, replay_endpoint=replay), drop)
    await pub.start()
    return pub


REPLAY_SHAPES = [
    pytest.param(RawPublisher, id="4-frame-replies-vllm-0.32"),
    pytest.param(TopiclessReplayPublisher, id="3-frame-replies-older-vllm"),
]


@pytest.mark.parametrize("kind", REPLAY_SHAPES)
async def test_lost_batches_and_late_join_recover_through_replay(
    kind: type[RawPublisher],
) -> None:
    pub = await started(drop={4, 5}, kind=kind)
    engine = Engine(pub)
    try:
        for chain in (1, 2):  # published before anyone listens: the slow joiner's loss
            await engine.store(chain)
        async with subscribed(pub) as (index, ingest, _):
            # the connection fetches the replay buffer at once, before any live batch: a
            # router started beside a warm engine knows its cache without waiting for one
            await wait_until(lambda: ingest.tracker.last_applied == 1)
            assert index_view(index, range(1, 3)) == truth(engine)
            await engine.store(3)  # seq 2: live, in order
            await wait_until(lambda: ingest.tracker.last_applied == 2)
            assert (ingest.counters.gaps, ingest.counters.catchups) == (0, 0)
            await engine.store(4)  # seq 3
            await engine.store(5)  # seq 4: dropped live
            await engine.evict(1)  # seq 5: dropped live
            await engine.store(6)  # seq 6: gap 4..5 -> replay
            await wait_until(lambda: ingest.tracker.last_applied == 6)
            assert index_view(index, range(1, 8)) == truth(engine)
            c = ingest.counters
            assert c.gaps == 1 and c.replays == 2 and c.resyncs == 0 and c.restarts == 0
    finally:
        await pub.stop()


@contextlib.asynccontextmanager
async def replay_server(
    serve: Callable[[zmq.asyncio.Socket], Awaitable[None]], timeout_s: float
) -> AsyncIterator[ReplayClient]:
    """A replay ROUTER on loopback answering as `serve` does, and a client of it."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    server = asyncio.create_task(serve(router))
    client = ReplayClient(ctx, router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=timeout_s)
    try:
        yield client
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        client.close()
        ctx.destroy(linger=0)


async def test_a_replay_of_the_engines_whole_buffer_comes_back_whole() -> None:
    """vLLM buffers 10,000 batches and sends a replay in one loop on a ROUTER socket, which
    drops what its 1,000-message queue cannot hold; the simulator's publisher does the same.
    A router (re)started beside a busy engine must still index every buffered batch, without
    holding its event loop for the whole replay."""
    n = 10_000
    pub = await started(drop=set())
    engine = Engine(pub)
    try:
        for chain in range(n):  # published before anyone listens; a busy engine's batches
            await engine.store(chain, n_blocks=64)
        seen: set[int | None] = set()
        running = True

        async def tick() -> None:  # what other tasks see while the replay is applied
            while running:
                seen.add(ingest.tracker.last_applied if ingest is not None else None)
                await asyncio.sleep(0)

        ingest: WorkerIngest | None = None
        ticker = asyncio.create_task(tick())
        try:
            async with subscribed(pub) as (index, ingest, _):
                await wait_until(lambda: ingest.tracker.last_applied == n - 1, timeout=20)
                assert index.entries_of("w") == sum(truth(engine).values()) == n * 64
                c = ingest.counters
                assert (c.resyncs, c.replay_failures, c.gaps) == (0, 0, 0), c
        finally:
            running = False
            await ticker
        assert len({s for s in seen if s is not None and 0 < s < n - 1}) >= 10, sorted(
            s for s in seen if s is not None
        )[:20]
    finally:
        await pub.stop()


async def test_a_replay_cut_short_is_asked_again_from_its_first_missing_batch() -> None:
    """Where the engine's sending outruns the network, its ROUTER drops batches from the
    middle of a reply, and the end marker with them: the client asks again from the first
    one missing, and keeps what it already has."""
    asked: list[int] = []

    async def serve(router: zmq.asyncio.Socket) -> None:
        while True:
            ident, _, start_b = await router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            asked.append(start)
            lossy = len(asked) == 1
            for seq in range(max(start, 5), 40):  # the buffer holds 5..39
                if lossy and (12 <= seq < 20 or seq >= 30):
                    continue  # dropped on the way, the end marker too
                await router.send_multipart([ident, b"", b"t", seq_bytes(seq), b"%d" % seq])
            if not lossy:
                await router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async with replay_server(serve, timeout_s=0.3) as client:
        got = await client.fetch(0)
        assert got == [(seq, b"%d" % seq) for seq in range(5, 40)]
        assert asked == [0, 12]  # 0..4 are out of the buffer: not asked for again


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
        await heard(pub, sub)  # the new engine's batches arrive live, none lost
        await engine.store(4)  # seq 0 again, cache empty
        await engine.store(5)
        await wait_until(lambda: ingest.counters.restarts == 1 and ingest.tracker.last_applied == 1)
        assert index_view(index, range(1, 6)) == truth(engine) == {4: 3, 5: 3}
    await pub.stop()


async def test_junk_frames_do_not_stop_the_subscriber() -> None:
    """Defect 1 end to end: junk used to end the subscriber's task (nothing logged, every
    later batch ignored)."""
    pub = await started(drop=set(), replay=None)
    engine = Engine(pub)
    junk = dict((n, p) for n, p, _ in hostile_payloads())
    names = ["type-is-a-list", "type-is-a-dict", "deep-array", "extra-keys-short-mm"]
    try:
        async with subscribed(pub, replay=False) as (index, ingest, sub):
            for seq, name in enumerate(names):
                await pub.send_raw(b"", seq_bytes(seq), junk[name])
            await pub.send_raw(b"", b"two frames")
            await pub.send_raw(b"", b"\x01", b"a 1-byte seq")
            pub.seq = len(names)
            await engine.store(1)
            await engine.store(2)
            await wait_until(lambda: index_view(index, range(1, 3)) == truth(engine))
            c = ingest.counters
            assert c.malformed_by_reason == {
                "bad_type": 2,
                "too_deep": 1,
                "bad_extra_keys": 1,
                "frame": 2,
            }
            assert c.malformed == 6 and c.gaps == 0 and c.resyncs == 0
            assert sub.status.restarts == 0 and sub.status.connected
    finally:
        await pub.stop()


async def test_a_failure_inside_the_loop_restarts_the_subscriber() -> None:
    pub = await started(drop=set(), replay=None)
    engine = Engine(pub)
    try:
        async with subscribed(pub, replay=False) as (index, ingest, sub):
            real_on_live = ingest.on_live

            def fails_once(seq: int, payload: bytes) -> ReplayRequest | None:
                ingest.on_live = real_on_live  # type: ignore[method-assign]
                raise RuntimeError("boom")

            ingest.on_live = fails_once  # type: ignore[method-assign]
            await engine.store(1)
            await wait_until(lambda: sub.status.restarts == 1)
            assert sub.status.last_error == "RuntimeError: boom"
            for chain in range(2, 100):  # the new subscription misses the first few
                await engine.store(chain)
                await asyncio.sleep(0.05)
                if chain in index_view(index, range(chain, chain + 1)):
                    break
            assert index_view(index, range(chain, chain + 1)) == {chain: 3}
            assert 1 not in index_view(index, range(1, 2))  # it hit the failure
            assert sub.status.restarts == 1 and sub.status.running and sub.status.connected
    finally:
        await pub.stop()


async def test_a_bad_frame_in_a_replay_reply_does_not_shift_the_next_replies() -> None:
    """The rest of a reply a bad frame broke off must not be read as the next reply."""

    async def serve(router: zmq.asyncio.Socket) -> None:
        first = True
        while True:
            ident, _, start_b = await router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            frames = [[b"t", seq_bytes(start), b"a"]]
            if first:  # a 2-byte sequence number in the middle of the reply
                frames += [[b"t", b"\x00\x01", b"junk"], [b"t", seq_bytes(start + 1), b"b"]]
                first = False
            for f in [*frames, [b"t", END_SEQ, b""]]:
                await router.send_multipart([ident, b"", *f])

    async with replay_server(serve, timeout_s=2.0) as client:
        with pytest.raises(ValueError):
            await client.fetch(10)
        await asyncio.sleep(0.1)  # the broken reply's tail has arrived by now
        assert await client.fetch(50) == [(50, b"a")]
        assert await client.fetch(90) == [(90, b"a")]


@pytest.mark.parametrize(
    ("shape", "topic"),
    [
        pytest.param(4, b"kv-events", id="4-frame-vllm-0.32"),
        pytest.param(4, b"", id="4-frame-empty-topic"),
        pytest.param(3, None, id="3-frame-older-vllm"),
    ],
)
async def test_replay_client_reads_both_reply_shapes(shape: int, topic: bytes | None) -> None:
    """What each vLLM sent, byte for byte, over a real ROUTER socket: each batch's sequence
    number and payload come back, and the end marker ends the reply."""
    batches = [(7, b"\x93\xcb payload seven"), (8, b""), (9, b"nine")]
    head = [] if topic is None else [topic]
    end = [b""] if shape == 4 else []  # vLLM 0.32's end marker carries an empty topic

    async def serve(router: zmq.asyncio.Socket) -> None:
        ident, _, start_b = await router.recv_multipart()
        start = int.from_bytes(start_b, "big")
        for seq, payload in batches:
            if seq >= start:
                await router.send_multipart([ident, b"", *head, seq_bytes(seq), payload])
        await router.send_multipart([ident, b"", *end, END_SEQ, b""])

    async with replay_server(serve, timeout_s=2.0) as client:
        assert await client.fetch(8) == batches[1:]


async def test_a_replay_cancelled_as_its_reply_arrives_is_cancelled() -> None:
    """A subscriber stopped (a worker removed, the router shutting down) while a replay
    reply arrives: the fetch must end cancelled. asyncio.wait_for on Python 3.11 returned
    the reply instead, the fetch waited on for the next one, and the stop never ended."""
    loop = asyncio.get_running_loop()
    replies: list[asyncio.Future[list[bytes]]] = []

    class Socket:  # the replay socket, its replies handed out by the test
        async def send_multipart(self, frames: list[bytes]) -> None:
            pass

        def recv_multipart(self) -> asyncio.Future[list[bytes]]:
            replies.append(loop.create_future())
            return replies[-1]

        def close(self, linger: int = 0) -> None:
            pass

    client = ReplayClient(zmq.asyncio.Context.instance(), "tcp://127.0.0.1:1", timeout_s=30)
    client._sock = Socket()  # type: ignore[assignment]
    fetch = asyncio.create_task(client.fetch(0))
    while not replies:
        await asyncio.sleep(0)
    replies[0].set_result([b"", seq_bytes(0), b"a batch"])
    fetch.cancel()  # in the same turn of the loop as the reply
    done, _ = await asyncio.wait({fetch}, timeout=2)
    assert fetch in done and fetch.cancelled(), replies


class FreezingProxy:
    """TCP relay to `port`; `freeze()` stops relaying on the connections it has, leaving
    them open (a host that lost power, a NAT that forgot them); new ones relay."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.frozen: list[dict[str, bool]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        br, bw = await asyncio.open_connection("127.0.0.1", self.port)
        state = {"frozen": False}
        self.frozen.append(state)
        self.writers += [cw, bw]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    if state["frozen"]:
                        continue  # swallowed: nothing goes through, nothing is closed
                    w.write(data)
                    await w.drain()

        await asyncio.gather(pipe(cr, bw), pipe(br, cw))

    def freeze(self) -> None:
        for state in self.frozen:
            state["frozen"] = True

    async def stop(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()


async def test_a_half_open_subscription_is_dropped_and_dialled_again() -> None:
    """A subscriber sends nothing of its own, so without pings a connection left half-open
    was never noticed: the worker's events stopped for good, the index went stale."""
    pub = await started(drop=set())
    engine = Engine(pub)
    assert pub.endpoint is not None
    proxy = FreezingProxy(int(pub.endpoint.rpartition(":")[2]))
    via = await proxy.start()
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, decode_batch, FakeClock(), has_replay=True)
    sub = ProbedSubscriber(ingest, via, replay_endpoint=pub.replay_endpoint)
    task = asyncio.create_task(sub.run())
    try:
        await wait_until(lambda: sub.status.connected)
        await heard(pub, sub)
        await engine.store(1)
        await wait_until(lambda: index_view(index, range(1, 3)) == {1: 3})
        proxy.freeze()
        await engine.store(2)
        await wait_until(lambda: index_view(index, range(1, 3)) == truth(engine), timeout=20)
        assert sub.status.connects >= 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.stop()
        await pub.stop()
