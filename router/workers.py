"""The worker pool: discovery, KV event subscriptions, health checks, load scraping, and the
per-worker verdicts behind /health. Every background task is started in `start()` and
cancelled in `stop()` (the app lifespan owns both)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq.asyncio

from engines.base import EngineMetrics, EventSource
from engines.vllm import ADAPTER as VLLM
from engines.vllm.discovery import event_sources, parse_metrics
from engines.vllm.events import decode_batch
from indexer.clock import Clock
from indexer.health import EventHealth, HealthTracker
from indexer.ingest import WorkerIngest
from indexer.subscriber import EventSubscriber
from router.core.config import Config, WorkerConfig
from router.core.picker import APPROX, EVENTS, RoutingCore, WorkerState
from router.tokenize import LocalTokenizer

log = logging.getLogger("kvroute.workers")

DEFAULT_BLOCK_SIZE = 16
EJECT_AFTER_FAILURES = 2
PROBE_TEXT = "kvroute tokenizer probe: The quick brown fox jumps over 13 lazy dogs."
PROBE_CHAT = [{"role": "user", "content": PROBE_TEXT}]


def _restarted(before: EngineMetrics | None, now: EngineMetrics) -> bool:
    """A counter that only grows went down: a new engine process."""
    if before is None or before.prefix_queries is None or now.prefix_queries is None:
        return False
    return now.prefix_queries < before.prefix_queries


@dataclass
class WorkerHandle:
    config: WorkerConfig
    state: WorkerState
    mode_setting: str  # events | approx | auto, as configured
    ingest: WorkerIngest | None = None
    subscriber: EventSubscriber | None = None
    task: asyncio.Task[None] | None = None
    source: EventSource | None = None
    models: list[dict[str, Any]] = field(default_factory=list)
    metrics: EngineMetrics | None = None
    failures: int = 0
    last_error: str = ""
    problems: dict[str, str] = field(default_factory=dict)  # config problems found by probes
    discovered: bool = False

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def host(self) -> str:
        return urlsplit(self.config.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.config.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


class WorkerPool:
    def __init__(
        self,
        config: Config,
        core: RoutingCore,
        client: httpx.AsyncClient,
        clock: Clock,
        tokenizer: LocalTokenizer | None,
    ) -> None:
        self.config = config
        self.core = core
        self.client = client
        self.clock = clock
        self.tokenizer = tokenizer
        self.handles: dict[str, WorkerHandle] = {}
        self._zmq: zmq.asyncio.Context | None = None  # made in start(), destroyed in stop()
        self._loops: list[asyncio.Task[None]] = []
        self._last_error_log: dict[str, float] = {}

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        await self.set_workers(self.config.workers)
        self._loops = [
            *(
                [asyncio.create_task(self._every(self.config.dns_interval_s, self.resolve_dns))]
                if self.config.workers_dns
                else []
            ),
            asyncio.create_task(
                self._every(self.config.health_check_interval_s, self.check_health)
            ),
            asyncio.create_task(self._every(self.config.scrape_interval_s, self.scrape)),
            asyncio.create_task(self._every(1.0, self.refresh_modes)),
        ]

    async def stop(self) -> None:
        for task in self._loops:
            task.cancel()
        for h in list(self.handles.values()):
            await self._stop_handle(h)
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    async def _every(self, seconds: float, fn: Any) -> None:
        while True:
            try:
                await fn()
            except Exception:  # a failing probe must not kill the loop
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(seconds)

    async def set_workers(self, workers: tuple[WorkerConfig, ...]) -> None:
        """Reconcile to a new worker list (start-up and reloads)."""
        wanted = {w.name: w for w in workers}
        for name in [
            n for n in self.handles if n not in wanted or self.handles[n].config != wanted[n]
        ]:
            await self._stop_handle(self.handles.pop(name))
            self.core.remove_worker(name)
        new = [w for name, w in wanted.items() if name not in self.handles]
        for w in new:
            self._add(w)
        await asyncio.gather(*(self.discover(self.handles[w.name]) for w in new))

    async def resolve_dns(self) -> None:
        """workers_dns: a headless Service's A records are the worker pods (one per IP)."""
        assert self.config.workers_dns is not None
        host, _, port = self.config.workers_dns.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            log.error("workers_dns %s: %s (keeping the current workers)", host, exc)
            return
        ips = sorted({str(info[4][0]) for info in infos})
        found = tuple(
            WorkerConfig(f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}")
            for ip in ips
        )
        current = {h.config for h in self.handles.values()}
        wanted = (*self.config.workers, *found)
        if set(wanted) != current:
            log.warning("workers_dns %s: now %s", host, ", ".join(w.name for w in found) or "none")
            await self.set_workers(wanted)

    def _add(self, w: WorkerConfig) -> None:
        mode_setting = self.config.worker_mode(w)
        block_size = w.block_size or self.config.block_size or DEFAULT_BLOCK_SIZE
        health = self._health(w.name)
        state = WorkerState(
            name=w.name,
            mode=APPROX if mode_setting == APPROX else EVENTS,
            block_size=block_size,
            health=health,
        )
        self.core.add_worker(state, model=self.config.model)
        self.handles[w.name] = WorkerHandle(w, state, mode_setting)

    def _health(self, name: str) -> HealthTracker:
        return HealthTracker(
            name, self.clock, grace_s=self.config.event_grace_s, fixes=VLLM.hints.health
        )

    async def _stop_handle(self, h: WorkerHandle) -> None:
        if h.task is not None:
            h.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await h.task
            h.task = None

    # ---- discovery -------------------------------------------------------------------

    async def discover(self, h: WorkerHandle) -> None:
        """Ask the worker for its publisher, cache config and models; subscribe to events."""
        url = h.config.url.rstrip("/")
        h.metrics = await self._metrics(h)
        await self._models(h)
        if h.mode_setting != APPROX:
            h.source = await self._event_source(h, url)
            if h.source is not None:
                self._subscribe(h, h.source)
            else:
                h.problems["events"] = (
                    f"worker {h.name} has no KV event publisher (GET {url}/kv_event_sources "
                    f"is empty): start vLLM with --kv-events-config, or set events: "
                    f"tcp://HOST:PORT for this worker"
                )
        self._apply_cache_config(h)
        await self._check_tokenizer(h, url)
        h.discovered = True
        self.refresh_mode(h)

    async def _event_source(self, h: WorkerHandle, url: str) -> EventSource | None:
        if h.config.events:
            return EventSource(h.config.events, h.config.replay, h.config.topic or "")
        try:
            resp = await self.client.get(f"{url}/kv_event_sources")
            doc = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            h.last_error = f"GET /kv_event_sources: {exc}"
            return None
        found = event_sources(doc, url)
        src = found[0] if found else None
        if src is not None and h.config.topic is not None:
            src = EventSource(src.endpoint, src.replay_endpoint, h.config.topic)
        return src

    def _subscribe(self, h: WorkerHandle, src: EventSource) -> None:
        assert h.state.health is not None
        h.state.health.endpoint = src.endpoint
        h.ingest = WorkerIngest(
            h.name,
            self.core.index,
            decode_batch,
            self.clock,
            health=h.state.health,
            has_replay=src.replay_endpoint is not None,
            block_size=h.config.block_size or self.config.block_size,
        )
        h.subscriber = EventSubscriber(
            h.ingest,
            src.endpoint,
            replay_endpoint=src.replay_endpoint,
            topic=src.topic,
            ctx=self._context(),
            on_batch=lambda: self._learned_block_size(h),
        )
        h.task = asyncio.create_task(h.subscriber.run(), name=f"events-{h.name}")

    def _context(self) -> zmq.asyncio.Context:
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        return self._zmq

    def _learned_block_size(self, h: WorkerHandle) -> None:
        if h.ingest is not None and h.ingest.learned_block_size:
            h.state.block_size = h.ingest.learned_block_size

    def _apply_cache_config(self, h: WorkerHandle) -> None:
        m = h.metrics
        if m is None:
            return
        if m.num_gpu_blocks:
            h.state.capacity_blocks = m.num_gpu_blocks
        configured = h.config.block_size or self.config.block_size
        if m.block_size and not configured:
            h.state.block_size = m.block_size
        elif m.block_size and configured and m.block_size != configured:
            h.problems["block_size"] = (
                f"worker {h.name}: block size mismatch: configured block_size={configured} "
                f"but the engine reports block_size={m.block_size} (vllm:cache_config_info); "
                f"set block_size: {m.block_size} or start vLLM with --block-size {configured}"
            )
        h.state.caching = m.prefix_caching is not False
        if m.prefix_caching is False:
            h.problems["prefix_caching"] = (
                f"worker {h.name} runs with prefix caching off: nothing can be reused, KV-aware "
                "routing is pointless; start vLLM with --enable-prefix-caching"
            )

    async def _models(self, h: WorkerHandle) -> None:
        try:
            resp = await self.client.get(f"{h.config.url.rstrip('/')}/v1/models")
            data = resp.json().get("data", []) if resp.status_code == 200 else []
            h.models = [m for m in data if isinstance(m, dict)]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            h.last_error = f"GET /v1/models: {exc}"

    async def _check_tokenizer(self, h: WorkerHandle, url: str) -> None:
        """Tokenize a probe here and on the worker; a difference breaks every prefix match."""
        if self.tokenizer is None:
            return
        model = h.models[0]["id"] if h.models else ""
        mine = {
            "completion": self.tokenizer.completion(PROBE_TEXT),
            "chat": self.tokenizer.chat(PROBE_CHAT),
        }
        bodies = {
            "completion": {"model": model, "prompt": PROBE_TEXT},
            "chat": {"model": model, "messages": PROBE_CHAT, "add_generation_prompt": True},
        }
        for kind, body in bodies.items():
            try:
                resp = await self.client.post(f"{url}/tokenize", json=body)
                theirs = resp.json().get("tokens") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                theirs = None
            if theirs is None:
                continue  # the engine may not expose /tokenize; router-check warns
            if theirs != mine[kind]:
                h.problems["tokenizer"] = (
                    f"worker {h.name}: tokenizer mismatch on a {kind} probe: the router makes "
                    f"{len(mine[kind])} tokens {mine[kind][:6]}..., the worker "
                    f"{len(theirs)} tokens {theirs[:6]}...; point --tokenizer at the same files "
                    "the engine loads (or use --tokenizer remote)"
                )
                return
        h.problems.pop("tokenizer", None)

    # ---- periodic --------------------------------------------------------------------

    async def _metrics(self, h: WorkerHandle) -> EngineMetrics | None:
        try:
            resp = await self.client.get(f"{h.config.url.rstrip('/')}/metrics")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return parse_metrics(resp.text)
        except ValueError:
            return None

    async def rediscover(self, h: WorkerHandle, why: str) -> None:
        """Forget what we knew of a worker (its index, subscription, findings) and discover
        it again: an engine that restarted may have lost its cache or its flags."""
        log.warning("worker %s: rediscovering because %s", h.name, why)
        await self._stop_handle(h)
        h.ingest = h.subscriber = h.source = None
        h.problems.clear()
        self.core.forget_cache(h.name)
        h.state.health = self._health(h.name)
        await self.discover(h)

    async def scrape(self) -> None:
        async def one(h: WorkerHandle) -> None:
            m = await self._metrics(h)
            if m is None:
                return
            if _restarted(h.metrics, m):
                h.metrics = m
                await self.rediscover(h, "its /metrics counters went back (engine restart)")
            h.metrics = m
            self.core.load.scraped(h.name, m.running, m.waiting, m.kv_usage, m.num_gpu_blocks)

        await asyncio.gather(*(one(h) for h in self.handles.values()))

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check_one(h) for h in self.handles.values()))

    async def _check_one(self, h: WorkerHandle) -> None:
        try:
            resp = await self.client.get(f"{h.config.url.rstrip('/')}/health")
            ok = resp.status_code == 200
            why = "" if ok else f"/health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if ok:
            was_down = h.failures >= EJECT_AFTER_FAILURES or not h.state.available
            h.failures = 0
            if not h.discovered:
                await self.discover(h)
            elif was_down:
                # it may be a new engine process with other flags: ask it again
                await self.rediscover(h, "it came back after failing health checks")
            if not h.state.available:
                log.warning("worker %s is healthy again: re-admitted", h.name)
            h.state.available = True
            return
        h.failures += 1
        h.last_error = why
        if h.failures >= EJECT_AFTER_FAILURES and h.state.available:
            log.error("worker %s ejected: %s", h.name, why)
            h.state.available = False

    def eject(self, name: str, why: str) -> None:
        """A request could not connect: stop routing there until a health check passes."""
        h = self.handles.get(name)
        if h is not None and h.state.available:
            log.error("worker %s ejected: %s", name, why)
            h.state.available = False
            h.failures = EJECT_AFTER_FAILURES
            h.last_error = why

    async def refresh_modes(self) -> None:
        """Every second: modes follow event health, and broken workers are logged (at most
        once a minute each) whether or not anyone polls /health."""
        for h in self.handles.values():
            self.refresh_mode(h)
        self.log_problems([self.worker_report(h) for h in self.handles.values()])

    def refresh_mode(self, h: WorkerHandle) -> None:
        """auto: events while they flow, approximate otherwise (and /health says so)."""
        if h.mode_setting == APPROX:
            h.state.mode = APPROX
            return
        if h.mode_setting == EVENTS:
            h.state.mode = EVENTS
            return
        report = h.state.health.report() if h.state.health else None
        flowing = h.task is not None and (
            report is None or report.state not in (EventHealth.NO_EVENTS, EventHealth.STALE)
        )
        h.state.mode = EVENTS if flowing else APPROX

    # ---- verdicts --------------------------------------------------------------------

    def worker_report(self, h: WorkerHandle) -> dict[str, Any]:
        report = h.state.health.report() if h.state.health else None
        problems = dict(h.problems)
        for i, err in enumerate(report.errors if report else ()):
            problems[f"events_{i}"] = err
        event_state = (
            "DISABLED"
            if h.mode_setting == APPROX
            else (report.state.value if report else "UNKNOWN")
        )
        status = "ok"
        if not h.state.available:
            status = "unavailable"
        elif h.mode_setting != APPROX and (
            (report is not None and report.state in (EventHealth.NO_EVENTS, EventHealth.STALE))
            or "events" in problems
        ):
            status = "degraded" if h.mode_setting == "auto" else "unhealthy"
        if status == "ok" and problems:
            status = "unhealthy"
        out: dict[str, Any] = {
            "name": h.name,
            "url": h.config.url,
            "status": status,
            "available": h.state.available,
            "mode_setting": h.mode_setting,
            "mode": h.state.mode,
            "event_health": event_state,
            "block_size": h.state.block_size,
            "capacity_blocks": h.state.capacity_blocks,
            "cached_blocks": self.core.index.entries_of(h.name),
            "events_endpoint": h.source.endpoint if h.source else None,
            "replay_endpoint": h.source.replay_endpoint if h.source else None,
            "problems": list(problems.values()),
        }
        if report is not None and h.mode_setting != APPROX:
            out["reason"] = report.reason
            if report.fix:
                out["fix"] = report.fix
        if h.ingest is not None:
            c = h.ingest.counters
            out["events"] = {
                "batches": c.batches,
                "gaps": c.gaps,
                "replays": c.replays,
                "resyncs": c.resyncs,
                "restarts": c.restarts,
                "malformed": c.malformed,
                "unknown_parent": c.unknown_parent,
                "stored_blocks": c.blocks_stored,
                "removed_blocks": c.blocks_removed,
            }
            if h.subscriber is not None:
                out["events"]["connected"] = h.subscriber.status.connected
        if h.last_error and not h.state.available:
            out["last_error"] = h.last_error
        return out

    def log_problems(self, reports: list[dict[str, Any]]) -> None:
        """An ERROR line per unhealthy worker, at most once a minute each."""
        now = self.clock.now()
        for r in reports:
            if r["status"] == "ok":
                continue
            last = self._last_error_log.get(r["name"])
            if last is not None and now - last < 60:
                continue
            self._last_error_log[r["name"]] = now
            detail = "; ".join([r.get("reason", ""), *r["problems"], r.get("fix", "")]).strip("; ")
            log.error(
                "worker %s is %s: %s", r["name"], r["status"], detail or r.get("last_error", "")
            )
