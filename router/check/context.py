"""The run's options and the facts every check reads: what the router and each worker say
about themselves, fetched once up front (cheap GETs); the probes that cost something run
inside their own checks and leave what they saw here for the checks after them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import zmq.asyncio

from engines.base import EngineMetrics, EventSource
from engines.vllm.discovery import event_sources, parse_metrics
from router.check.httpio import Fetched, bearer, fetch
from router.check.zmqprobe import Observation, Reach

WORKER_HEADER = "x-kvroute-worker"
T = TypeVar("T")


class UsageError(ValueError):
    """Bad options: exit 2 with the message."""


@dataclass(frozen=True)
class Options:
    """Every option of a run, the router's checks and the gateway's alike, so that one
    `validate` judges them whichever run (`run_checks` needs `router`)."""

    router: str | None = None
    workers: tuple[str, ...] = ()
    timeout_s: float = 10.0
    skip: frozenset[str] = frozenset()
    admin_token: str | None = None
    api_key: str | None = field(default=None, repr=False)  # the workers' --api-key
    margin: float = 1.5
    pairs: int = 3
    burst: int = 8
    prompt_tokens: int = 1500
    worker_header: str = WORKER_HEADER
    gateway: str | None = None
    gateway_admin: str | None = None

    def api_headers(self) -> dict[str, str]:
        """What every call but /admin and /debug sends: the workers' key, if they have one."""
        return bearer(self.api_key)

    def validate(self) -> Options:
        _need(bool(self.router or self.gateway), "give --router URL, --gateway URL, or both")
        urls = [
            ("--router", self.router),
            ("--gateway", self.gateway),
            ("--gateway-admin", self.gateway_admin),
            *(("--worker", url) for url in self.workers),
        ]
        for flag, url in urls:
            _need(url is None or _is_http(url), f"{flag} {url!r}: give http(s)://HOST:PORT")
        _need(self.timeout_s > 0, "--timeout must be a positive number of seconds")
        _need(self.margin >= 1.0, "--margin is a speed-up ratio: 1.0 or more (e.g. 1.5)")
        _need(1 <= self.pairs <= 20, "--pairs must be 1..20")
        _need(2 <= self.burst <= 256, "--burst must be 2..256")
        _need(64 <= self.prompt_tokens <= 100_000, "--prompt-tokens must be 64..100000")
        return self


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _is_http(url: str) -> bool:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # out of range or not a number: nothing could dial it
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def worker_name(url: str) -> str:
    """host:port, as the router names a worker."""
    return urlsplit(url).netloc or url


@dataclass
class RouterFacts:
    ready: Fetched | None = None
    health: Fetched | None = None
    admin: Fetched | None = None  # GET /admin/workers before any probe
    models: Fetched | None = None
    metrics: Fetched | None = None
    debug: Fetched | None = None  # POST /debug/route of a short prompt: policy, workers

    @property
    def entries(self) -> list[dict[str, Any]]:
        doc = self.admin.body if self.admin is not None and self.admin.ok else None
        workers = doc.get("workers") if isinstance(doc, dict) else None
        return [w for w in workers or [] if isinstance(w, dict)]

    @property
    def health_entries(self) -> list[dict[str, Any]]:
        doc = self.health.body if self.health is not None else None
        workers = doc.get("workers") if isinstance(doc, dict) else None
        return [w for w in workers or [] if isinstance(w, dict)]

    @property
    def in_rotation(self) -> list[dict[str, Any]]:
        """The workers the router may pick: available, and not drained by an operator."""
        return [e for e in self.entries if e.get("available") and not e.get("draining")]

    @property
    def draining(self) -> list[str]:
        return [str(e.get("name")) for e in self.entries if e.get("draining")]

    @property
    def policy(self) -> str | None:
        doc = self.debug.body if self.debug is not None and self.debug.ok else None
        return str(doc.get("policy")) if isinstance(doc, dict) else None

    @property
    def model(self) -> str:
        doc = self.models.body if self.models is not None and self.models.ok else None
        data = doc.get("data") if isinstance(doc, dict) else None
        return str(data[0].get("id", "")) if data and isinstance(data[0], dict) else ""


