"""Scripted stand-ins for a prefill and a decode worker, for the P/D door's protocol and
failure tests: they record every request (body and headers) and answer as told. Real
handoffs (real NIXL between simulated workers) are tested in test_pd_router.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.app import RouterApp
from router.asgi import Receive, Scope, Send, read_body, send_bytes, send_json
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

BLOCK = 16


def good_params(n_blocks: int, rid: str = "cmpl-x-0-abc") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(1, n_blocks + 1))],
        "remote_engine_id": "engine-p",
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


@dataclass
class Seen:
    body: dict[str, Any]
    headers: dict[str, str]
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the client disconnected


Handler = Callable[["FakeWorker", Seen, Send], Awaitable[None]]


class FakeWorker:
    """A vLLM-shaped worker: /health, /v1/models, /metrics (cache config and the P/D
    counters it is told), and POST /v1/completions|/v1/chat/completions by `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[Seen] = []
        self.external_tokens = 0.0
        self.local_tokens = 0.0
        self.nixl_bytes = 0.0
        self.generating = False  # its engine generates for other requests: the count climbs
        self.generated = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await send_json(send, 200, {})
        elif path == "/v1/models":
            await send_json(send, 200, {"data": [{"id": "m", "max_model_len": 100_000}]})
        elif path == "/metrics":
            await send_bytes(send, 200, self.metrics().encode(), b"text/plain")
        elif path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(await read_body(receive, 1 << 24))
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            seen = Seen(body, headers)
            self.seen.append(seen)
            watch = asyncio.ensure_future(_watch(receive, seen))
            try:
                await self.handler(self, seen, send)
            finally:
                watch.cancel()
        else:
            await send_json(send, 404, {"error": "no"})

    def metrics(self) -> str:
        self.generated += 100 if self.generating else 0
        return (
            f"vllm:generation_tokens_total {self.generated}\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="4000",'
            f'enable_prefix_caching="True"}} 1.0\n'
            f'vllm:prompt_tokens_by_source_total{{source="external_kv_transfer"}} '
            f"{self.external_tokens}\n"
            f'vllm:prompt_tokens_by_source_total{{source="local_compute"}} {self.local_tokens}\n'
            f"vllm:nixl_bytes_transferred_sum {self.nixl_bytes}\n"
            f"vllm:nixl_bytes_transferred_count {1.0 if self.nixl_bytes else 0.0}\n"
            f"vllm:nixl_xfer_time_seconds_sum {self.nixl_bytes / 1e9}\n"
        )


async def _watch(receive: Receive, seen: Seen) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    seen.gone.set()


# ---- handlers -------------------------------------------------------------------------------


def prefill_ok(params: Callable[[Seen], Any] | None = None) -> Handler:
    async def handle(w: FakeWorker, seen: Seen, send: Send) -> None:
        n = max(len(json.dumps(seen.body)), 64)  # characters: more than tokens
        out = params(seen) if params else good_params(n // BLOCK + 4)
        doc = {"choices": [{"text": "a"}], "kv_transfer_params": out}
        await send_json(send, 200, doc)

    return handle


def prefill_status(status: int) -> Handler:
    async def handle(w: FakeWorker, seen: Seen, send: Send) -> None:
        await send_json(send, status, {"error": {"message": "boom"}})

    return handle


def prefill_hangs() -> Handler:
    async def handle(w: FakeWorker, seen: Seen, send: Send) -> None:
        await seen.gone.wait()

    return handle


def decode_stream(
    pull: bool = True, delay_s: float = 0.0, tokens: int = 3, die_after: int | None = None
) -> Handler:
    """SSE chunks; `pull`: count the prompt as pulled (else recomputed) in the metrics;
    `delay_s` before the first chunk (a pull on a slow link); `die_after` chunks, then the
    connection drops."""

    async def handle(w: FakeWorker, seen: Seen, send: Send) -> None:
        params = seen.body.get("kv_transfer_params")
        # whole blocks: the prompt, at least
        n = len(params["remote_block_ids"][0]) * BLOCK if params else 200
        if pull and params:
            w.external_tokens += n
            w.nixl_bytes += n * 1024
        else:
            w.local_tokens += n  # recomputed: the whole prompt
        await asyncio.sleep(delay_s)
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(tokens):
            if die_after is not None and i >= die_after:
                raise RuntimeError("worker died mid-stream")
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return handle


def decode_waits_for_client() -> Handler:
    async def handle(w: FakeWorker, seen: Seen, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunk = b'data: {"choices":[{"index":0,"text":"t"}]}\n\n'
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await seen.gone.wait()

    return handle


# ---- a router in front of them ----------------------------------------------------------------


@dataclass
class PDSetup:
    prefill: FakeWorker
    decode: FakeWorker
    app: RouterApp
    client: httpx.AsyncClient
    names: dict[str, str]

    async def metric(self, prefix: str) -> float:
        text = (await self.client.get("/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
        )


@asynccontextmanager
async def closing_worker() -> AsyncIterator[str]:
    """A decode worker whose engine dies with each request: it answers the router's GETs
    as a FakeWorker does and drops the connection of every POST once it has read it."""
    page = FakeWorker(prefill_status(500))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split(" ", 2)
                length = next(
                    (int(v) for k, _, v in (h.partition(":") for h in head.split("\r\n"))
                     if k.lower() == "content-length"),
                    0,
                )  # fmt: skip
                await reader.readexactly(length)
                if method == "POST":
                    writer.transport.abort()
                    return
                if path == "/metrics":
                    out, ctype = page.metrics().encode(), b"text/plain"
                elif path == "/v1/models":
                    out = json.dumps({"data": [{"id": "m", "max_model_len": 100_000}]}).encode()
                    ctype = b"application/json"
                else:
                    out, ctype = b"{}", b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                    % (ctype, len(out), out)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@asynccontextmanager
async def pd_router(
    prefill: Handler, decode: Handler, more_decode: tuple[str, ...] = (), **config: Any
) -> AsyncIterator[PDSetup]:
    """A router over a scripted prefill and decode worker (and `more_decode` worker URLs)."""
    p, d = FakeWorker(prefill), FakeWorker(decode)
    async with serve_in_process(p) as p_url, serve_in_process(d) as d_url:
        workers = (
            WorkerConfig(p_url, role="prefill"),
            WorkerConfig(d_url, role="decode"),
            *(WorkerConfig(u, role="decode") for u in more_decode),
        )
        config = {
            "tokenizer": str(PACKAGED_TOKENIZER),
            "mode": "approx",
            "pd_threshold": "0",
            "pd_probe": False,
            "admin_insecure": True,
            "health_check_interval_s": 0.3,
            **config,
        }
        app = RouterApp(Config(workers=workers, **config))
        app.pd.verifier.interval_s = 0.05
        async with (
            serve_in_process(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            names = {"prefill": p_url.split("//")[1], "decode": d_url.split("//")[1]}
            yield PDSetup(p, d, app, client, names)
