"""SIGTERM with requests still running past `--drain-timeout`: real uvicorn on loopback, a
slow simulated worker. The client of a cut request gets an answer it can parse and retry
(an OpenAI-shaped 503, or a stream that ends with an error event and [DONE]), never
uvicorn's plain-text 500 or a reset connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from engines.sim.latency import LatencyModel
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import free_port
from router.server import DrainingServer, server_config
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)

DRAIN_TIMEOUT_S = 1.0
# each decode step takes 200 ms: 100 tokens run for 20 s, far past the drain timeout
SLOW = SimConfig(block_size=16, kv_blocks=512, latency=LatencyModel(decode_ms_per_step=200.0))
BODY = {"model": "kvroute-sim", "prompt": "a slow answer", "max_tokens": 100}


class _Server(DrainingServer):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to pytest; the test calls handle_exit as a SIGTERM would


@dataclass
class Router:
    url: str
    server: _Server
    task: asyncio.Task[None]
    app: RouterApp

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    async def exited(self) -> None:
        # the drain timeout, then the moment the cut requests take to answer
        await asyncio.wait_for(asyncio.shield(self.task), DRAIN_TIMEOUT_S + 5)


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[Router]:
    async with run_fleet(1, SLOW) as fleet:
        config = Config(
            workers=tuple(WorkerConfig(u) for u in fleet.urls),
            tokenizer=str(PACKAGED_TOKENIZER),
            drain_delay_s=0.0,
            drain_timeout_s=DRAIN_TIMEOUT_S,
        )
        app = RouterApp(config)
        port = free_port()
        uv = server_config(app, "127.0.0.1", port, drain_timeout_s=DRAIN_TIMEOUT_S, loop="asyncio")
        server = _Server(uv, app.start_draining, delay_s=0.0)
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not task.done(), "the server exited before it started"
                await asyncio.sleep(0.01)
            while not app.routing.ready:
                await asyncio.sleep(0.01)
            yield Router(f"http://127.0.0.1:{port}", server, task, app)
        finally:
            server.should_exit = True
            await task


def error_of(doc: Any) -> dict[str, Any]:
    err = doc["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503, err
    assert "shutting down" in err["message"] and "drain timeout" in err["message"], err
    return dict(err)


async def test_a_request_cut_by_the_drain_timeout_gets_an_openai_503() -> None:
    async with router() as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        pending = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.5)  # forwarded: the worker is generating (headers not sent)
        assert not pending.done()
        r.sigterm()
        resp = await asyncio.wait_for(pending, DRAIN_TIMEOUT_S + 5)
        await r.exited()
    assert resp.status_code == 503
    assert resp.headers["content-type"] == "application/json"
    error_of(resp.json())
    # counted as the drain's cut, not as a client that hung up
    outcomes = outcomes_of(r.app)
    assert outcomes.get("drain_timeout") == 1 and "client_disconnected" not in outcomes, outcomes


def outcomes_of(app: RouterApp) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(app.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "kvroute_requests_total":
                outcome = sample.labels["outcome"]
                out[outcome] = out.get(outcome, 0.0) + sample.value
    return out


async def test_a_stream_cut_by_the_drain_timeout_ends_with_an_error_event() -> None:
    async with router() as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        body = {**BODY, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")  # the stream has started
            r.sigterm()
            # the rest arrives and the body ends cleanly (a reset raises here)
            rest = [line async for line in lines if line]
        await r.exited()
    assert rest[-1] == "data: [DONE]"
    error_of(json.loads(rest[-2].removeprefix("data: ")))
    assert all(line.startswith("data: ") for line in rest)
    assert outcomes_of(r.app).get("drain_timeout") == 1


async def test_a_stream_cut_mid_event_ends_that_event_before_the_error() -> None:
    """The drain cuts wherever the relay was: the error must not be glued onto an event the
    worker had half sent, or the client's SSE parser reads neither."""
    from router.asgi import ResponseState, end_with_error
    from router.core.errors import ShuttingDown

    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    response = ResponseState(send)
    head = [(b"content-type", b"text/event-stream")]
    await response({"type": "http.response.start", "status": 200, "headers": head})
    await response({"type": "http.response.body", "body": b'data: {"a', "more_body": True})
    await end_with_error(response, ShuttingDown("the router was shutting down"))
    events = b"".join(sent).decode().split("\n\n")
    data = [e.removeprefix("data: ") for e in events if e.strip()]
    assert data[-1] == "[DONE]" and "shutting down" in data[-2], data
    assert response.ended
