"""A simulated vLLM worker with data parallelism (`--data-parallel-size N`): N engines, each
with its own KV cache and event publisher, behind one API server, as vLLM's internal load
balancer runs them.

- A request with `X-data-parallel-rank: R` goes to rank R; without it, to the least loaded.
- `GET /kv_event_sources` lists every rank's publisher (`{rank: config}`), and each rank's
  event batches carry its `data_parallel_rank`.
- `GET /metrics` has every rank's series, told apart by vLLM's `engine` label.
- `POST /sim/cached_tokens` takes `"rank"` in its body (default 0).

Each rank is a full `SimWorker` on an internal loopback port; this front forwards to it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engines.sim.config import SimConfig
from engines.sim.worker import SimWorker, _Server

RANK_HEADER = "x-data-parallel-rank"
HOP = {"content-length", "transfer-encoding", "connection", "host"}


class DPSimWorker:
    """`data_parallel_size` ranks behind one port; the same surface as `SimWorker`."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config.validate()
        n = config.data_parallel_size
        self.ranks = [
            SimWorker(
                config.replace(
                    port=0, name=f"{config.name}-dp{r}", data_parallel_size=1, data_parallel_rank=r
                )
            )
            for r in range(n)
        ]
        # one API server in front of the ranks, as vLLM's: an adapter a LoRA resolver loaded
        # for a request to one rank is served, and listed, by all of them
        for r in self.ranks[1:]:
            r.renderer.loras = self.ranks[0].renderer.loras
        self.client: httpx.AsyncClient | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.port: int | None = None

    # the attributes tests and the fleet read from a worker, taken from rank 0
    @property
    def tokenizer(self) -> Any:
        return self.ranks[0].tokenizer

    @property
    def engine(self) -> Any:
        return self.ranks[0].engine

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        for r in self.ranks:
            await r.start()
        self.client = httpx.AsyncClient(timeout=None)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.config.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, ws="none")
        self._server, self._sock = _Server(config), sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._sock is not None:
            self._sock.close()
        if self.client is not None:
            await self.client.aclose()
        for r in self.ranks:
            await r.stop()

    def info(self) -> dict[str, Any]:
        out = self.ranks[0].info()
        out.update(
            name=self.config.name,
            url=self.url,
            port=self.port,
            data_parallel_size=len(self.ranks),
            ranks=[r.info() for r in self.ranks],
        )
        return out

    # ---- the front ---------------------------------------------------------------------

    def _app(self) -> Starlette:
        routes = [
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/kv_event_sources", self._sources, methods=["GET"]),
            Route("/sim/cached_tokens", self._cached_tokens, methods=["POST"]),
            Route("/{path:path}", self._forward, methods=["GET", "POST", "HEAD", "DELETE"]),
        ]
        return Starlette(routes=routes)

    def _pick(self, request: Request) -> SimWorker:
        raw = request.headers.get(RANK_HEADER)
        if raw is not None and raw.isdigit() and int(raw) < len(self.ranks):
            return self.ranks[int(raw)]
        return min(self.ranks, key=lambda r: r.engine.stats().running + r.engine.stats().waiting)

    async def _forward(self, request: Request) -> Response:
        assert self.client is not None
        rank = self._pick(request) if request.method == "POST" else self.ranks[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        upstream = self.client.build_request(
            request.method,
            f"{rank.url}{request.url.path}",
            params=request.query_params,
            headers=headers,
            content=await request.body(),
        )
        resp = await self.client.send(upstream, stream=True)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
        return StreamingResponse(_relay(resp), status_code=resp.status_code, headers=out_headers)

    async def _sources(self, request: Request) -> Response:
        out: dict[str, Any] = {}
        for r, rank in enumerate(self.ranks):
            pub = rank.publisher
            if pub is not None:
                out[str(r)] = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "topic": pub.config.topic,
                }
        return JSONResponse(out)

    async def _metrics(self, request: Request) -> Response:
        assert self.client is not None
        texts = [(await self.client.get(f"{r.url}/metrics")).text for r in self.ranks]
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    async def _cached_tokens(self, request: Request) -> Response:
        assert self.client is not None
        doc = json.loads(await request.body() or b"{}")
        rank = self.ranks[int(doc.pop("rank", 0))]
        resp = await self.client.post(f"{rank.url}/sim/cached_tokens", json=doc)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")


async def _relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()


def merge_metrics(texts: list[str]) -> str:
    """The ranks' expositions as one: each family once, every rank's samples in it (their
    `engine` label tells them apart)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
                entry[2].append(f"{s.name}{{{labels}}} {s.value!r}")
    lines = []
    for name, (doc, kind, samples) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *dict.fromkeys(samples)]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sim_worker(config: SimConfig) -> SimWorker:
    """A worker for this config: with data parallelism, the ranks behind one front."""
    if config.data_parallel_size > 1:
        return DPSimWorker(config)  # type: ignore[return-value]  # the same surface
    return SimWorker(config)
