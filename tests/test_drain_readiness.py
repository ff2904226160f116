"""An operator drains workers (POST /admin/workers/NAME/drain): while one still takes
traffic the router is ready and /health stays ok, naming the drained ones; once every
worker is drained each request would be refused, so /ready and the picker's gRPC readiness
say not ready and /health says why and what undoes it. Real router and picker, simulated
workers, on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.extproc.gie import SERVICE_NAME
from router.extproc.server import ExtProcServer
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)


@dataclass
class Router:
    client: httpx.AsyncClient
    picker: ExtProcServer
    names: list[str]

    async def drain(self, name: str, action: str = "drain") -> None:
        resp = await self.client.post(f"/admin/workers/{name}/{action}")
        assert resp.status_code == 200, resp.text
        await self.picker._publish_health()  # as its poll loop would within HEALTH_POLL_S

    async def picker_ready(self) -> bool:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.picker.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            ask = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            resp = await stub.Check(ask, timeout=5)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


@asynccontextmanager
async def router(health_details: bool = True) -> AsyncIterator[Router]:
    async with run_fleet(2) as fleet:
        workers = tuple(WorkerConfig(u) for u in fleet.urls)
        cfg = Config(
            workers=workers,
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
            health_details=health_details,
        )
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            while not app.routing.ready:
                await client.get("/ready")
            picker = ExtProcServer(app.routing, "127.0.0.1", 0)
            await picker.start()
            try:
                yield Router(client, picker, list(app.pool.handles))
            finally:
                await picker.stop(0)


async def test_draining_some_workers_keeps_the_router_ready_and_healthy() -> None:
    async with router() as r:
        await r.drain(r.names[0])
        assert (await r.client.get("/ready")).status_code == 200
        assert await r.picker_ready()
        health = await r.client.get("/health")
    doc = health.json()
    assert health.status_code == 200 and doc["status"] == "ok", doc
    assert doc["draining_workers"] == [r.names[0]] and doc["unhealthy_workers"] == []
    assert [w["draining"] for w in doc["workers"]] == [True, False]
    assert "reason" not in doc


async def test_every_worker_drained_is_not_ready_and_health_says_why() -> None:
    async with router() as r:
        for name in r.names:
            await r.drain(name)
        ready = await r.client.get("/ready")
        picker_ready = await r.picker_ready()
        health = await r.client.get("/health")
        refused = await r.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        await r.drain(r.names[1], "undrain")
        ready_again = await r.client.get("/ready")
        picker_ready_again = await r.picker_ready()
    assert ready.status_code == 503 and not picker_ready
    assert refused.status_code == 503
    doc = health.json()
    assert health.status_code == 503 and doc["status"] == "unhealthy", doc
    assert doc["draining_workers"] == r.names and "undrain" in doc["reason"]
    # drained on purpose, each worker itself is fine
    assert [w["status"] for w in doc["workers"]] == ["ok", "ok"]
    assert ready_again.status_code == 200 and picker_ready_again


async def test_without_details_health_counts_the_drained_workers() -> None:
    async with router(health_details=False) as r:
        await r.drain(r.names[0])
        doc = (await r.client.get("/health")).json()
    assert doc == {"status": "ok", "workers": {"ok": 2}, "draining_workers": 1}
