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

from engines.base import EngineMetrics
from engines.vllm.discovery import parse_metrics
from router.check.httpio import Fetched, bearer, fetch
from router.check.workerfacts import WorkerFacts, group_workers, worker_of
from router.forward import RANK_HEADER

WORKER_HEADER = "x-kvroute-worker"
T = TypeVar("T")
EMPTY_TOKEN = (
    "--admin-token is empty (or KVROUTE_ADMIN_TOKEN is set to '', e.g. from an empty "
    "Secret): set it to the router's admin token, the same non-empty value kvroute serve "
    "--admin-token runs with, or unset it where the router runs without one"
)


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
        # an empty token sends no header, and the refusal that follows would blame a token
        # never given; only the router's checks send it
        empty = self.admin_token is not None and not self.admin_token.strip()
        _need(not (empty and self.router), EMPTY_TOKEN)
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


def rank_headers(rank: int | None) -> dict[str, str] | None:
    """The headers that make vLLM serve a request on `rank` (None: the engine picks)."""
    return None if rank is None else {RANK_HEADER.decode(): str(rank)}


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
        """Drained workers by the name the drain API takes: a worker's ranks drain with it."""
        names = (worker_of(str(e.get("name"))) for e in self.entries if e.get("draining"))
        return list(dict.fromkeys(names))

    @property
    def worker_count(self) -> int:
        """Workers listed; each of their data-parallel ranks is an entry of its own."""
        return len({worker_of(str(e.get("name"))) for e in self.entries})

    @property
    def policy(self) -> str | None:
        doc = self.debug.body if self.debug is not None and self.debug.ok else None
        return str(doc.get("policy")) if isinstance(doc, dict) else None

    @property
    def model(self) -> str:
        doc = self.models.body if self.models is not None and self.models.ok else None
        data = doc.get("data") if isinstance(doc, dict) else None
        return str(data[0].get("id", "")) if data and isinstance(data[0], dict) else ""


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
        self,
        w: WorkerFacts,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Fetched:
        url = w.url.rstrip("/") + path
        return await fetch(
            self.http, method, url, body=body, headers=headers, timeout=self.opts.timeout_s
        )

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
    entries = ctx.router.entries
    urls = list(ctx.opts.workers) or [str(e.get("url")) for e in entries]
    return group_workers(urls, entries, ctx.router.health_entries)


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
