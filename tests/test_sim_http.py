"""The simulated worker's HTTP surface on a real uvicorn on loopback, in vLLM's shapes; its ZMQ
publisher and replay socket; and the router's subscriber fed by it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq.asyncio

from engines.sim.config import SimConfig
from engines.sim.fleet import Fleet, run_fleet
from engines.sim.latency import LatencyModel
from engines.sim.worker import SimWorker
from engines.vllm.events import decode_batch
from indexer.clock import MonotonicClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest
from indexer.subscriber import EventSubscriber, ReplayClient

FAST = LatencyModel(
    ttft_base_ms=1, decode_ms_per_step=1, prefill_ms_per_token=0, attention_ms_per_mpair=0
)
BASE = SimConfig(latency=FAST, topic="kv-events", kv_blocks=200)
LONG = " ".join(f"word{i % 50} the router sends" for i in range(150))


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with run_fleet(1, BASE) as f:
        yield f


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as c:
        yield c


def sse(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_reports_cached_tokens_on_a_repeat(client: httpx.AsyncClient) -> None:
    body = {"model": "kvroute-sim", "prompt": LONG, "max_tokens": 5}
    first = (await client.post("/v1/completions", json=body)).json()
    second = (await client.post("/v1/completions", json=body)).json()
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert first["choices"][0]["text"] == second["choices"][0]["text"] != ""
    assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 5
    truth = (await client.post("/sim/cached_tokens", json={"prompt": LONG})).json()
    assert truth["cached_tokens"] == (n - 1) // 16 * 16 and truth["prompt_tokens"] == n


async def test_chat_stream_with_usage(client: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": LONG}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
    }
    warm = await client.post("/v1/chat/completions", json={"messages": body["messages"]})
    assert warm.status_code == 200
    r = await client.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = chunks[1:-2]
    assert len(deltas) == 4 and deltas[-1]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "system_fingerprint" not in deltas[-1]


async def test_completion_stream_without_usage_and_a_stop_string(client: httpx.AsyncClient) -> None:
    plain = (
        await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True}
        )
    ).json()
    text = plain["choices"][0]["text"]
    stop = text.split()[2]
    r = await client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True, "stop": [stop]},
    )
    chunks = sse(r.text)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])
    last = chunks[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert "system_fingerprint" in chunks[-2]
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert streamed == text[: text.index(stop)]


async def test_openai_client_speaks_to_it(fleet: Fleet) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="unused")
    done = await client.completions.create(model="kvroute-sim", prompt="hello", max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    stream = await client.chat.completions.create(
        model="kvroute-sim",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["kvroute-sim"]
    await client.close()


async def test_tokenize_both_forms_and_detokenize(fleet: Fleet, client: httpx.AsyncClient) -> None:
    tok = fleet.workers[0].tokenizer
    r = (
        await client.post("/tokenize", json={"model": "kvroute-sim", "prompt": "Hello world"})
    ).json()
    assert r == {
        "count": 5,
        "max_model_len": 3184,
        "tokens": tok.encode("Hello world"),
        "token_strs": None,
    }
    assert r["tokens"][0] == 0
    messages = [{"role": "user", "content": "Hello world"}]
    chat = (
        await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True})
    ).json()
    assert chat["tokens"] == tok.encode_chat(messages)
    assert chat["tokens"].count(0) == 1
    back = (await client.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert back == {"prompt": "<s>Hello world"}
    rendered = (await client.post("/v1/completions/render", json={"prompt": "Hello world"})).json()
    assert rendered[0]["token_ids"] == r["tokens"] and rendered[0]["request_id"].startswith("cmpl-")
    rendered = (
        await client.post("/v1/chat/completions/render", json={"messages": messages})
    ).json()
    assert rendered["token_ids"] == chat["tokens"]


async def test_metrics_have_vllm_names(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    text = (await client.get("/metrics")).text
    for name in (
        'vllm:num_requests_running{engine="0",model_name="kvroute-sim"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="kvroute-sim"} 0.0',
        *(
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="kvroute-sim",'
            f'reason="{reason}"}} 0.0'
            for reason in ("capacity", "deferred")
        ),
        'vllm:kv_cache_usage_perc{engine="0",model_name="kvroute-sim"} 0.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="kvroute-sim"} 2.0',
    ):
        assert name in text
    assert 'block_size="16"' in text and 'num_gpu_blocks="200"' in text
    assert 'enable_prefix_caching="True"' in text and 'prefix_caching_hash_algo="sha256"' in text
    queries = _metric(text, "vllm:prefix_cache_queries_total")
    hits = _metric(text, "vllm:prefix_cache_hits_total")
    assert hits > 0 and queries > hits


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param"),
    [
        pytest.param(b"{not json", 400, "Bad Request", "body", id="bad-json"),
        pytest.param({"max_tokens": 3}, 400, "BadRequestError", "prompt", id="missing-prompt"),
        pytest.param({"prompt": 5}, 400, "Bad Request", "body.prompt", id="prompt-type"),
        pytest.param({"prompt": "x", "n": 0}, 400, "BadRequestError", None, id="n=0"),
        pytest.param(
            {"prompt": "x", "max_tokens": -1}, 400, "BadRequestError", "max_tokens", id="negative"
        ),
        pytest.param(
            {"prompt": "x " * 5000}, 400, "BadRequestError", "input_tokens", id="too-long"
        ),
        pytest.param({"prompt": "x", "model": "gpt-4"}, 404, "NotFoundError", "model", id="model"),
    ],
)
async def test_bad_requests_get_vllm_errors(
    client: httpx.AsyncClient, body: Any, status: int, err_type: str, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (err_type, param, status)
    assert isinstance(err["message"], str) and err["message"]


async def test_wrong_content_type_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", content=b"prompt=x")
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"]


async def test_descriptive_endpoints(fleet: Fleet, client: httpx.AsyncClient) -> None:
    w = fleet.workers[0]
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/version")).json() == {"version": "0.32.0"}
    sources = (await client.get("/kv_event_sources")).json()
    assert sources["0"]["endpoint"] == w.events_endpoint and sources["0"]["topic"] == "kv-events"
    assert sources["0"]["replay_endpoint"] == w.replay_endpoint
    assert sources["0"]["buffer_steps"] == 10000
    info = (await client.get("/server_info?config_format=json")).json()
    assert info["vllm_config"]["cache_config"]["block_size"] == 16
    for path in ("/model_info", "/get_model_info"):
        assert (await client.get(path)).json()["model_path"] == "kvroute-sim"
    await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1})
    stats = (await client.get("/sim/stats")).json()
    assert stats["cached_blocks"] > 0 and stats["event_batches"] >= 1
    assert stats["free_blocks"] == 199 and stats["running"] == 0


async def test_client_disconnect_aborts_the_request(fleet: Fleet) -> None:
    engine = fleet.workers[0].engine
    body = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=fleet.urls[0]) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        async for _ in r.aiter_lines():
            if engine.stats().running:
                break
    for _ in range(200):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().running == 0
    assert fleet.workers[0].scheduler.kv.pool.usage() == 0.0


async def test_replay_and_reset_publish_like_vllm(fleet: Fleet, client: httpx.AsyncClient) -> None:
    w = fleet.workers[0]
    assert w.replay_endpoint is not None and w.publisher is not None
    await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
    seq_before = w.publisher.seq
    await client.post("/v1/completions", json={"prompt": "short one", "max_tokens": 1})
    ctx = zmq.asyncio.Context()
    replay = ReplayClient(ctx, w.replay_endpoint)
    try:
        frames = await replay.fetch(0)
        assert frames is not None
        assert [s for s, _ in frames] == list(range(w.publisher.seq))
        assert frames == w.publisher.buffered()
        names = [type(e).__name__ for e in decode_batch(frames[seq_before][1]).events]
        assert names[0] == "AllBlocksCleared"  # with the next step's batch
        assert await replay.fetch(10_000) == []
    finally:
        replay.close()
        ctx.term()


async def test_live_events_feed_the_router_index_exactly(
    fleet: Fleet, client: httpx.AsyncClient
) -> None:
    w = fleet.workers[0]
    assert w.events_endpoint is not None and w.publisher is not None
    index = PrefixIndex()
    index.add_worker("w", model="kvroute-sim")
    ingest = WorkerIngest("w", index, decode_batch, MonotonicClock(), block_size=16)
    ctx = zmq.asyncio.Context()
    sub = EventSubscriber(
        ingest, w.events_endpoint, replay_endpoint=w.replay_endpoint, topic="kv-events", ctx=ctx
    )
    task = asyncio.create_task(sub.run())
    prompts = [f"{i} {LONG[: 200 * (i + 1)]}" for i in range(6)] * 2
    try:
        for p in prompts:
            await client.post("/v1/completions", json={"prompt": p, "max_tokens": 3})
        for _ in range(300):  # the subscriber catches up (replaying what it joined too late for)
            if ingest.tracker.last_applied == w.publisher.seq - 1:
                break
            await asyncio.sleep(0.01)
        assert ingest.tracker.last_applied == w.publisher.seq - 1
        for p in prompts:
            ids = w.tokenizer.encode(p)
            match = index.find_matches(hash_request(ids, 16, Namespace("kvroute-sim"))).get("w")
            truth = (await client.post("/sim/cached_tokens", json={"prompt": p})).json()
            assert (match.blocks if match else 0) == truth["cached_blocks"] > 0
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ctx.term()


async def test_no_events_still_caches_and_no_prefix_caching_does_not() -> None:
    silent = BASE.replace(events=False)
    uncached = BASE.replace(enable_prefix_caching=False)
    async with run_fleet(configs=[silent.replace(name="a"), uncached.replace(name="b")]) as f:
        a, b = f.workers
        assert a.events_endpoint is None and a.info()["events"] is False
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.get(a.url + "/kv_event_sources")).json() == {}
            for w, expect_cached in ((a, True), (b, False)):
                for _ in range(2):
                    r = await c.post(
                        w.url + "/v1/completions", json={"prompt": LONG, "max_tokens": 1}
                    )
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached > 0) == expect_cached
            metrics = (await c.get(b.url + "/metrics")).text
            assert 'enable_prefix_caching="False"' in metrics
            truth = (await c.post(b.url + "/sim/cached_tokens", json={"prompt": LONG})).json()
            assert truth["cached_tokens"] == 0


def test_worker_rejects_a_non_loopback_host() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        SimWorker(BASE.replace(host="0.0.0.0"))


async def test_lora_adapters_are_models_whose_blocks_hash_apart() -> None:
    async with run_fleet(1, BASE.replace(lora_modules=(("ad", "/adapters/ad"),))) as f:
        w = f.workers[0]
        async with httpx.AsyncClient(base_url=w.url, timeout=10) as c:
            models = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [
                ("kvroute-sim", None),
                ("ad", "kvroute-sim"),
            ]
            for _ in range(2):
                r = await c.post(
                    "/v1/completions", json={"model": "ad", "prompt": LONG, "max_tokens": 1}
                )
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            base = (await c.post("/sim/cached_tokens", json={"prompt": LONG})).json()
            lora = (await c.post("/sim/cached_tokens", json={"prompt": LONG, "model": "ad"})).json()
            assert base["cached_tokens"] == 0 < lora["cached_tokens"]
            missing = await c.get("/nope")
            assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
        assert w.publisher is not None
        stored = [e for _, p in w.publisher.buffered() for e in decode_batch(p).events]
        assert {getattr(e, "lora_name", None) for e in stored} == {"ad"}
