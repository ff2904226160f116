"""A worker that accepts connections and never answers (an engine wedged behind its API
server, a black-holed address) must not hold the router's start-up: until start-up ends,
nothing answers, not even /live, and a liveness probe would restart the router for as long
as the worker stays hung."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)


async def test_a_hung_worker_does_not_hold_start_up() -> None:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # open, silent

    hung = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    hung_port = hung.sockets[0].getsockname()[1]
    try:
        async with run_fleet(1, SimConfig(block_size=16, kv_blocks=256)) as fleet:
            workers = (WorkerConfig(f"http://127.0.0.1:{hung_port}"), WorkerConfig(fleet.urls[0]))
            app = RouterApp(Config(workers=workers, tokenizer=str(PACKAGED_TOKENIZER)).validate())
            started = time.monotonic()
            async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
                assert time.monotonic() - started < 10  # not the hung worker's timeouts
                assert (await client.get("/live", timeout=5)).status_code == 200
                body = {"model": "kvroute-sim", "prompt": "hello there", "max_tokens": 2}
                resp = await client.post("/v1/completions", json=body, timeout=30)
                assert resp.status_code == 200
                assert resp.headers["x-kvroute-worker"] == fleet.urls[0].split("//")[1]
                # the operator removes the hung worker while it is still being discovered:
                # the change does not wait out its timeouts
                started = time.monotonic()
                await app.pool.set_workers((WorkerConfig(fleet.urls[0]),))
                assert time.monotonic() - started < 3
                assert sorted(app.pool.handles) == [fleet.urls[0].split("//")[1]]
    finally:
        for writer in held:
            writer.close()
        hung.close()
        await hung.wait_closed()
