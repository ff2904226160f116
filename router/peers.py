"""Placements and in-flight load shared between router replicas, before the engines tell.

Two replicas behind one load balancer each see every worker's KV events, but a new prefix
that reaches both within a prefill (~100 ms for 2k tokens) is placed by each on its own
view: measured on vllm-prefix-repetition, the second replica split groups that the first had
homed, and two replicas cached 0.658 of the tokens where one cached 0.749. So each replica
publishes every request it sends (the endpoint and the prompt's block hashes) on a ZMQ PUB
socket (`peer_publish`), and subscribes to the other replicas' (`peers`): what a peer sent
becomes a short-lived prediction here, exactly as if this replica had sent it (approximate
entries for an endpoint without events), until the engine's own events arrive.

Each replica also publishes its own in-flight load on a worker (requests, uncached prompt
tokens before the first token, decode blocks) whenever it changes, coalesced over
`LOAD_FLUSH_S`, and all of it every `HEARTBEAT_S`: a replica counts its peers' requests as
if they were its own, so two replicas do not both send a burst to the worker that looks
idle to each (a worker's scraped /metrics are up to a second old). The latest word of a
replica replaces its last one, so a lost message heals at the next; a replica silent for
`SILENT_S` no longer counts. The publishing socket is an XPUB: it sees each peer subscribe
and greets it with this replica's load, so a starting replica hears its peers within a
connection's time, and answers /ready once it has (`linked`, at most `LINK_WAIT_S`).

A replica of several processes (`kvroute serve --processes N`) links its processes the same
way over unix sockets; its first process also binds the replica's `peer_publish` and relays
there what its siblings publish (`relay_publish`, `relay_from`), and every process subscribes
to the other replicas: another replica sees each process as one peer.

On Kubernetes the replicas find each other through a headless Service of the router pods
(`peers_dns: HOST:PORT`), re-resolved every `dns_interval_s`; a replica skips its own address
(`POD_IP` from the downward API, else what its hostname resolves to).

Wire: a placements message is b"placements", then two frames per placement: the endpoint
name (UTF-8; replicas configured alike name endpoints alike) and the hashes as little-endian
uint64 (the placements of one turn of the event loop go as one message; the two frames of a
single placement alone, as replicas sent before, are read too). A load message is b"load",
the sending replica's random id, then two frames per endpoint: its name and four
little-endian int64 (requests, prefill tokens, decode blocks, and of those requests the
ones riding a prefill still in progress there; a report of the first three alone, as
replicas sent before, reads as none riding). A placement or report naming
an endpoint this replica does not know is counted and dropped (its worker list differs: the
fix is to give every replica the same workers), and so is a malformed message; nothing a
peer sends can stop the receive loop. PUB drops when a peer is slow (high-water mark):
placements are hints.

A request that a gateway's fallback served elsewhere than on the endpoint it was placed on
(`DecisionService.reassign`), that the engine refused (a 4xx), or whose handoff was sent
another way (`DecisionService.release`) is taken back from that endpoint on the peers too: a
withdrawals message is b"withdrawals", then (endpoint, hashes) frame pairs as a placements
message, each undoing the placement of that chain there (`TtlIndex.withdraw`). Without it a
peer kept believing the endpoint held the prompt: for 5 s as a prediction, for 120 s as an
approximate entry. A withdrawal leaves after the placements queued before it, so it never
overtakes the placement it undoes; one whose placement never arrived here, or expired,
takes nothing back (`unmatched_withdrawal`). Placements carry no sender, so a withdrawal is
matched by endpoint and chain: two peers' placements of one chain count as two, whoever
withdraws. A replica of an earlier release counts one
as `malformed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import zmq
import zmq.asyncio

from indexer.hashing import RouterBlockHash
from indexer.subscriber import ZMQ_PING_IVL_MS, ZMQ_PING_TIMEOUT_MS
from indexer.ttl import TtlIndex
from router.core.fleet import EVENTS, FleetState
from router.core.load import PeerLoad
from router.core.scoring import is_new_prefix

log = logging.getLogger("kvroute.peers")

HWM = 10_000  # placements queued per peer before PUB drops (a slow peer loses hints only)
LOG_EVERY_S = 60.0  # a kind of bad placement is logged at most this often
_BIG_ENDIAN = sys.byteorder == "big"
LOAD = b"load"
PLACEMENTS = b"placements"
WITHDRAWALS = b"withdrawals"
_LOAD = struct.Struct("<qqqq")
_LOAD_OLD = struct.Struct("<qqq")  # before riders were published: read from older replicas
HEARTBEAT_S = 1.0  # every worker's load republished this often (also: "this replica is alive")
LINK_WAIT_S = 2.0  # /ready waits at most this long after the start to hear every peer
SILENT_S = 3.5  # a replica not heard from this long: its load no longer counts
LOAD_FLUSH_S = 0.002  # load changes of this long are published as one report per endpoint
# peers' placements remembered for their withdrawals: endpoints x chains (~300 B each), and
# arrivals per chain (a withdrawal takes back one; a hot chain's older ones never will)
RECEIVED_MAX = 100_000
RECEIVED_PER_CHAIN = 16
DRAIN_MAX = 10_000  # messages one drain applies at most (a pick must not wait on a flood)
CATCH_UP_S = 0.02  # between picks, what the peers sent is applied this often


async def _own_addresses() -> set[str]:
    """This pod's addresses: POD_IP (the downward API), else its hostname's."""
    if os.environ.get("POD_IP"):
        return {os.environ["POD_IP"]}
    infos = await asyncio.get_running_loop().getaddrinfo(socket.gethostname(), None)
    return {str(info[4][0]) for info in infos}


def encode(
    placements: Iterable[tuple[str, Sequence[int]]], kind: bytes = PLACEMENTS
) -> list[bytes]:
    """One message of placements (or, `kind` WITHDRAWALS, of placements taken back):
    the kind, then (endpoint, hashes) frame pairs."""
    frames = [kind]
    for worker, hashes in placements:
        raw = array("Q", hashes)
        if _BIG_ENDIAN:
            raw.byteswap()
        frames += (worker.encode(), raw.tobytes())
    return frames


def decode(frames: Sequence[bytes]) -> list[tuple[str, array[int]]]:
    """The (endpoint, hashes) of a placements message, or of the two frames of one placement
    (what replicas sent before placements were batched: a rolling upgrade loses nothing),
    or of a withdrawals message; ValueError if the frames are none of these."""
    pairs = frames[1:] if frames and frames[0] in (PLACEMENTS, WITHDRAWALS) else frames
    if (frames is pairs and len(frames) != 2) or len(pairs) % 2 or not pairs:
        raise ValueError(
            f"placements are b'placements' + (endpoint, uint64 hashes) pairs, got {len(frames)}"
            " frames"
        )
    out = []
    for at in range(0, len(pairs), 2):
        if len(pairs[at + 1]) % 8:
            raise ValueError("a placement's hashes are uint64s")
        hashes = array("Q")
        hashes.frombytes(pairs[at + 1])
        if _BIG_ENDIAN:
            hashes.byteswap()
        if len(set(hashes)) != len(hashes):  # no chain does; the index's records assume it
            raise ValueError("a placement repeats a block hash")
        out.append((pairs[at].decode(), hashes))
    return out


def encode_load(replica: bytes, reports: Iterable[tuple[str, PeerLoad]]) -> list[bytes]:
    """One message of load reports: b"load", the replica id, then (endpoint, 4 x int64)."""
    frames = [LOAD, replica]
    for worker, load in reports:
        frames += (
            worker.encode(),
            _LOAD.pack(load.requests, load.prefill_tokens, load.decode_blocks, load.riders),
        )
    return frames


def decode_load(frames: Sequence[bytes]) -> tuple[str, list[tuple[str, PeerLoad]]]:
    """(replica id, [(endpoint, load)]) of a load message; ValueError if it is not one."""
    if len(frames) < 4 or len(frames) % 2 or frames[0] != LOAD:
        raise ValueError("a load report is b'load', replica, then (endpoint, 4 x int64) pairs")
    out = []
    for at in range(2, len(frames), 2):
        raw = frames[at + 1]
        if len(raw) == _LOAD.size:
            values = _LOAD.unpack(raw)
        elif len(raw) == _LOAD_OLD.size:
            values = (*_LOAD_OLD.unpack(raw), 0)
        else:
            raise ValueError("a load is 4 x int64 (or 3, from an older replica)")
        if min(values) < 0:
            raise ValueError(f"negative load {values}")
        out.append((frames[at].decode(), PeerLoad(*values)))
    return frames[1].hex(), out


class PlacementLink:
    """This replica's PUB socket and its SUB to the peers; started and stopped by the app."""

    def __init__(
        self,
        fleet: FleetState,
        publish: str | None,
        peers: Sequence[str],
        on_result: Callable[[str], None] | None = None,
        ctx: zmq.asyncio.Context | None = None,
        peers_dns: str | None = None,
        dns_interval_s: float = 5.0,
        on_peers: Callable[[int], None] | None = None,
        relay_publish: str | None = None,
        relay_from: Sequence[str] = (),
        wait_s: float = 0.0,
    ) -> None:
        self.wait_s = wait_s  # see placement_wait
        self.fleet = fleet
        self.relay_publish = relay_publish  # also publish here, with what relay_from sends
        self.relay_from = list(relay_from)
        self._relay_pub: zmq.asyncio.Socket | None = None
        self._relay_now: zmq.Socket[bytes] | None = None
        self._relay_sub: zmq.asyncio.Socket | None = None
        self._relay_sub_now: zmq.Socket[bytes] | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self.publish_endpoint = publish
        self.peers = list(peers)
        self.peers_dns = peers_dns
        self.dns_interval_s = dns_interval_s
        self._sub: zmq.asyncio.Socket | None = None
        self._connected: set[str] = set()
        self._dns_task: asyncio.Task[None] | None = None
        self._on_result = on_result or (lambda _: None)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.counts = {
            "applied": 0,
            "withdrawn": 0,
            "unmatched_withdrawal": 0,
            "load": 0,
            "unknown_worker": 0,
            "malformed": 0,
            "self": 0,
        }
        self._warned: dict[str, float] = {}  # result -> when it was last logged
        # (endpoint, chain's last hash) -> when peers' placements of it arrived, oldest
        # first: what a withdrawal may take back (`_withdraw`)
        # (least recently placed first; entries older than any TTL are pruned each tick)
        self._received: OrderedDict[tuple[str, int], deque[float]] = OrderedDict()
        self.replica = os.urandom(8)  # names this process's load reports (a restart: new id)
        self.heard: dict[str, float] = {}  # peer replica id -> when it last reported load
        # (replica, endpoint) -> when its load there was last reported: a replica that stops
        # reporting one endpoint (it no longer routes there) must stop counting there too
        self._reported: dict[tuple[str, str], float] = {}
        self._on_peers = on_peers or (lambda _: None)
        self._dirty: set[str] = set()  # endpoints whose local load changed since the flush
        self._tick_task: asyncio.Task[None] | None = None
        self._sub_now: zmq.Socket[bytes] | None = None
        self._pub_now: zmq.Socket[bytes] | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._outbox: list[tuple[str, Sequence[int]]] = []  # placements not yet sent
        self._started = time.monotonic()
        self._link_checked = False

    async def start(self) -> None:
        self._started = time.monotonic()
        if self.publish_endpoint:
            self._pub = self._pub_socket(self.publish_endpoint)
            # sends never wait (NOBLOCK): the plain socket skips asyncio's future per send
            self._pub_now = zmq.Socket.shadow(self._pub.underlying)
            self.fleet.load.on_change = self.changed
            log.info("publishing placements and load on %s", self.publish_endpoint)
        if self.relay_publish:
            self._relay_pub = self._pub_socket(self.relay_publish)
            self._relay_now = zmq.Socket.shadow(self._relay_pub.underlying)
            log.info("publishing this replica's placements and load on %s", self.relay_publish)
        if self.relay_from:
            self._relay_sub = self._sub_socket()
            for endpoint in self.relay_from:
                self._relay_sub.connect(endpoint)
            self._relay_sub_now = zmq.Socket.shadow(self._relay_sub.underlying)
            self._relay_task = asyncio.create_task(self._receive(self._relay_sub))
        if self.peers or self.peers_dns:
            self._sub = self._sub_socket()
            self._connect(set(self.peers))
            if self.peers_dns:
                await self.resolve()
                self._dns_task = asyncio.create_task(self._watch_dns())
            # read synchronously (drain): before each pick, and on a timer between them
            self._sub_now = zmq.Socket.shadow(self._sub.underlying)
        if self._sub_now is not None or self._pub_now is not None or self._relay_now is not None:
            self._task = asyncio.create_task(self._catch_up())
        self._tick_task = asyncio.create_task(self._tick())

    def _pub_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        # XPUB: a PUB drops what it sends before a subscriber's connection is up, so a
        # replica's first heartbeat was lost and two fresh replicas first heard each other
        # when requests moved their load, a second later, after each had placed the first
        # burst's new prefixes on its own. An XPUB reads each subscription as it arrives
        # and greets the subscriber with this replica's load (`_greet`)
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first
        pub.setsockopt(zmq.SNDHWM, HWM)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        return pub

    def _sub_socket(self) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # a dual-stack Service may answer AAAA too
        # a connection left half-open (a peer's node lost power) is dropped and dialled
        # again, as the KV event subscriptions do (`indexer.subscriber`)
        sub.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_PING_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_PING_TIMEOUT_MS)
        return sub

    async def stop(self) -> None:
        self.flush()
        if self.fleet.load.on_change == self.changed:
            self.fleet.load.on_change = None
        for task in (self._dns_task, self._task, self._tick_task, self._relay_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._dns_task = self._task = self._tick_task = self._relay_task = None
        for sock in (self._pub, self._sub, self._relay_pub, self._relay_sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = self._sub_now = self._pub_now = None
        self._relay_pub = self._relay_sub = self._relay_now = self._relay_sub_now = None
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _connect(self, wanted: set[str]) -> None:
        assert self._sub is not None
        for peer in sorted(wanted - self._connected):
            self._sub.connect(peer)
            log.info("receiving placements from %s", peer)
        for peer in sorted(self._connected - wanted):
            self._sub.disconnect(peer)
            log.info("no longer receiving placements from %s", peer)
        self._connected = set(wanted)

    async def resolve(self) -> None:
        """Subscribe to every replica behind `peers_dns` but this one (and the static
        peers); a failed lookup keeps the current ones."""
        assert self.peers_dns is not None
        host, _, port = self.peers_dns.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            mine = await _own_addresses()
        except (OSError, UnicodeError) as exc:
            log.error("peers_dns %s: %s (keeping the current peers)", self.peers_dns, exc)
            return
        ips = {str(info[4][0]) for info in infos} - mine
        found = {f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in ips}
        self._connect(found | set(self.peers))

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.dns_interval_s)
            await self.resolve()

    def sent(self, worker: str, hashes: Sequence[int], new: bool = False) -> None:
        """This replica sent a request to `worker`: tell the peers (never blocks), in one
        message with the others placed in this turn of the event loop (measured at 32
        connections between two processes: a send per request was ~7% of each's CPU).

        A `new` prefix (no worker held it) goes at once, with this replica's load: a turn
        of the loop in a burst runs every request that arrived with it (~1 ms each), so the
        coalesced message left up to ~10 ms after the pick, and a peer deciding meanwhile
        placed blind (traced on hot-prefix: the follower's first new prefixes, after its
        wait, saw none of the 6 the other replica had placed 1-8 ms before)."""
        if not hashes:
            return
        if new:
            self._outbox.append((worker, hashes))
            self.flush()
            self._flush_load()
            return
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.append((worker, hashes))

    def withdrawn(self, worker: str, hashes: Sequence[int]) -> None:
        """A request placed on `worker` was served elsewhere: tell the peers to take its
        placement back, now, after the placements still queued (the one it undoes may be
        among them: a peer must record it before it withdraws it)."""
        if not hashes:
            return
        self.flush()
        self._send(encode([(worker, hashes)], WITHDRAWALS))

    def placement_wait(self) -> float:
        """Seconds to wait before placing a new prefix: `wait_s` when a replica this one
        hears from has a lower id (it places at once; this one then sees its placement),
        else 0. Every follower waits the same, so a wait costs one `wait_s` at most."""
        if self.wait_s <= 0:
            return 0.0
        me = self.replica.hex()
        return self.wait_s if any(peer < me for peer in self.heard) else 0.0

    def flush(self) -> None:
        """Send the placements not yet sent, now."""
        outbox, self._outbox = self._outbox, []
        if outbox:
            self._send(encode(outbox))

    def _send(self, frames: list[bytes], relayed: bool = False) -> None:
        """To the peers (never blocks: a slow peer loses hints only); `relayed`: a
        sibling's message, passed on to the other replicas only."""
        for sock in (None if relayed else self._pub_now, self._relay_now):
            if sock is not None:
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def changed(self, worker: str) -> None:
        """This replica's load on `worker` changed: publish it within LOAD_FLUSH_S (the
        starts, first tokens and ends of a burst are one report per endpoint: measured, a
        report per change cost ~0.3 ms of CPU per request between two processes)."""
        if self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(LOAD_FLUSH_S, self._flush_load)
        self._dirty.add(worker)

    def _flush_load(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        self._flush_timer = None
        dirty, self._dirty = self._dirty, set()
        self._publish_load(dirty)

    def _publish_load(self, workers: Iterable[str]) -> None:
        if self._pub_now is None and self._relay_now is None:
            return
        local = self.fleet.load.local
        reports = [(worker, local(worker)) for worker in workers]
        if reports:
            self._send(encode_load(self.replica, reports))

    def expected(self) -> int:
        """Peers this replica subscribes to (a peer replica of several processes is heard
        as several)."""
        return len(self._connected) + len(self.relay_from)

    def heard_all(self) -> bool:
        return len(self.heard) >= self.expected()

    def linked(self, now: float | None = None) -> bool:
        """Heard every peer it subscribes to, or gave up waiting (LINK_WAIT_S after the
        start: a peer that is down must not keep this replica from serving)."""
        now = time.monotonic() if now is None else now
        return self.heard_all() or now - self._started >= LINK_WAIT_S

    async def _tick(self) -> None:
        while True:
            self._publish_load(list(self.fleet.workers))
            now = time.monotonic()
            self.expire(now)
            self.prune_received(now)
            self.check_linked(now)
            await asyncio.sleep(HEARTBEAT_S)

    def check_linked(self, now: float) -> None:
        """Once LINK_WAIT_S after the start: say so when some peer was not heard (this
        replica answers /ready anyway, and places new prefixes without that peer)."""
        if self._link_checked or now - self._started < LINK_WAIT_S:
            return
        self._link_checked = True
        if not self.heard_all():
            log.warning(
                "heard %d of the %d peers this replica subscribes to (%s) within %.0f s; "
                "serving anyway. A replica that is down, or a --peer address that does not "
                "reach another replica's --peer-publish, leaves new prefixes placed without "
                "it (kvroute_peer_replicas counts the peers heard)",
                len(self.heard),
                self.expected(),
                ", ".join(sorted(self._connected) + self.relay_from),
                LINK_WAIT_S,
            )

    def prune_received(self, now: float) -> None:
        """Forget peers' placements no index keeps any longer (the longest TTL): the least
        recently placed chains come first."""
        keep = max(self.fleet.predictions.ttl_s, self.fleet.approx.ttl_s)
        received = self._received
        while received:
            times = next(iter(received.values()))
            if times and now - times[-1] < keep:
                return
            received.popitem(last=False)

    def expire(self, now: float) -> None:
        """Stop counting the load of replicas silent for SILENT_S, and a replica's load on an
        endpoint it has not reported for as long (every replica reports every endpoint it
        routes to each heartbeat: one it removed, it reports no more)."""
        for replica, at in list(self.heard.items()):
            if now - at >= SILENT_S:
                del self.heard[replica]
                self.fleet.load.forget_peer(replica)
                log.warning(
                    "replica %s silent for %.1f s: its load no longer counts", replica, now - at
                )
        idle = PeerLoad(0, 0, 0, 0)
        for (replica, worker), at in list(self._reported.items()):
            if now - at >= SILENT_S:
                del self._reported[(replica, worker)]
                if replica in self.heard and worker in self.fleet.workers:
                    self.fleet.load.peer(replica, worker, idle)
        self._on_peers(len(self.heard))

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        """A relay wakes for whatever arrived (the other replicas wait on it)."""
        while True:
            await sub.poll()
            self.drain()

    async def _catch_up(self) -> None:
        """Every pick drains first (`drain`), so between picks the peers' messages are read
        on a timer, not woken for one by one: measured at concurrency 1 between two
        processes, waking per message cost the idle one ~0.3 ms of CPU per request. New
        subscribers are greeted on the same timer (`_greet`)."""
        while True:
            await asyncio.sleep(CATCH_UP_S)
            self._greet()
            self.drain()

    def drain(self) -> int:
        """Apply every message already delivered, now: called just before each pick. The
        receive task runs only between other tasks, and a burst of requests holds the event
        loop ~10 ms; measured on shared-system, two replicas placing one new prefix 8 ms
        apart chose two workers because the second had not yet read the first's placement."""
        n = 0
        for sock, relay in ((self._sub_now, False), (self._relay_sub_now, True)):
            # asking first: an empty socket's recv raises, and most picks find none waiting
            while sock is not None and n < DRAIN_MAX and _readable(sock):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.apply(frames)
                if relay:
                    self._send(frames, relayed=True)
                n += 1
        return n

    def _greet(self) -> None:
        """A peer subscribed to this replica: publish this replica's load now, so the peer
        hears it at once instead of at the next heartbeat."""
        joined = False
        for sock in (self._pub_now, self._relay_now):
            while sock is not None and _readable(sock):
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                joined = joined or frame[:1] == b"\x01"  # 0x01: subscribe, 0x00: unsubscribe
        if joined:
            self._publish_load(list(self.fleet.workers))

    def apply(self, frames: Sequence[bytes], now: float | None = None) -> list[str]:
        """Record one message from a peer: each placement becomes a prediction here, each
        load report replaces that replica's last on its endpoint; returns the results
        counted (a malformed message is one result)."""
        now = time.monotonic() if now is None else now
        if frames and frames[0] == LOAD:
            return self._apply_load(frames, now)
        try:
            placements = decode(frames)
        except (ValueError, UnicodeDecodeError) as exc:
            return [self._count("malformed", f"malformed placement from a peer dropped: {exc}")]
        if frames[0] == WITHDRAWALS:
            return [self._withdraw(worker, hashes, now) for worker, hashes in placements]
        return [self._place(worker, hashes, now) for worker, hashes in placements]

    def _place(self, worker: str, hashes: array[int], now: float) -> str:
        ttl = self._believed(worker, "placed a request on")
        if ttl is None:
            return "unknown_worker"
        if self._new_here(hashes, ttl):
            self.fleet.note_new_prefix(worker, len(hashes))
        ttl.record(worker, hashes)  # type: ignore[arg-type]
        if hashes:
            key = (worker, hashes[-1])
            times = self._received.get(key)
            if times is None:
                times = self._received[key] = deque(maxlen=RECEIVED_PER_CHAIN)
                if len(self._received) > RECEIVED_MAX:
                    self._received.popitem(last=False)
            else:
                self._received.move_to_end(key)
            times.append(now)
        return self._count("applied", None)

    def _withdraw(self, worker: str, hashes: array[int], now: float) -> str:
        """Take back a placement this replica recorded and still holds. One it never got
        (a message lost), or whose entries expired, must not take back this replica's own
        record of the same chain there: that is `unmatched_withdrawal`."""
        ttl = self._believed(worker, "withdrew a request from")
        if ttl is None:
            return "unknown_worker"
        key = (worker, hashes[-1] if hashes else -1)
        times = self._received.get(key)
        while times and now - times[0] >= ttl.ttl_s:
            times.popleft()
        if not times:
            self._received.pop(key, None)
            return self._count("unmatched_withdrawal", None)
        times.popleft()
        ttl.withdraw(worker, cast("Sequence[RouterBlockHash]", hashes))
        return self._count("withdrawn", None)

    def _believed(self, worker: str, did: str) -> TtlIndex | None:
        """Where what a peer says of `worker` goes: predictions, or approximate entries for
        an endpoint without events. None, counted and logged: an endpoint unknown here."""
        state = self.fleet.workers.get(worker)
        if state is None:
            self._count(
                "unknown_worker",
                f"a peer {did} {worker!r}, which this replica does not route to: give every "
                "replica the same workers",
            )
            return None
        return self.fleet.predictions if state.mode == EVENTS else self.fleet.approx

    def _new_here(self, hashes: array[int], ttl: TtlIndex) -> bool:
        """The peer placed a prefix this replica knows on no endpoint: it counts as a new
        prefix there, as the peer counted it (the placement scorer ranks by them). A
        sibling this replica placed itself a moment earlier is not counted twice."""
        chain = cast("Sequence[RouterBlockHash]", hashes)  # uint64 hashes, as the index takes
        found = [*self.fleet.index.find_matches(chain).values()]
        found += ttl.find_matches(chain).values()
        # in blocks on both sides: a block size of 1
        return is_new_prefix(len(hashes), ((o.blocks, 1) for o in found))

    def _apply_load(self, frames: Sequence[bytes], now: float) -> list[str]:
        try:
            replica, reports = decode_load(frames)
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            return [self._count("malformed", f"malformed load report from a peer dropped: {exc}")]
        if replica == self.replica.hex():
            return [
                self._count(
                    "self",
                    "a --peer address reaches this replica itself: its own load reports are "
                    "ignored (list only the other replicas' addresses)",
                )
            ]
        new = replica not in self.heard
        self.heard[replica] = now
        if new:
            log.info("replica %s reports its load; counted with this replica's", replica)
            self._on_peers(len(self.heard))
        out = []
        for worker, load in reports:
            if worker not in self.fleet.workers:
                out.append(
                    self._count(
                        "unknown_worker",
                        f"a peer reported load on {worker!r}, which this replica does not "
                        "route to: give every replica the same workers",
                    )
                )
                continue
            self.fleet.load.peer(replica, worker, load)
            self._reported[(replica, worker)] = now
            out.append(self._count("load", None))
        return out

    def _count(self, result: str, warning: str | None) -> str:
        self.counts[result] += 1
        self._on_result(result)
        now = time.monotonic()
        if warning is not None and now - self._warned.get(result, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._warned[result] = now  # once per burst: bad placements must not flood it
            log.warning("%s (counted in kvroute_peer_placements_total)", warning)
        return result


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """A message is waiting (ZMQ_EVENTS is an int for this option)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)
