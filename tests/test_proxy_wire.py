"""The proxy on the wire, against a worker on real uvicorn (the server vLLM runs) that records
what reached it: the request target as the client encoded it, interim answers, a worker
leaving the list mid-request, a stream that hangs after its head, a client that hangs up
while its request is being decided."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest

from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.proxy import request_target
from router.tokenize import PACKAGED_TOKENIZER
from router.upstream import Timeouts, UpstreamPool

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[Any, Any, Any, bytes], Awaitable[None]]


class Worker:
    """A vLLM-shaped worker: /v1/models, /health and /metrics answered; every other request
    recorded (method, raw target, body length) and answered with what it saw, unless a
    handler for its path says otherwise."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, int]] = []
        self.handlers: dict[str, Handler] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/models":
            return await _json(send, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        if path == "/metrics":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        if path in ("/health", "/kv_event_sources"):
            return await _json(send, {})
        query = scope["query_string"]
        target = scope["raw_path"] + (b"?" + query if query else b"")
        self.seen.append((scope["method"], target, len(body)))
        handler = self.handlers.get(path)
        if handler is not None:
            return await handler(scope, receive, send, body)
        await _json(send, {"target": target.decode(), "len": len(body)})


async def _json(send: Any, doc: Any, status: int = 200) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


@asynccontextmanager
async def fleet(**config: Any) -> AsyncIterator[tuple[RouterApp, str, Worker]]:
    worker = Worker()
    config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
    config.setdefault("health_check_interval_s", 0.3)
    config.setdefault("scrape_interval_s", 0.3)
    async with AsyncExitStack() as stack:
        worker_url = await stack.enter_async_context(serve_in_process(worker))
        app = RouterApp(Config(workers=(WorkerConfig(worker_url, mode="approx"),), **config))
        url = await stack.enter_async_context(serve_in_process(app))
        for _ in range(100):
            if all(h.available and h.discovered for h in app.pool.handles.values()):
                break
            await asyncio.sleep(0.05)
        yield app, url, worker


async def raw_exchange(url: str, request: bytes, wait: float = 1.0) -> bytes:
    """Send bytes as they are (no client library cleans them) and read what comes back."""
    host, port = url.rsplit("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        out = b""
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), wait)
            except TimeoutError:
                return out
            if not chunk:
                return out
            out += chunk
    finally:
        writer.close()


def test_the_target_is_forwarded_as_the_client_encoded_it() -> None:
    scope = {"path": "/v1/files/a?b", "raw_path": b"/v1/files/a%3Fb", "query_string": b"x=1"}
    assert request_target(scope) == b"/v1/files/a%3Fb?x=1"
    # an ASGI server that gives no raw path: the decoded one is encoded again
    assert request_target({"path": "/x\r\nhost: a", "query_string": b""}) == b"/x%0D%0Ahost%3A%20a"


async def test_an_encoded_line_break_cannot_smuggle_a_request() -> None:
    async with fleet() as (_, url, worker), httpx.AsyncClient(base_url=url) as client:
        evil = (
            b"GET /v1/x%20HTTP/1.1%0D%0Ahost:%20w%0D%0A%0D%0AGET%20/v1/smuggled HTTP/1.1\r\n"
            b"host: router\r\n\r\n"
        )
        await raw_exchange(url, evil, wait=0.5)
        r = await client.get("/v1/innocent")
        assert r.status_code == 200 and r.json()["target"] == "/v1/innocent"
        r = await client.get("/v1/files/a%3Fb")
        assert r.json()["target"] == "/v1/files/a%3Fb"
        targets = [t for _, t, _ in worker.seen if t != b"/tokenize"]  # discovery's probe
        assert b"/v1/smuggled" not in targets
        assert targets[0].startswith(b"/v1/x%20HTTP/1.1%0D%0A")


