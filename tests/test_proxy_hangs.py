"""Hung, busy and slow parties on the proxy's request path, on the wire: workers on real
uvicorn (the server vLLM runs), the router on kvroute's own server, clients on sockets.

A busy engine is not a hung one; a hung API server's data-parallel ranks are hung together;
a client that stops reading lets go of its request."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from test_proxy_wire import Worker, _json

from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)

SSE = [(b"content-type", b"text/event-stream")]
TCP_CLOSE = 7  # a socket's state in TCP_INFO once its peer reset it (Linux)


class Engine(Worker):
    """The test worker with an engine behind it: its /metrics count generated tokens (they
    climb at every scrape while `generating`), and it may run data-parallel `ranks`."""

    def __init__(self, ranks: int = 0) -> None:
        super().__init__()
        self.generating = False
        self.tokens = 0
        self.ranks = ranks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if path == "/metrics":
            self.tokens += 100 if self.generating else 0
            text = b'vllm:generation_tokens_total{model_name="m"} %d\n' % self.tokens
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": text})
            return
        if path == "/kv_event_sources" and self.ranks:
            while (await receive()).get("more_body"):
                pass
            doc = [
                {"data_parallel_rank": r, "endpoint": "tcp://127.0.0.1:1", "topic": ""}
                for r in range(self.ranks)
            ]
            return await _json(send, doc)
        await super().__call__(scope, receive, send)


@asynccontextmanager
async def fleet(*engines: Engine, **config: Any) -> AsyncIterator[tuple[RouterApp, str]]:
    """The router in front of `engines`; yields it and its URL. Engines with ranks are
    discovered as data-parallel workers, the others are approximate."""
    config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
    config.setdefault("health_check_interval_s", 0.3)
    config.setdefault("scrape_interval_s", 0.1)
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_in_process(e)) for e in engines]
        workers = tuple(
            WorkerConfig(u) if e.ranks else WorkerConfig(u, mode="approx")
            for u, e in zip(urls, engines, strict=True)
        )
        app = RouterApp(Config(workers=workers, **config))
        url = await stack.enter_async_context(serve_in_process(app))
        for _ in range(100):
            if all(h.available and h.discovered for h in app.pool.handles.values()):
                break
            await asyncio.sleep(0.05)
        yield app, url


def watch_hangup(receive: Any, saw: asyncio.Event) -> asyncio.Task[None]:
    """A worker's side of a request: `saw` is set once the router lets go of it."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        saw.set()

    return asyncio.create_task(watch())


async def let_go(app: RouterApp, name: str, worker_saw_hangup: asyncio.Event) -> None:
    """The router let go of the one request the client hung up on: the worker was told, its
    load is back to none, and it counts as the client's hang-up."""
    await asyncio.wait_for(worker_saw_hangup.wait(), 10)
    for _ in range(100):
        if app.fleet.load.known(name).requests == 0:
            break
        await asyncio.sleep(0.05)
    assert app.fleet.load.known(name).requests == 0
    assert outcomes(app) == {"client_disconnected": 1}


def completion(prompt: str = "hello") -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "stream": True}


