"""A fast fake OpenAI backend for proxy benchmarks: raw asyncio + httptools on uvloop, fixed
answers, so that what a benchmark measures is the proxy in front of it.

    python -m router.bench.backend --port 9001 [--port 9002 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httptools
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MODEL = "kvroute-sim"
COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
        "usage": {
            "prompt_tokens": 2000,
            "completion_tokens": 1,
            "total_tokens": 2001,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
).encode()
CHAT = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 2000, "completion_tokens": 1, "total_tokens": 2001},
    }
).encode()
SSE = (
    b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"text":" ok","finish_reason":null}]}\n\n'
    b"data: [DONE]\n\n"
)
MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "owned_by": "vllm",
                "root": MODEL,
                "parent": None,
                "max_model_len": 32768,
            }
        ],
    }
).encode()


def _metrics_page() -> bytes:
    """A page shaped like vLLM 0.32's /metrics: the gauges and counters a router reads among
    the request histograms it does not (~400 lines; the real engine's page is longer, the
    conformance `metrics` check notes its size), so the bench pays for scrapes as a real
    fleet makes the router pay."""
    r = CollectorRegistry()
    lv = ("model_name", "engine")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        Gauge(f"vllm:{name}", name, lv, registry=r).labels(MODEL, "0").set(0)
    counters = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")
    for name in (*counters, "num_preemptions"):
        Counter(f"vllm:{name}", name, lv, registry=r).labels(MODEL, "0").inc(1000)
    done = Counter("vllm:request_success", "ok", [*lv, "finished_reason"], registry=r)
    for reason in ("stop", "length", "abort", "error"):
        done.labels(MODEL, "0", reason).inc()
    seconds = [0.001 * 2**k for k in range(20)]
    tokens = [2**k for k in range(1, 18)]
    for name, buckets in (
        ("time_to_first_token_seconds", seconds),
        ("inter_token_latency_seconds", seconds),
        ("request_time_per_output_token_seconds", seconds),
        ("e2e_request_latency_seconds", seconds),
        ("request_queue_time_seconds", seconds),
        ("request_inference_time_seconds", seconds),
        ("request_prefill_time_seconds", seconds),
        ("request_decode_time_seconds", seconds),
        ("request_prompt_tokens", tokens),
        ("request_generation_tokens", tokens),
        ("request_params_max_tokens", tokens),
        ("request_max_num_generation_tokens", tokens),
        ("iteration_tokens_total", tokens),
        ("request_params_n", [1, 2, 5, 10, 20]),
    ):
        Histogram(f"vllm:{name}", name, lv, buckets=buckets, registry=r).labels(MODEL, "0")
    info = ("block_size", "enable_prefix_caching", "num_gpu_blocks", "prefix_caching_hash_algo")
    cache = Gauge("vllm:cache_config_info", "CacheConfig", info, registry=r)
    cache.labels("16", "True", "100000", "sha256").set(1)
    return generate_latest(r)


METRICS = _metrics_page()
INFO = json.dumps(
    {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "is_generation": True,
        "max_model_len": 32768,
        "served_model_name": MODEL,
    }
).encode()


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = b"OK" if status == 200 else b"Not Found"
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, ctype, len(body))
    ) + body


def _sse() -> bytes:
    chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE), SSE)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunk
    )


class _Handler(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        body = b"".join(self.body)
        self.body = []
        self.transport.write(self._answer(self.url.split(b"?")[0], body))

    def _answer(self, path: bytes, body: bytes) -> bytes:
        if path == b"/v1/completions":
            return (
                _sse()
                if b'"stream": true' in body or b'"stream":true' in body
                else _response(200, COMPLETION)
            )
        if path == b"/v1/chat/completions":
            return _response(200, CHAT)
        if path in (b"/v1/completions/render", b"/v1/chat/completions/render"):
            return _response(200, _render(path, body))
        if path == b"/health":
            return _response(200, b"")
        if path == b"/v1/models":
            return _response(200, MODELS)
        if path == b"/metrics":
            return _response(200, METRICS, b"text/plain")
        if path == b"/kv_event_sources":
            return _response(200, b"{}")
        return _response(404, b'{"error": "not found"}')


def _render(path: bytes, body: bytes) -> bytes:
    """vLLM's render API (what vllm-router calls per request): the request as the engine
    would run it, token ids included (rough ids: one per 4 bytes of prompt)."""
    try:
        doc: Any = json.loads(body)
        text = str(doc.get("prompt", doc.get("messages", "")))
    except ValueError:
        text = ""
    rendered = {
        "request_id": "bench",
        "token_ids": list(range(max(1, len(text) // 4))),
        "sampling_params": {"max_tokens": 1},
        "model": MODEL,
        "stream": False,
    }
    # completions render a list (one per prompt), chat a single request
    return json.dumps(rendered if path.startswith(b"/v1/chat") else [rendered]).encode()


async def serve(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_Handler, "127.0.0.1", p, backlog=1024) for p in ports]
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, action="append", required=True)
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
