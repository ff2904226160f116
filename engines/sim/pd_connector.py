"""A simulated worker's NixlConnector: both legs of vLLM 0.32's pull-mode handoff.

Prefill side (a request whose `kv_transfer_params` say `do_remote_decode`): when it finishes
(stop or length) its blocks are not freed; they are tagged, held under a lease of
`kv_lease_duration` (30 s) and described in the params returned to the client. They are
freed when the decode side's notification `"{request_id}:1"` arrives, or when the lease
ends (counted in `vllm:nixl_num_kv_expired_reqs`, as vLLM does); heartbeats (`"HB:..."`)
extend a lease.

Decode side (params say `do_remote_prefill`): the scheduler allocates the prompt's blocks
and calls `load`, which handshakes with the prefill worker's side channel (once per remote
engine), READs with NIXL only the blocks not already cached here, sleeps the rest of the
emulated link's time (`--link-mb-s`), notifies the prefill side, checks the blocks' tags and
records vLLM's transfer metrics. A failure is counted and handled by
`kv_load_failure_policy`: fail the request (500) or recompute it here.

Errors real vLLM does not survive (malformed block ids) fail the request with a 500 and a
log line that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq.asyncio

from engines.sim.kvcache import cdiv
from engines.sim.pd_config import KVTransferConfig
from engines.sim.pd_metrics import NixlMetrics
from engines.sim.pd_nixl import NixlKV, RemoteAgent, block_tags
from engines.sim.pd_wire import (
    HEARTBEAT_PREFIX,
    HandshakeError,
    NixlHandshakePayload,
    RemoteParams,
    compatibility_hash,
    handshake,
    producer_params,
    wants_remote_decode,
)
from engines.sim.request import SimRequest
from engines.sim.scheduler import LoadResult
from indexer.clock import Clock, MonotonicClock

log = logging.getLogger("kvroute.sim.pd")

POLL_S = 0.002  # how often leases and notifications are looked at while any exist
CRASH_NOTE = "real vLLM 0.32 would crash here (the API server exits); the simulator answers 500"


@dataclass
class Lease:
    request: SimRequest
    expires: float


@dataclass
class PDCounters:
    """The simulator's own tallies (`/sim/stats`), beside vLLM's metrics."""

    pulls: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    failed_pulls: int = 0
    tag_mismatches: int = 0
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
        self.counters = PDCounters()
        self.leases: dict[str, Lease] = {}
        self.waiting_pulls: dict[str, set[str]] = {}  # remote engine -> its request ids
        self._remotes: dict[str, asyncio.Task[RemoteAgent]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None
        self.kv: NixlKV | None = None
        self.side_channel_port: int | None = None

    # ---- lifecycle (the worker's lifespan) ------------------------------------------------

    async def start(self) -> None:
        from engines.sim.pd_wire import SideChannel

        self.kv = NixlKV(f"kvroute-sim-{self.engine_id}", self.num_blocks, self.block_bytes)
        self._ctx = zmq.asyncio.Context()
        meta = self.kv.agent_metadata(self.engine_id, self.block_size)
        payload = NixlHandshakePayload(self.compat, msgspec.msgpack.encode(meta))
        c = self.config
        side = SideChannel(
            self._ctx, c.side_channel_host, c.side_channel_port, msgspec.msgpack.encode(payload)
        )
        self.side_channel_port = side.port
        self._tasks = [
            asyncio.create_task(self._serve(side), name="nixl-side-channel"),
            asyncio.create_task(self._poll(), name="nixl-leases"),
        ]

    async def _serve(self, side: object) -> None:
        from engines.sim.pd_wire import SideChannel

        assert isinstance(side, SideChannel)
        try:
            await side.serve()
        finally:
            side.close()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in [*tasks, *self._remotes.values()]:
            task.cancel()
        for task in [*tasks, *self._remotes.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._remotes.clear()
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
        self.counters.leases += 1
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
            if now - last_heartbeat >= self.config.lease_s / 6:
                last_heartbeat = now
                self._heartbeat()
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
        self.counters.leases_read += 1
        self.release(lease.request)

    def _expire(self, now: float) -> None:
        for rid in [r for r, lease in self.leases.items() if now >= lease.expires]:
            lease = self.leases.pop(rid)
            self.metrics.kv_expired.inc()
            self.counters.leases_expired += 1
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

    def _heartbeat(self) -> None:
        assert self.kv is not None
        for engine_id, ids in self.waiting_pulls.items():
            task = self._remotes.get(engine_id)
            if task is None or not task.done() or _failed(task):
                continue
            with contextlib.suppress(Exception):
                self.kv.notify(task.result(), (HEARTBEAT_PREFIX + ",".join(ids)).encode())

    def missing_blocks(self, remote: RemoteParams, prompt_tokens: int, cached: int) -> int:
        """Blocks the decode side needs beyond what the params offer (0: enough). vLLM
        asserts on a shortfall and its engine dies."""
        needed = cdiv(prompt_tokens, self.block_size) - cached // self.block_size
        return max(needed - len(remote.block_ids), 0)

    async def load(self, req: SimRequest) -> LoadResult:
        """Pull the blocks of `req` it does not hold yet (the engine calls this)."""
        remote = req.remote
        assert isinstance(remote, RemoteParams)
        self._forget_waiting(req)
        local = [b.block_id for b in req.blocks[req.num_computed // self.block_size :]]
        if len(remote.block_ids) < len(local):
            log.error(
                "request %s: remote_block_ids has %d blocks, %d are needed; %s",
                req.request_id,
                len(remote.block_ids),
                len(local),
                CRASH_NOTE,
            )
            return "fatal"
        try:
            agent = await self._remote(remote)
        except (HandshakeError, OSError, RuntimeError) as exc:
            return self._failed(req, f"handshake with {remote.host}:{remote.port}: {exc}")
        return await self._read(req, remote, agent, local)

    async def _read(
        self, req: SimRequest, remote: RemoteParams, agent: RemoteAgent, local: list[int]
    ) -> LoadResult:
        assert self.kv is not None
        remote_ids = list(remote.block_ids[len(remote.block_ids) - len(local) :])
        start = time.perf_counter()
        try:
            handle = self.kv.post_read(agent, local, remote_ids)
            posted = time.perf_counter() - start
            state = await self._wait(handle)
        except Exception as exc:  # NIXL raises its own error types
            state = f"ERR ({exc})"
        if state != "DONE":
            self._drop_remote(remote.engine_id)
            return self._failed(req, f"NIXL READ from {remote.engine_id}: {state}")
        nbytes = len(local) * self.block_bytes
        await self._throttle(nbytes, time.perf_counter() - start)
        xfer_s = time.perf_counter() - start
        self._notify(agent, remote)
        self.metrics.transfer(nbytes, len(local), posted, xfer_s)
        self._check_tags(req, local)
        self.counters.pulls += 1
        self.counters.pulled_blocks += len(local)
        self.counters.pulled_bytes += nbytes
        return "ok"

    async def _wait(self, handle: object) -> str:
        """Poll the transfer on the loop (NIXL is not locked for other threads): spin for
        the first milliseconds, then yield a millisecond at a time."""
        assert self.kv is not None
        spin_until = time.perf_counter() + 0.002
        try:
            while (state := self.kv.state(handle)) == "PROC":
                await asyncio.sleep(0 if time.perf_counter() < spin_until else 0.001)
            return state
        finally:
            self.kv.release(handle)

    async def _throttle(self, nbytes: int, elapsed_s: float) -> None:
        """Emulate `--link-mb-s`: wait for the time the bytes would still need."""
        if self.config.link_mb_s is None:
            return
        missing = nbytes / (self.config.link_mb_s * 1e6) - elapsed_s
        if missing > 0:
            await asyncio.sleep(missing)

    def _notify(self, agent: RemoteAgent, remote: RemoteParams) -> None:
        """Tell the prefill side its blocks may go (after the throttle, so that a slow link
        holds them as long as a real one would)."""
        assert self.kv is not None
        try:
            self.kv.notify(agent, remote.notification)
        except Exception as exc:
            self.metrics.failed(notification=True)
            log.warning(
                "notification to %s failed (%s); its blocks are freed when the lease ends",
                remote.engine_id,
                exc,
            )

    def _check_tags(self, req: SimRequest, local: list[int]) -> None:
        assert self.kv is not None
        n_blocks = cdiv(req.num_prompt_tokens, self.block_size)
        expected = block_tags(req.prompt_ids, self.block_size, n_blocks)[-len(local) :]
        if self.kv.tags(local) != expected:
            self.counters.tag_mismatches += 1
            log.warning(
                "request %s: pulled blocks do not hold this prompt's KV (params of another "
                "request, or blocks reused after their lease); vLLM would decode from them",
                req.request_id,
            )

    def _failed(self, req: SimRequest, why: str) -> LoadResult:
        self.metrics.failed()
        self.counters.failed_pulls += 1
        then = "recomputing locally" if self.recompute_failed_loads else "failing the request"
        log.warning("KV pull for %s failed: %s; %s", req.request_id, why, then)
        return "failed"

    async def _remote(self, remote: RemoteParams) -> RemoteAgent:
        """The prefill engine's agent, handshaking once per engine (concurrent pulls share
        one handshake; a failed one is retried by the next pull)."""
        task = self._remotes.get(remote.engine_id)
        if task is None or (task.done() and _failed(task)):
            task = asyncio.create_task(self._connect(remote), name=f"nixl-hs-{remote.engine_id}")
            self._remotes[remote.engine_id] = task
        return await asyncio.shield(task)

    async def _connect(self, remote: RemoteParams) -> RemoteAgent:
        assert self._ctx is not None and self.kv is not None
        meta = await handshake(self._ctx, remote.host, remote.port, remote.engine_id, self.compat)
        if meta.block_size != self.block_size or meta.block_lens != [self.block_bytes]:
            raise HandshakeError(
                f"remote blocks are {meta.block_size} tokens / {meta.block_lens} bytes, "
                f"here {self.block_size} / {self.block_bytes}: use the same --block-size "
                "and --kv-bytes-per-token on both sides"
            )
        return self.kv.add_remote(meta)

    def _drop_remote(self, engine_id: str) -> None:
        """Forget a peer after a failed READ, so that the next pull handshakes again."""
        task = self._remotes.pop(engine_id, None)
        if task is not None and task.done() and not _failed(task) and self.kv:
            with contextlib.suppress(Exception):
                self.kv.remove_remote(task.result())


def _failed(task: asyncio.Task[RemoteAgent]) -> bool:
    return task.cancelled() or task.exception() is not None
