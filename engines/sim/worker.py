"""One simulated vLLM worker: the engine, its KV event publisher, its metrics and its HTTP app,
served by uvicorn on loopback.

    worker = SimWorker(SimConfig(kv_blocks=926))
    await worker.start()        # binds free ports; worker.url, worker.events_endpoint, ...
    ...
    await worker.stop()

Several workers can share one process and one event loop (`engines.sim.fleet`). The engine
loop and the replay socket are started by the app's lifespan and stopped on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import uvicorn

from engines.sim.blockpool import BlockPool, CacheKeys, Hasher
from engines.sim.config import SimConfig
from engines.sim.engine import Engine, Sleeper
from engines.sim.events_pub import EndpointError, EventPublisher, PublisherConfig
from engines.sim.http import build_app
from engines.sim.kvcache import KVCacheManager
from engines.sim.metrics import SimMetrics
from engines.sim.model import FakeModel
from engines.sim.pd_config import nixl_available
from engines.sim.pd_connector import NixlConnector
from engines.sim.protocol import Renderer
from engines.sim.request import SimRequest
from engines.sim.scheduler import Scheduler
from engines.sim.tokenizer import SimTokenizer
from indexer.clock import Clock

log = logging.getLogger("kvroute.sim")


@lru_cache(maxsize=8)
def load_tokenizer(folder: Path) -> SimTokenizer:
    """Workers of one process share a loaded tokenizer folder."""
    return SimTokenizer(folder)


class _Server(uvicorn.Server):
    """uvicorn without its signal handling (the fleet or CLI owns the signals) and without
    `sys.exit` when the lifespan fails (it would escape the shared event loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        except SystemExit:
            raise RuntimeError("the app's lifespan startup failed") from None


class SimWorker:
    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        clock: Clock | None = None,
        sleep: Sleeper | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = c = (config or SimConfig()).validate()
        self.tokenizer = load_tokenizer(Path(c.tokenizer))
        capacity = (c.kv_blocks - 1) * c.block_size
        self.max_model_len = min(c.max_model_len or self.tokenizer.model_max_length, capacity)
        pool = BlockPool(c.kv_blocks, c.block_size, c.enable_prefix_caching, c.int_hashes, c.events)
        kv = KVCacheManager(pool, Hasher(c.block_size, c.none_hash_seed))
        self.scheduler = Scheduler(
            kv,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_id=self.tokenizer.eos_token_id,
            max_loras=c.max_loras,
        )
        model = FakeModel(
            self.tokenizer.word_ids, self.tokenizer.eos_token_id, c.seed, c.output_len
        )
        self.publisher = EventPublisher(_publisher_config(c)) if c.events else None
        self.metrics = SimMetrics(c.model, c.cache_info(), str(c.data_parallel_rank))
        self.connector = self._connector(clock)
        self.engine = Engine(
            self.scheduler,
            model,
            c.latency,
            clock=clock,
            sleep=sleep,
            wall=wall,
            publish=self.publisher.publish if self.publisher else None,
            observer=self.metrics,
            loader=self.connector,
        )
        loras = {
            name: CacheKeys(lora_name=name, lora_path=path, lora_id=i + 1)
            for i, (name, path) in enumerate(c.lora_modules)
        }
        self.renderer = Renderer(
            self.tokenizer, c.model, self.max_model_len, loras, c.lora_resolver_dir
        )
        self.fingerprint = f"vllm-0.32.0-{hashlib.sha256(repr(c).encode()).hexdigest()[:8]}"
        self.app = build_app(self)
        self._server: _Server | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.startup_error: Exception | None = None

    def _connector(self, clock: Clock | None) -> NixlConnector | None:
        """The P/D connector when configured; NIXL missing fails here, with the fix."""
        c = self.config
        if c.kv_transfer is None:
            return None
        missing = nixl_available()
        if missing is not None:
            raise RuntimeError(f"worker {c.name}: {missing}")
        connector = NixlConnector(
            c.kv_transfer,
            block_size=c.block_size,
            num_blocks=c.kv_blocks,
            model=c.model,
            metrics=self.metrics.nixl(),
            release=self._release,
            clock=clock,
        )
        self.scheduler.retain = connector.on_finished
        return connector

    def _release(self, req: SimRequest) -> None:
        """Free the blocks a connector kept for a decode worker."""
        self.scheduler.kv.free(req)
        self.engine.wake()

    # ---- lifespan (called by the app) ----------------------------------------------------

    async def startup(self) -> None:
        try:
            if self.publisher is not None:
                await self.publisher.start()
            if self.connector is not None:
                await self.connector.start()
            await self.engine.start()
        except Exception as exc:
            self.startup_error = exc
            raise

    async def shutdown(self) -> None:
        await self.engine.stop()
        if self.connector is not None:
            await self.connector.stop()
        if self.publisher is not None:
            await self.publisher.stop()

    # ---- serving -------------------------------------------------------------------------

    async def start(self, timeout: float = 10.0) -> None:
        """Serve on 127.0.0.1 (a free port unless the config names one) until `stop`."""
        if self.publisher is not None:
            try:
                self.publisher.bind()
            except EndpointError as exc:
                raise RuntimeError(f"worker {self.config.name}: {exc}") from None
        # proto must say TCP, or asyncio skips TCP_NODELAY on accepted connections and
        # Nagle + delayed ACK add ~40 ms to every keep-alive response.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.config.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            ws="none",
            timeout_graceful_shutdown=2,
        )
        self._server = _Server(config)
        self._sock = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="sim-http")
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._server.started:
            if self._task.done():
                sock.close()
                await self._failed_start()
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise TimeoutError(f"worker {self.config.name} did not start in {timeout}s")
            await asyncio.sleep(0.01)

    async def _failed_start(self) -> None:
        task, self._task, self._server = self._task, None, None
        cause = self.startup_error
        with contextlib.suppress(Exception):
            if task is not None:
                await task
        if self.publisher is not None:
            await self.publisher.stop()
        raise RuntimeError(f"worker {self.config.name} did not start: {cause}") from cause

    async def stop(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        await task
        if self._sock is not None:
            self._sock.close()  # uvicorn closes its server, not the socket handed to it
            self._sock = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    def info(self) -> dict[str, Any]:
        """How to reach this worker (the fleet's JSON)."""
        c = self.config
        return {
            "name": c.name,
            "url": self.url,
            "host": "127.0.0.1",
            "port": self.port,
            "model": c.model,
            "events": self.publisher is not None,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": c.topic,
            "block_size": c.block_size,
            "kv_blocks": c.kv_blocks,
            "kv_tokens": c.kv_tokens,
            "max_model_len": self.max_model_len,
            "prefix_caching": c.enable_prefix_caching,
            "int_hashes": c.int_hashes,
            "tokenizer": str(c.tokenizer),
            "kv_transfer": self.connector.info() if self.connector else None,
        }


def _publisher_config(c: SimConfig) -> PublisherConfig:
    return PublisherConfig(
        endpoint=c.events_endpoint,
        replay_endpoint=c.replay_endpoint,
        topic=c.topic,
        buffer_steps=c.buffer_steps,
        hwm=c.hwm,
        dp_rank=c.data_parallel_rank,
    )
