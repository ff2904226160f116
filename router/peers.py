"""Placements shared between router replicas, before the engines' KV events tell.

Two replicas behind one load balancer each see every worker's KV events, but a new prefix
that reaches both within a prefill (~100 ms for 2k tokens) is placed by each on its own
view: measured on vllm-prefix-repetition, the second replica split groups that the first had
homed, and two replicas cached 0.658 of the tokens where one cached 0.749. So each replica
publishes every request it sends (the endpoint and the prompt's block hashes) on a ZMQ PUB
socket (`peer_publish`), and subscribes to the other replicas' (`peers`): what a peer sent
becomes a short-lived prediction here, exactly as if this replica had sent it (approximate
entries for an endpoint without events), until the engine's own events arrive.

On Kubernetes the replicas find each other through a headless Service of the router pods
(`peers_dns: HOST:PORT`), re-resolved every `dns_interval_s`; a replica skips its own address
(`POD_IP` from the downward API, else what its hostname resolves to).

Wire: two frames per placement, the endpoint name (UTF-8; replicas configured alike name
endpoints alike) and the hashes as little-endian uint64. A placement naming an endpoint this
replica does not know is counted and dropped (its worker list differs: the fix is to give
every replica the same workers), and so is a malformed one; nothing a peer sends can stop
the receive loop. PUB drops when a peer is slow (high-water mark): placements are hints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from array import array
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from router.core.fleet import EVENTS, FleetState

log = logging.getLogger("kvroute.peers")

HWM = 10_000  # placements queued per peer before PUB drops (a slow peer loses hints only)
LOG_EVERY_S = 60.0  # a kind of bad placement is logged at most this often
_BIG_ENDIAN = sys.byteorder == "big"


async def _own_addresses() -> set[str]:
    """This pod's addresses: POD_IP (the downward API), else its hostname's."""
    if os.environ.get("POD_IP"):
        return {os.environ["POD_IP"]}
    infos = await asyncio.get_running_loop().getaddrinfo(socket.gethostname(), None)
    return {str(info[4][0]) for info in infos}


def encode(worker: str, hashes: Sequence[int]) -> list[bytes]:
    raw = array("Q", hashes)
    if _BIG_ENDIAN:
        raw.byteswap()
    return [worker.encode(), raw.tobytes()]


def decode(frames: Sequence[bytes]) -> tuple[str, array[int]]:
    """(endpoint, hashes) of a placement; ValueError if the frames are not one."""
    if len(frames) != 2 or len(frames[1]) % 8:
        raise ValueError(f"a placement is 2 frames (endpoint, uint64 hashes), got {len(frames)}")
    hashes = array("Q")
    hashes.frombytes(frames[1])
    if _BIG_ENDIAN:
        hashes.byteswap()
    return frames[0].decode(), hashes


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
    ) -> None:
        self.fleet = fleet
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
        self.counts = {"applied": 0, "unknown_worker": 0, "malformed": 0}
        self._warned: dict[str, float] = {}  # result -> when it was last logged

    async def start(self) -> None:
        if self.publish_endpoint:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, HWM)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.publish_endpoint)
            log.info("publishing placements on %s", self.publish_endpoint)
        if self.peers or self.peers_dns:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.RCVHWM, HWM)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.IPV6, 1)  # a dual-stack Service may answer AAAA too
            self._connect(set(self.peers))
            if self.peers_dns:
                await self.resolve()
                self._dns_task = asyncio.create_task(self._watch_dns())
            self._task = asyncio.create_task(self._receive(self._sub))

    async def stop(self) -> None:
        for task in (self._dns_task, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._dns_task = self._task = None
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None

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
        except OSError as exc:
            log.error("peers_dns %s: %s (keeping the current peers)", self.peers_dns, exc)
            return
        ips = {str(info[4][0]) for info in infos} - mine
        found = {f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in ips}
        self._connect(found | set(self.peers))

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.dns_interval_s)
            await self.resolve()

    def sent(self, worker: str, hashes: Sequence[int]) -> None:
        """This replica sent a request to `worker`: tell the peers (never blocks)."""
        if self._pub is None or not hashes:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(encode(worker, hashes), flags=zmq.NOBLOCK)

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            self.apply(await sub.recv_multipart())

    def apply(self, frames: Sequence[bytes]) -> str:
        """Record one peer placement as a prediction here; returns the result counted."""
        try:
            worker, hashes = decode(frames)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._count("malformed", f"malformed placement from a peer dropped: {exc}")
        state = self.fleet.workers.get(worker)
        if state is None:
            return self._count(
                "unknown_worker",
                f"a peer placed a request on {worker!r}, which this replica does not route "
                "to: give every replica the same workers",
            )
        ttl = self.fleet.predictions if state.mode == EVENTS else self.fleet.approx
        ttl.record(worker, hashes)  # type: ignore[arg-type]
        return self._count("applied", None)

    def _count(self, result: str, warning: str | None) -> str:
        self.counts[result] += 1
        self._on_result(result)
        now = time.monotonic()
        if warning is not None and now - self._warned.get(result, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._warned[result] = now  # once per burst: bad placements must not flood it
            log.warning("%s (counted in kvroute_peer_placements_total)", warning)
        return result