@pytest.mark.parametrize(
    ("generating", "ejected"),
    [
        pytest.param(True, False, id="busy-engine-stays"),
        pytest.param(False, True, id="hung-engine-ejected"),
    ],
)
async def test_a_stream_queued_past_the_first_byte_timeout_counts_only_on_an_idle_engine(
    generating: bool, ejected: bool
) -> None:
    """vLLM sends a stream's head at once; a stream queued behind a busy batch then waits
    past the first-byte timeout while the engine generates for the others."""

    async def queued(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await asyncio.sleep(1.0)  # its first token comes after the timeout
        await send({"type": "http.response.body", "body": b"data: {}\n\ndata: [DONE]\n\n"})

    engine = Engine()
    engine.generating = generating
    engine.handlers["/v1/completions"] = queued
    async with (
        fleet(engine, first_byte_timeout_s=0.5, eject_after_timeouts=2) as (app, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        h = next(iter(app.pool.handles.values()))
        for _ in range(2):
            await client.post("/v1/completions", json=completion())
        assert h.available is not ejected
        assert (h.timeouts == 0) is generating


@pytest.mark.parametrize("breaks_off", [False, True], ids=["hangs", "closes-after-its-head"])
async def test_a_retry_after_a_timeout_skips_the_ranks_behind_the_same_server(
    breaks_off: bool,
) -> None:
    """Data-parallel ranks share one API server: when it hangs, or crashes and closes every
    stream it held before their first chunk, the retry must leave it."""
    tried: list[str] = []

    async def hangs(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        tried.append("ranked")
        if breaks_off:
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            raise RuntimeError("the server went down")
        while (await receive())["type"] != "http.disconnect":
            pass  # no head, ever

    async def answers(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        tried.append("other")
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b"data: {}\n\ndata: [DONE]\n\n"})

    ranked, other = Engine(ranks=2), Engine()
    ranked.handlers["/v1/completions"] = hangs
    other.handlers["/v1/completions"] = answers
    async with (
        fleet(ranked, other, first_byte_timeout_s=0.3, eject_after_timeouts=100) as (app, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        assert len(app.fleet.workers) == 3
        first_hung = 0
        for i in range(4):
            tried.clear()
            r = await client.post("/v1/completions", json=completion(f"request {i} " * 20))
            assert r.status_code == 200 and tried[-1] == "other", tried
            assert tried.count("ranked") <= 1
            first_hung += tried[0] == "ranked"
        assert first_hung  # the case under test came up


def outcomes(app: RouterApp) -> dict[str, float]:
    """kvroute_requests_total by outcome."""
    out: dict[str, float] = {}
    for family in app.metrics.registry.collect():
        for s in family.samples:
            if s.name == "kvroute_requests_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out


async def test_a_client_that_stops_reading_is_hung_up_on() -> None:
    """Its request, its load and the worker's connection are let go, and the engine is told."""
    worker_saw_hangup = asyncio.Event()

    async def floods(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        watching = watch_hangup(receive, worker_saw_hangup)
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        chunk = b"data: " + b"x" * 65536 + b"\n\n"
        while not worker_saw_hangup.is_set():  # a long answer, until the router lets go
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await watching

    engine = Engine()
    engine.handlers["/v1/completions"] = floods
    async with fleet(engine, inter_chunk_timeout_s=0.5) as (app, url):
        name = next(iter(app.fleet.workers))
        host, port = url.rsplit("//", 1)[1].split(":")
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        body = json.dumps(completion()).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n"
        client.sendall(head % len(body) + body)  # and never reads
        try:
            await let_go(app, name, worker_saw_hangup)
            for _ in range(100):  # and its connection is reset, not left open for it to drain
                if client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE:
                    break
                await asyncio.sleep(0.05)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE
        finally:
            client.close()


async def test_a_stream_whose_worker_hangs_after_its_head_goes_to_another_worker() -> None:
    """vLLM sends a stream's head before its engine produced anything; nothing reached the
    client when the engine hangs behind it, so the request is retried, not cut."""
    tried: list[str] = []

    async def head_then_hangs(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        tried.append("hung")
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        while (await receive())["type"] != "http.disconnect":
            pass

    async def answers(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        tried.append("other")
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b'data: {"i": 0}\n\n', "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    hung, other = Engine(), Engine()
    hung.handlers["/v1/completions"] = head_then_hangs
    other.handlers["/v1/completions"] = answers
    async with (
        fleet(hung, other, first_byte_timeout_s=0.3, eject_after_timeouts=100) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        first_hung = 0
        for i in range(4):
            tried.clear()
            r = await client.post("/v1/completions", json=completion(f"request {i} " * 20))
            assert r.status_code == 200, r.text
            assert r.text == 'data: {"i": 0}\n\ndata: [DONE]\n\n', tried
            first_hung += tried[0] == "hung"
        assert first_hung  # the case under test came up


async def test_a_stream_closed_before_its_first_chunk_is_retried_and_spares_the_others() -> None:
    """A stream closed after its head and before its first chunk (a generator that raised,
    a proxy's idle timeout in between) failed there alone: it is served elsewhere, and the
    worker keeps its other streams and its place in rotation."""

    async def streams(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        prompt = json.loads(body)["prompt"]
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if prompt.startswith("breaks"):
            raise RuntimeError("the request failed after its head")
        for i in range(6):
            chunk = b'data: {"i": %d}\n\n' % i
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    engines = Engine(), Engine()
    for e in engines:
        e.handlers["/v1/completions"] = streams
    async with (
        fleet(*engines, admin_insecure=True) as (app, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):

        async def long(prompt: str) -> str:
            async with client.stream("POST", "/v1/completions", json=completion(prompt)) as r:
                return (await r.aread()).decode()

        running = [asyncio.create_task(long(f"long {i} " * 20)) for i in range(4)]
        await asyncio.sleep(0.15)  # every worker runs one of them
        for i in range(4):
            r = await client.post("/v1/completions", json=completion(f"breaks {i} " * 20))
            assert r.status_code == 502, r.text  # every worker breaks it: nothing was sent
        for body in await asyncio.gather(*running):
            assert body.endswith("data: [DONE]\n\n") and "error" not in body, body
        assert all(h.available for h in app.pool.handles.values())
        # the engines stored nothing for them: nothing is believed of their prompts
        route = await client.post("/debug/route", json={"model": "m", "prompt": "breaks 0 " * 20})
        assert all(w["overlap_blocks"] == 0 for w in route.json()["workers"]), route.json()
        retried = app.metrics.retries.collect()[0].samples
        assert sum(s.value for s in retried if s.name.endswith("_total")) >= 4


async def test_a_client_that_pipelined_a_request_and_hung_up_is_let_go() -> None:
    """The pipelined request's cycle takes the running one's place in the server: the
    hang-up must still reach the stream running."""
    worker_saw_hangup = asyncio.Event()

    async def streams(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        watching = watch_hangup(receive, worker_saw_hangup)
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for _ in range(100):  # a 10 s answer
            if worker_saw_hangup.is_set():
                break
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            await asyncio.sleep(0.1)
        watching.cancel()

    engine = Engine()
    engine.handlers["/v1/completions"] = streams
    async with fleet(engine) as (app, url):
        name = next(iter(app.fleet.workers))
        host, port = url.rsplit("//", 1)[1].split(":")
        body = json.dumps(completion()).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n"
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head % len(body) + body)
        await reader.readuntil(b"data: {}\n\n")
        writer.write(head % len(body) + body)  # the next request, before the answer ended
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await let_go(app, name, worker_saw_hangup)


async def test_an_event_stream_on_another_path_late_to_its_first_chunk_says_which_timeout() -> None:
    """A path kvroute passes through may answer an event stream though the request did not
    ask to stream: its first chunk waits the inter-chunk timeout, and the 504 names it."""

    async def late(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await asyncio.sleep(1.0)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    engine = Engine()
    engine.handlers["/v1/responses"] = late
    async with (
        fleet(engine, inter_chunk_timeout_s=0.3, eject_after_timeouts=100) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        r = await client.post("/v1/responses", json={"model": "m", "input": "hello"})
        assert r.status_code == 504, r.text
        assert "--inter-chunk-timeout" in r.json()["error"]["message"], r.text


async def test_a_stream_no_worker_answered_in_time_is_a_gateway_timeout() -> None:
    """Every try waited out the first-byte timeout: a 504 naming it, not a 502."""

    async def hangs(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # no head, ever

    engines = Engine(), Engine()
    for e in engines:
        e.handlers["/v1/completions"] = hangs
    async with (
        fleet(*engines, first_byte_timeout_s=0.3, eject_after_timeouts=100) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 504, r.text
        assert "--first-byte-timeout" in r.json()["error"]["message"], r.text