async def test_expect_100_continue_answers_the_right_client() -> None:
    async def slow(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await asyncio.sleep(0.2)  # the interim answer goes out alone, well before this one
        await _json(send, {"target": "/v1/embeddings", "len": len(body)})

    async with fleet() as (_, url, worker), httpx.AsyncClient(base_url=url) as client:
        worker.handlers["/v1/embeddings"] = slow
        body = json.dumps({"model": "m", "input": "x" * 2000}).encode()
        head = (
            b"POST /v1/embeddings HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        out = await raw_exchange(url, head + body)
        final = out.split(b"\r\n\r\n", 1)[1] if out.startswith(b"HTTP/1.1 100") else out
        assert final.startswith(b"HTTP/1.1 200"), out[:200]
        assert json.loads(final.split(b"\r\n\r\n", 1)[1])["target"] == "/v1/embeddings"
        r = await client.post("/v1/other", json={"model": "m"})
        assert r.json()["target"] == "/v1/other"
        assert [t for _, t, _ in worker.seen if t != b"/tokenize"] == [
            b"/v1/embeddings",
            b"/v1/other",
        ]


@asynccontextmanager
async def raw_upstream(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[UpstreamPool, int]]:
    """A server that answers with the bytes `answer` writes (what uvicorn will not send),
    and the router's upstream pool to ask it with."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    pool = UpstreamPool(2.0, Timeouts(2.0, 2.0, 2.0))
    try:
        yield pool, server.sockets[0].getsockname()[1]
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


async def test_an_interim_answer_is_skipped_for_the_final_one() -> None:
    async def early_hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # two requests on one kept-alive connection
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)  # the final answer comes later, in its own packet
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nreal")
            await writer.drain()
        writer.close()

    async with raw_upstream(early_hints) as (pool, port):
        for _ in range(2):
            resp = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
            assert resp.status == 200 and await resp.read() == b"real"
        assert pool.connects_on_request == 1


async def test_a_body_that_ends_with_the_connection_is_whole() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"ok": true}')
        await writer.drain()
        writer.close()

    async with raw_upstream(until_close) as (pool, port):
        resp = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
        assert await resp.read() == b'{"ok": true}'


async def test_a_worker_removed_mid_request_still_answers_and_counts_clean() -> None:
    async def slow(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await asyncio.sleep(0.5)
        await _json(send, {"choices": [{"text": "the answer"}]})

    async with fleet() as (app, url, worker), httpx.AsyncClient(base_url=url) as client:
        worker.handlers["/v1/completions"] = slow
        name = next(iter(app.fleet.workers))
        config = app.pool.handles[name].config
        payload = {"model": "m", "prompt": "x"}
        sent = asyncio.create_task(client.post("/v1/completions", json=payload))
        await asyncio.sleep(0.2)
        await app.pool.set_workers(())  # scaled down while it computes
        await app.pool.set_workers((config,))  # and back, at the same address
        r = await sent
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "the answer"
        load = app.fleet.load.known(name)
        assert (load.requests, load.prefill_tokens, load.decode_blocks) == (0, 0, 0)


async def test_a_stream_that_hangs_after_its_head_counts_as_a_timeout() -> None:
    async def hangs(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        while (await receive())["type"] != "http.disconnect":
            pass  # hung until the router gives up on it

    async with (
        fleet(first_byte_timeout_s=0.3, eject_after_timeouts=2) as (app, url, worker),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        worker.handlers["/v1/completions"] = hangs
        h = next(iter(app.pool.handles.values()))
        for _ in range(2):
            payload = {"model": "m", "prompt": "hello", "stream": True}
            async with client.stream("POST", "/v1/completions", json=payload) as resp:
                text = (await resp.aread()).decode()
            assert '"error"' in text
        assert not h.available


async def test_a_client_gone_while_its_request_is_decided_never_reaches_the_worker() -> None:
    async def slow_tokenize(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        await asyncio.sleep(0.6)  # a busy API server tokenizing for the router
        await _json(send, {"tokens": list(range(30)), "count": 30})

    async with fleet(tokenizer=None) as (_, url, worker):
        worker.handlers["/tokenize"] = slow_tokenize
        body = json.dumps({"model": "m", "prompt": "hi there", "stream": True}).encode()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        asked = len(worker.seen)
        await raw_exchange(url, head + body, wait=0.2)  # hangs up while /tokenize runs
        await asyncio.sleep(1.0)
        assert [t for _, t, _ in worker.seen[asked:]] == [b"/tokenize"]


async def test_a_retry_skips_a_runner_up_taken_out_of_rotation_since() -> None:
    """The failure that ejects the first choice ejects every rank of its worker, and ranks
    rank side by side: the retry must go to a worker still in rotation."""
    async with fleet() as (app, _, _):
        from router.openai_req import parse
        from router.proxy import _Request

        rin = parse("completion", b'{"model": "m", "prompt": "hello there"}')
        decision = await app.routing.decide(rin)
        (only,) = decision.ranked
        request = _Request(decision, rin, b"POST", b"/v1/completions", [], b"", b"id", 0.0, {})
        app.fleet.workers[only.worker].available = False  # ejected meanwhile
        assert await app.proxy._next_choice(request, set()) is None
        app.fleet.workers[only.worker].available = True
        app.fleet.workers[only.worker].draining = True
        assert await app.proxy._next_choice(request, set()) is None


async def test_a_stream_cut_mid_event_gets_its_error_as_an_event_of_its_own() -> None:
    async def half_an_event(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        part = b'data: {"choices": [{"text": "half'  # the worker stalls mid-event
        await send({"type": "http.response.body", "body": part, "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass

    async with (
        fleet(inter_chunk_timeout_s=0.3) as (_app, url, worker),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        worker.handlers["/v1/completions"] = half_an_event
        payload = {"model": "m", "prompt": "hello", "stream": True}
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            events = (await resp.aread()).decode().split("\n\n")
    # the cut event stays broken, but the error after it parses on its own
    data = [e.removeprefix("data: ") for e in events if e.strip()]
    assert data[-1] == "[DONE]", data
    assert json.loads(data[-2])["error"]["code"] == 502, data


async def test_a_byte_stream_cut_by_its_worker_reaches_the_client_cut() -> None:
    """A body with no in-band end (vLLM's `encoding_format: "bytes"` embeddings answer): a
    worker dying mid-body must leave the client a truncated transfer, not a short body
    ending cleanly as if complete."""

    async def dies(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        head = [(b"content-type", b"application/octet-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for _ in range(2):
            await send({"type": "http.response.body", "body": b"\x01" * 1024, "more_body": True})
            await asyncio.sleep(0.05)
        raise RuntimeError("the worker dies mid-body")  # uvicorn drops the connection

    async with (
        fleet() as (_, url, worker),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        worker.handlers["/v1/embeddings"] = dies
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):
            payload = {"model": "m", "input": "hi", "encoding_format": "bytes"}
            async with client.stream("POST", "/v1/embeddings", json=payload) as resp:
                assert resp.status_code == 200
                async for chunk in resp.aiter_raw():
                    got += chunk
        assert got == b"\x01" * 2048  # what came before the cut, relayed
        # the router goes on serving
        assert (await client.get("/health")).status_code == 200


async def test_a_redirect_the_worker_points_at_itself_comes_back_as_a_path() -> None:
    """vLLM answers `POST /v1/completions/` with a 307 to its own absolute address: passed
    through, it names an internal address and sends the client past the router."""

    async def redirects(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        host, port = scope["server"]
        elsewhere = scope["path"].endswith("/away")
        target = (
            b"https://example.com/x"
            if elsewhere
            else b"http://%s:%d/v1/completions?a=1"
            % (
                host.encode(),
                port,
            )
        )
        head = [(b"location", target), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 307, "headers": head})
        await send({"type": "http.response.body", "body": b""})

    async with (
        fleet() as (_, url, worker),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        worker.handlers["/v1/completions/"] = redirects
        worker.handlers["/v1/away"] = redirects
        resp = await client.post("/v1/completions/", json={"model": "m", "prompt": "hi"})
        assert resp.status_code == 307
        assert resp.headers["location"] == "/v1/completions?a=1"
        resp = await client.post("/v1/away", json={"model": "m"})
        assert resp.headers["location"] == "https://example.com/x"  # not the worker's: kept
