"""The decode side of the simulated handoff: pull a request's prompt KV from a prefill worker.

Per request (the engine calls `pull` once the scheduler has allocated the prompt's blocks):
handshake with the prefill worker's side channel (once per remote engine, shared by
concurrent pulls), NIXL READ of the blocks not cached here (the tail of `remote_block_ids`,
as vLLM trims it), a sleep for the rest of the emulated link's time (`--link-mb-s`), the
notification `"{remote_request_id}:1"` that lets the prefill side free its blocks, a check
of the blocks' tags, and vLLM's transfer metrics. Failures are counted and returned;
`kv_load_failure_policy` is applied by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq.asyncio

from engines.sim.kvcache import cdiv
from engines.sim.pd_metrics import NixlMetrics
from engines.sim.pd_nixl import NixlKV, RemoteAgent, block_tags
from engines.sim.pd_wire import HEARTBEAT_PREFIX, HandshakeError, RemoteParams, handshake
from engines.sim.request import SimRequest
from engines.sim.scheduler import LoadResult

log = logging.getLogger("kvroute.sim.pd")

CRASH_NOTE = "real vLLM 0.32 would crash here (the API server exits); the simulator answers 500"
SPIN_S = 0.002  # poll a transfer without yielding time for this long, then every millisecond


@dataclass
class PullCounters:
    """The simulator's own tallies of pulls (`/sim/stats`), beside vLLM's metrics."""

    pulls: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    failed_pulls: int = 0
    tag_mismatches: int = 0


@dataclass(frozen=True)
class Link:
    """What a pull needs to know of this worker."""

    block_size: int
    block_bytes: int
    compat: str  # the compatibility hash both sides must share
    link_mb_s: float | None  # emulated link; None: as fast as NIXL moves it
    recompute: bool  # kv_load_failure_policy == "recompute" (only for the log line)


class Puller:
    def __init__(
        self, kv: NixlKV, ctx: zmq.asyncio.Context, link: Link, metrics: NixlMetrics
    ) -> None:
        self.kv = kv
        self.ctx = ctx
        self.link = link
        self.metrics = metrics
        self.counters = PullCounters()
        self._remotes: dict[str, asyncio.Task[RemoteAgent]] = {}

    async def close(self) -> None:
        for task in self._remotes.values():
            task.cancel()
        for task in self._remotes.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._remotes.clear()

    def missing_blocks(self, remote: RemoteParams, prompt_tokens: int, cached: int) -> int:
        """Blocks the decode side needs beyond what the params offer (0: enough). vLLM
        asserts on a shortfall and its engine dies."""
        bs = self.link.block_size
        return max(cdiv(prompt_tokens, bs) - cached // bs - len(remote.block_ids), 0)

    async def pull(self, req: SimRequest, remote: RemoteParams) -> LoadResult:
        """READ the blocks of `req` that are not computed here yet."""
        local = [b.block_id for b in req.blocks[req.num_computed // self.link.block_size :]]
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
        nbytes = len(local) * self.link.block_bytes
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
        """Poll on the loop's thread (NIXL does no locking of its own here)."""
        spin_until = time.perf_counter() + SPIN_S
        try:
            while (state := self.kv.state(handle)) == "PROC":
                await asyncio.sleep(0 if time.perf_counter() < spin_until else 0.001)
            return state
        finally:
            self.kv.release(handle)

    async def _throttle(self, nbytes: int, elapsed_s: float) -> None:
        """Emulate `--link-mb-s`: wait for the time the bytes would still need."""
        if self.link.link_mb_s is None:
            return
        missing = nbytes / (self.link.link_mb_s * 1e6) - elapsed_s
        if missing > 0:
            await asyncio.sleep(missing)

    def _notify(self, agent: RemoteAgent, remote: RemoteParams) -> None:
        """Tell the prefill side its blocks may go (after the throttle, so that a slow link
        holds them as long as a real one would)."""
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
        bs = self.link.block_size
        expected = block_tags(req.prompt_ids, bs, cdiv(req.num_prompt_tokens, bs))
        if self.kv.tags(local) != expected[len(expected) - len(local) :]:
            self.counters.tag_mismatches += 1
            log.warning(
                "request %s: pulled blocks do not hold this prompt's KV (params of another "
                "request, or blocks reused after their lease); vLLM would decode from them",
                req.request_id,
            )

    def _failed(self, req: SimRequest, why: str) -> LoadResult:
        self.metrics.failed()
        self.counters.failed_pulls += 1
        then = "recomputing locally" if self.link.recompute else "failing the request"
        log.warning("KV pull for %s failed: %s; %s", req.request_id, why, then)
        return "failed"

    # ---- remote agents --------------------------------------------------------------------

    async def _remote(self, remote: RemoteParams) -> RemoteAgent:
        """The prefill engine's agent, handshaking once per engine (concurrent pulls share
        one handshake; a failed one is retried by the next pull)."""
        task = self._remotes.get(remote.engine_id)
        if task is None or (task.done() and _failed(task)):
            task = asyncio.create_task(self._connect(remote), name=f"nixl-hs-{remote.engine_id}")
            self._remotes[remote.engine_id] = task
        return await asyncio.shield(task)

    async def _connect(self, remote: RemoteParams) -> RemoteAgent:
        link = self.link
        meta = await handshake(self.ctx, remote.host, remote.port, remote.engine_id, link.compat)
        if meta.block_size != link.block_size or meta.block_lens != [link.block_bytes]:
            raise HandshakeError(
                f"remote blocks are {meta.block_size} tokens / {meta.block_lens} bytes, "
                f"here {link.block_size} / {link.block_bytes}: use the same --block-size "
                "and --kv-bytes-per-token on both sides"
            )
        return self.kv.add_remote(meta)

    def _drop_remote(self, engine_id: str) -> None:
        """Forget a peer after a failed READ, so that the next pull handshakes again."""
        task = self._remotes.pop(engine_id, None)
        if task is not None and task.done() and not _failed(task):
            with contextlib.suppress(Exception):
                self.kv.remove_remote(task.result())

    def heartbeat(self, waiting: dict[str, set[str]]) -> None:
        """`HB:id,id` to each connected prefill engine whose requests still wait here."""
        for engine_id, ids in waiting.items():
            task = self._remotes.get(engine_id)
            if task is not None and task.done() and not _failed(task):
                with contextlib.suppress(Exception):
                    self.kv.notify(task.result(), _heartbeat(ids))


def _heartbeat(ids: Iterable[str]) -> bytes:
    return (HEARTBEAT_PREFIX + ",".join(sorted(ids))).encode()


def _failed(task: asyncio.Task[RemoteAgent]) -> bool:
    return task.cancelled() or task.exception() is not None