@dataclass
class WorkerFacts:
    name: str
    url: str
    entry: dict[str, Any] | None = None  # the router's /admin/workers entry, before probes
    report: dict[str, Any] | None = None  # the router's /health entry
    health: Fetched | None = None
    models: Fetched | None = None
    metrics_fetch: Fetched | None = None
    metrics: EngineMetrics | None = None  # parsed from metrics_fetch
    sources: Fetched | None = None
    reach: dict[str, Reach] = field(default_factory=dict)  # endpoint -> handshake result
    observed: Observation | None = None  # what the events-flowing probe saw
    probe_seen: tuple[int, int] | None = None  # (probe blocks seen, expected)

    @property
    def reachable(self) -> bool:
        return any(f is not None and f.status is not None for f in (self.health, self.models))

    @property
    def model(self) -> str:
        card = self._card()
        return str(card.get("id", "")) if card else ""

    @property
    def max_model_len(self) -> int | None:
        card = self._card()
        value = card.get("max_model_len") if card else None
        return value if isinstance(value, int) else None

    def _card(self) -> dict[str, Any] | None:
        doc = self.models.body if self.models is not None and self.models.ok else None
        data = doc.get("data") if isinstance(doc, dict) else None
        return data[0] if data and isinstance(data[0], dict) else None

    @property
    def advertised(self) -> EventSource | None:
        """The publisher the engine names in GET /kv_event_sources, made dialable."""
        if self.sources is None or not self.sources.ok:
            return None
        found = event_sources(self.sources.body, self.url)
        return found[0] if found else None

    @property
    def mode_setting(self) -> str | None:
        """events | approx | auto as the router is configured for this worker."""
        for doc, key in ((self.report, "mode_setting"), (self.entry, "mode")):
            if doc is not None and doc.get(key):
                return str(doc[key])
        return None

    @property
    def router_endpoint(self) -> str | None:
        """The publisher the router subscribes to for this worker."""
        return self._entry_str("events_endpoint")

    @property
    def router_replay(self) -> str | None:
        return self._entry_str("replay_endpoint")

    def _entry_str(self, key: str) -> str | None:
        value = (self.entry or {}).get(key)
        return str(value) if value else None

    def problems(self, needle: str) -> list[str]:
        """The router's own /health problems for this worker that mention `needle`."""
        found = (self.report or {}).get("problems") or []
        return [str(p) for p in found if needle in str(p).lower()]


class Context:
    """One run: options, clients, and the facts gathered so far."""

    def __init__(self, opts: Options, http: httpx.AsyncClient, zmq_ctx: zmq.asyncio.Context):
        self.opts = opts
        self.http = http
        self.zmq = zmq_ctx
        self.router = RouterFacts()
        self.workers: list[WorkerFacts] = []
        self._once: dict[str, asyncio.Task[Any]] = {}

    async def once(self, key: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run `make` once per run, however many per-worker checks ask concurrently."""
        if key not in self._once:
            self._once[key] = asyncio.ensure_future(make())
        result: T = await self._once[key]
        return result

    @property
    def base(self) -> str:
        assert self.opts.router is not None  # run_checks refuses options without a router
        return self.opts.router.rstrip("/")

    def admin_headers(self) -> dict[str, str]:
        return bearer(self.opts.admin_token)

    async def router_call(self, method: str, path: str, body: Any = None) -> Fetched:
        headers = self.admin_headers() if path.startswith(("/admin", "/debug")) else None
        return await fetch(
            self.http,
            method,
            self.base + path,
            body=body,
            headers=headers,
            timeout=self.opts.timeout_s,
        )

    async def worker_call(
        self, w: WorkerFacts, method: str, path: str, body: Any = None
    ) -> Fetched:
        url = w.url.rstrip("/") + path
        return await fetch(self.http, method, url, body=body, timeout=self.opts.timeout_s)

    @property
    def model(self) -> str:
        return self.router.model or next((w.model for w in self.workers if w.model), "")

    async def count_tokens(self, w: WorkerFacts, prompt: str) -> list[int] | None:
        """The worker's own tokenization of a completion prompt (None: no /tokenize)."""
        got = await self.worker_call(w, "POST", "/tokenize", {"model": w.model, "prompt": prompt})
        tokens = got.body.get("tokens") if got.ok and isinstance(got.body, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def router_metrics(self) -> Fetched:
        return await self.router_call("GET", "/metrics")


async def load_router(ctx: Context) -> None:
    r = ctx.router
    r.health = await ctx.router_call("GET", "/health")
    if r.health.status is None:
        return  # unreachable: the run stops here
    r.ready, r.admin, r.models, r.metrics, r.debug = await asyncio.gather(
        ctx.router_call("GET", "/ready"),
        ctx.router_call("GET", "/admin/workers"),
        ctx.router_call("GET", "/v1/models"),
        ctx.router_metrics(),
        ctx.router_call("POST", "/debug/route", {"prompt": "router-check"}),
    )


def worker_list(ctx: Context) -> list[WorkerFacts]:
    """--worker URLs if given, else the router's own list."""
    entries = {
        str(e.get("name") or worker_name(str(e.get("url", "")))): e for e in ctx.router.entries
    }
    reports = {str(e.get("name")): e for e in ctx.router.health_entries}
    urls = list(ctx.opts.workers) or [str(e.get("url")) for e in entries.values()]
    out = []
    for url in urls:
        name = worker_name(url)
        out.append(WorkerFacts(name, url, entries.get(name), reports.get(name)))
    return out


async def load_worker(ctx: Context, w: WorkerFacts) -> None:
    w.health, w.models, w.metrics_fetch, w.sources = await asyncio.gather(
        ctx.worker_call(w, "GET", "/health"),
        ctx.worker_call(w, "GET", "/v1/models"),
        ctx.worker_call(w, "GET", "/metrics"),
        ctx.worker_call(w, "GET", "/kv_event_sources"),
    )
    w.metrics = _parse(w.metrics_fetch)


def _parse(f: Fetched | None) -> EngineMetrics | None:
    if f is None or not f.ok:
        return None
    try:
        return parse_metrics(f.text)
    except ValueError:
        return None
