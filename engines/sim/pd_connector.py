"""A simulated worker's NixlConnector: both legs of vLLM 0.32's pull-mode handoff.

Prefill side (a request whose `kv_transfer_params` say `do_remote_decode`): when it finishes
(stop or length) its blocks are not freed; they are tagged, held under a lease of
`kv_lease_duration` (30 s) and described in the params returned to the client. They are
freed when the decode side's notification `"{request_id}:1"` arrives, or when the lease
ends (counted in `vllm:nixl_num_kv_expired_reqs`, as vLLM does); heartbeats (`"HB:..."`)
extend a lease.

Decode side (params say `do_remote_prefill`): the scheduler allocates the prompt's blocks
and calls `load`, which pulls them (`engines.sim.pd_pull`); while a request waits here for
its pull, its prefill engine gets heartbeats. A failed pull is handled by
`kv_load_failure_policy`: fail the request (500) or recompute it here. Errors real vLLM does
not survive (malformed block ids) fail the request with a 500 and a log line that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq.asyncio

from engines.sim.pd_config import KVTransferConfig
from engines.sim.pd_metrics import NixlMetrics
from engines.sim.pd_nixl import NixlKV, block_tags
from engines.sim.pd_pull import Link, Puller
from engines.sim.pd_wire import (
    HEARTBEAT_PREFIX,
    NixlHandshakePayload,
    RemoteParams,
    SideChannel,
    compatibility_hash,
    producer_params,
    wants_remote_decode,
)
from engines.sim.request import SimRequest
from engines.sim.scheduler import LoadResult
from indexer.clock import Clock, MonotonicClock

log = logging.getLogger("kvroute.sim.pd")

POLL_S = 0.002  # how often leases and notifications are looked at while any exist


@dataclass
class Lease:
    request: SimRequest
    expires: float


@dataclass
class LeaseCounters:
    """The simulator's own tallies of leases (`/sim/stats`), beside vLLM's metrics."""

    leases: int = 0
    leases_read: int = 0
    leases_expired: int = 0


class NixlConnector:
    def __init__(
        self,
        config: KVTransferConfig,
        *,
        block_size: int,
        num_blocks: int,
        model: str,
        metrics: NixlMetrics,
        release: Callable[[SimRequest], None],
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_bytes = config.block_bytes(block_size)
        self.compat = compatibility_hash(model, config.kv_bytes_per_token, block_size)
        self.metrics = metrics
        self.release = release  # frees a retained request's blocks (the worker's job)
        self.clock: Clock = clock or MonotonicClock()
        self.recompute_failed_loads = config.load_failure_policy == "recompute"
        self.lease_counters = LeaseCounters()
        self.leases: dict[str, Lease] = {}
        self.waiting_pulls: dict[str, set[str]] = {}  # remote engine -> its request ids
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None
        self.kv: NixlKV | None = None
        self.puller: Puller | None = None
        self.side_channel_port: int | None = None

    # ---- lifecycle (the worker's lifespan) ------------------------------------------------

    async def start(self) -> None:
        c = self.config
        self.kv = kv = NixlKV(f"kvroute-sim-{self.engine_id}", self.num_blocks, self.block_bytes)
        self._ctx = zmq.asyncio.Context()
        meta = msgspec.msgpack.encode(kv.agent_metadata(self.engine_id, self.block_size))
        payload = msgspec.msgpack.encode(NixlHandshakePayload(self.compat, meta))
        side = SideChannel(self._ctx, c.side_channel_host, c.side_channel_port, payload)
        self.side_channel_port = side.port
        link = Link(
            self.block_size, self.block_bytes, self.compat, c.link_mb_s, self.recompute_failed_loads
        )
        self.puller = Puller(kv, self._ctx, link, self.metrics)
        self._tasks = [
            asyncio.create_task(self._serve(side), name="nixl-side-channel"),
            asyncio.create_task(self._poll(), name="nixl-leases"),
        ]

    async def _serve(self, side: SideChannel) -> None:
        try:
            await side.serve()
        finally:
            side.close()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.puller is not None:
            await self.puller.close()
        if self.kv is not None:
            self.kv.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def info(self) -> dict[str, object]:
        c = self.config
        return {
            "kv_connector": c.connector,
            "kv_role": c.role,
            "engine_id": self.engine_id,
            "side_channel_host": c.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "kv_bytes_per_token": c.kv_bytes_per_token,
            "block_bytes": self.block_bytes,
            "link_mb_s": c.link_mb_s,
            "kv_lease_duration": c.lease_s,
            "kv_load_failure_policy": c.load_failure_policy,
        }

    def stats(self) -> dict[str, Any]:
        """The simulator's own tallies, for `/sim/stats`."""
        pulls = dataclasses.asdict(self.puller.counters) if self.puller else {}
        return {**pulls, **dataclasses.asdict(self.lease_counters), "leases_held": len(self.leases)}

    # ---- prefill side ---------------------------------------------------------------------

    def on_finished(self, req: SimRequest) -> bool:
        """Scheduler hook: True when the finished request's blocks stay for a decode worker."""
        if req.remote is not None:
            self._forget_waiting(req)
        done = req.finish_reason in ("stop", "length")
        if not (wants_remote_decode(req.kv_transfer_params) and done and req.blocks):
            return False
        assert self.kv is not None
        ids = [b.block_id for b in req.blocks]
        computed = req.all_ids()[: req.num_computed]  # not the sampled token: D computes it
        self.kv.write_tags(ids, block_tags(computed, self.block_size, len(ids)))
        req.kv_transfer_out = producer_params(
            block_ids=ids,
            engine_id=self.engine_id,
            request_id=req.request_id,
            host=self.config.side_channel_host,
            port=self.side_channel_port or 0,
            num_tokens=req.num_computed,
            cached_tokens=max(req.num_cached_tokens, 0),
        )
        self.leases[req.request_id] = Lease(req, self.clock.now() + self.config.lease_s)
        self.lease_counters.leases += 1
        self._wake.set()
        return True

    async def _poll(self) -> None:
        """Notifications and lease expiry, every POLL_S while there is anything to watch."""
        last_heartbeat = 0.0
        while True:
            if not self.leases and not self.waiting_pulls:
                self._wake.clear()
                await self._wake.wait()
            assert self.kv is not None
            for message in self.kv.notifications():
                self._on_notification(message.decode("utf-8", "replace"))
            now = self.clock.now()
            self._expire(now)
            if self.puller is not None and now - last_heartbeat >= self.config.lease_s / 6:
                last_heartbeat = now
                self.puller.heartbeat(self.waiting_pulls)
            await asyncio.sleep(POLL_S)

    def _on_notification(self, message: str) -> None:
        if message.startswith(HEARTBEAT_PREFIX):
            until = self.clock.now() + self.config.lease_s
            for rid in message[len(HEARTBEAT_PREFIX) :].split(","):
                if (lease := self.leases.get(rid)) is not None:
                    lease.expires = max(lease.expires, until)
            return
        rid = message.rpartition(":")[0]
        lease = self.leases.pop(rid, None)
        if lease is None:
            self.metrics.notifications_after_expiry.inc()
            log.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by "
                "a decode worker. They may have expired.",
                rid,
            )
            return
        self.lease_counters.leases_read += 1
        self.release(lease.request)

    def _expire(self, now: float) -> None:
        for rid in [r for r, lease in self.leases.items() if now >= lease.expires]:
            lease = self.leases.pop(rid)
            self.metrics.kv_expired.inc()
            self.lease_counters.leases_expired += 1
            log.warning(
                "Releasing expired KV blocks for request %s which were retrieved by 0 remote "
                "worker(s) before lease expired.",
                rid,
            )
            self.release(lease.request)

    # ---- decode side ----------------------------------------------------------------------

    def on_submit(self, req: SimRequest) -> None:
        """Heartbeat the prefill side while the request waits here for its pull."""
        remote = req.remote
        if isinstance(remote, RemoteParams):
            self.waiting_pulls.setdefault(remote.engine_id, set()).add(remote.request_id)
            self._wake.set()

    def _forget_waiting(self, req: SimRequest) -> None:
        remote = req.remote
        if isinstance(remote, RemoteParams) and remote.engine_id in self.waiting_pulls:
            ids = self.waiting_pulls[remote.engine_id]
            ids.discard(remote.request_id)
            if not ids:
                del self.waiting_pulls[remote.engine_id]

    def missing_blocks(self, remote: RemoteParams, prompt_tokens: int, cached: int) -> int:
        assert self.puller is not None
        return self.puller.missing_blocks(remote, prompt_tokens, cached)

    async def load(self, req: SimRequest) -> LoadResult:
        """Pull the blocks of `req` it does not hold yet (the engine calls this)."""
        assert isinstance(req.remote, RemoteParams) and self.puller is not None
        self._forget_waiting(req)
        return await self.puller.pull(req, req.remote)
