"""Where a reviewer compared the simulator with vLLM 0.32 request by request: several
sequences per request (`n`, a batch of prompts), the requests vLLM refuses, the /metrics
counters, streamed usage, and `usage.prompt_tokens_details` off. The expected texts are
vLLM's (its source, and its request models run in its own venv)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_sim_http import BASE  # the same fast sim (max_model_len 3184)

from engines.sim.cli import config_from_args, register
from engines.sim.fleet import Fleet, run_fleet
from engines.vllm.events import BlockStored, decode_wire

CHAT = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with run_fleet(1, BASE) as f:
        yield f


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as c:
        yield c


def sse(text: str) -> list[Any]:
    return [
        json.loads(line[6:])
        for line in text.split("\n\n")
        if line.startswith("data: {")  # [DONE] left out
    ]


def ids(n: int, first: int = 5) -> list[int]:
    return list(range(first, first + n))


# ---- 1. n > 1 and batches ------------------------------------------------------------------


async def test_n_choices_are_separate_samples_with_usage_summed(client: httpx.AsyncClient) -> None:
    body = {"prompt": ids(40), "max_tokens": 4, "ignore_eos": True, "n": 3}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in doc["choices"]}) == 3  # vLLM seeds child k apart
    assert all(c["finish_reason"] == "length" for c in doc["choices"])
    assert doc["usage"]["prompt_tokens"] == 40  # the prompt once
    assert doc["usage"]["completion_tokens"] == 12 and doc["usage"]["total_tokens"] == 52
    one = (await client.post("/v1/completions", json={**body, "n": 1})).json()
    assert one["choices"][0]["text"] == doc["choices"][0]["text"]  # sample 0 is the n=1 one


async def test_integers_are_read_as_vllms_pydantic_models_read_them(
    client: httpx.AsyncClient,
) -> None:
    # lax mode: "3", " 3 ", 3.0 and "1_0" are integers to vLLM (engines/vllm/lax.py)
    body = {"prompt": ids(40), "max_tokens": "3", "ignore_eos": True, "n": 2.0}
    r = await client.post("/v1/completions", json=body | {"truncate_prompt_tokens": "1_0"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert len(doc["choices"]) == 2 and doc["usage"]["completion_tokens"] == 6
    assert doc["usage"]["prompt_tokens"] == 10
    r = await client.post("/v1/completions", json=body | {"max_tokens": "3.5"})
    assert r.status_code == 400
    assert "int_parsing" in r.json()["error"]["message"]


async def test_flags_read_as_vllm_reads_them(client: httpx.AsyncClient) -> None:
    served = [
        {"prompt": "x", "max_tokens": 2, "echo": "false", "use_beam_search": "off"},
        {"prompt": "x", "max_tokens": 2, "best_of": 3},  # no field in vLLM 0.32: ignored
        {"prompt": "x", "max_tokens": 2, "return_token_ids": None},
    ]
    for body in served:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, (body, r.text)
    # vLLM's before-validator reads these two as sent: "false" is truthy there
    for cont, gen in (("false", True), (True, "false")):
        body = {"messages": CHAT, "continue_final_message": cont, "add_generation_prompt": gen}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "Cannot set both" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        # vLLM 0.32, block size 32, cold cache: a 187-token prompt, max_tokens 2
        ({"prompt": ids(187), "n": 1}, {"prompt_tokens": 187, "cached": 0, "choices": 1}),
        ({"prompt": ids(187), "n": 2}, {"prompt_tokens": 187, "cached": 160, "choices": 2}),
        # two identical 148-token prompts: summed prompt tokens, the second's hit
        (
            {"prompt": [ids(148), ids(148)]},
            {"prompt_tokens": 296, "cached": 128, "choices": 2},
        ),
    ],
    ids=["n=1", "n=2", "batch"],
)
async def test_siblings_hit_the_blocks_the_first_sequence_just_allocated(
    body: dict[str, Any], expect: dict[str, int]
) -> None:
    async with (
        run_fleet(1, BASE.replace(block_size=32)) as f,
        httpx.AsyncClient(base_url=f.urls[0], timeout=10) as c,
    ):
        r = await c.post("/v1/completions", json={**body, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == expect["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expect["cached"]
    assert usage["completion_tokens"] == 2 * expect["choices"]
    assert [c["index"] for c in r.json()["choices"]] == list(range(expect["choices"]))


async def test_a_batch_of_text_prompts_is_served(client: httpx.AsyncClient) -> None:
    body = {"prompt": ["one prompt", "another one"], "max_tokens": 3, "ignore_eos": True, "n": 2}
    doc = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2, 3]  # prompt * n + sample
    tok = await client.post("/tokenize", json={"prompt": "one prompt"})
    tok2 = await client.post("/tokenize", json={"prompt": "another one"})
    assert doc["usage"]["prompt_tokens"] == tok.json()["count"] + tok2.json()["count"]
    assert doc["usage"]["completion_tokens"] == 12


async def test_streamed_choices_carry_their_index(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": ids(40),
        "max_tokens": 3,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse((await client.post("/v1/completions", json=body)).text)
    *deltas, usage = chunks
    by_index: dict[int, list[Any]] = {}
    for c in deltas:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1] and all(len(v) == 3 for v in by_index.values())
    assert all(v[-1]["finish_reason"] == "length" for v in by_index.values())
    assert usage["usage"]["prompt_tokens"] == 40 and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the first output's

    chat = {"messages": CHAT, "max_tokens": 2, "n": 2, "stream": True}
    chunks = sse((await client.post("/v1/chat/completions", json=chat)).text)
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


async def test_chat_n_gives_n_messages(client: httpx.AsyncClient) -> None:
    body = {"messages": CHAT, "n": 2, "max_tokens": 3, "ignore_eos": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in doc["choices"])
    assert doc["choices"][0]["message"]["content"] != doc["choices"][1]["message"]["content"]
    assert doc["usage"]["completion_tokens"] == 6


async def test_each_sample_stores_and_looks_up_its_blocks_as_its_own_request(
    fleet: Fleet, client: httpx.AsyncClient
) -> None:
    w = fleet.workers[0]
    assert w.publisher is not None
    # 40 prompt tokens + 29 computed outputs = 4 full blocks of 16 per sample
    body = {"prompt": ids(40), "max_tokens": 30, "ignore_eos": True, "n": 2}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    stored = [
        e
        for _, p in w.publisher.buffered()
        for e in decode_wire(p)[0].events
        if isinstance(e, BlockStored)
    ]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == len(set(hashes)) == 6  # 2 shared prompt blocks + 2 of each sample's
    prompt_blocks = hashes[:2]
    generated_parents = [e.parent_block_hash for e in stored if e.parent_block_hash is not None]
    assert generated_parents.count(prompt_blocks[-1]) == 2  # both samples extend the prompt


async def test_return_token_ids_gives_the_prompt_run_and_the_output(
    client: httpx.AsyncClient,
) -> None:
    """vLLM's `return_token_ids`: the prompt as the engine ran it (truncated here, BOS
    kept) and each choice's output ids; streamed, a choice's prompt ids come on its first
    chunk and every chunk carries its own new ids (chat: the prompt on the role chunk)."""
    body = {"prompt": "word " * 50, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    whole = await client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 10})
    choice = whole.json()["choices"][0]
    assert len(choice["prompt_token_ids"]) == 10 and len(choice["token_ids"]) == 4
    streamed = await client.post("/v1/completions", json={**body, "stream": True, "n": 2})
    chunks = [c["choices"][0] for c in sse(streamed.text) if c.get("choices")]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["prompt_token_ids"] and not any(c["prompt_token_ids"] for c in mine[1:])
        assert sum(len(c["token_ids"]) for c in mine) == 4
    chat = {"messages": CHAT, "max_tokens": 2, "ignore_eos": True, "return_token_ids": True}
    chat["stream"] = True
    events = sse((await client.post("/v1/chat/completions", json=chat)).text)
    assert events[0]["prompt_token_ids"] and events[0]["choices"][0]["delta"]["role"]
    deltas = [e["choices"][0].get("token_ids") or [] for e in events if e.get("choices")]
    assert sum(len(ids) for ids in deltas) == 2


# ---- 2. requests vLLM refuses --------------------------------------------------------------

LONG_PROMPT = "x " * 5000

REFUSED = [
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 100000},
        "max_tokens",
        "max_tokens=100000 cannot be greater than max_model_len=3184. Please request fewer "
        "output tokens. (parameter=max_tokens, value=100000)",
        id="max_tokens",
    ),
    pytest.param(
        "/v1/completions",  # checked before the prompt is counted
        {"prompt": LONG_PROMPT, "max_tokens": 100000},
        "max_tokens",
        "max_tokens=100000 cannot be greater than max_model_len=3184. Please request fewer "
        "output tokens. (parameter=max_tokens, value=100000)",
        id="max_tokens-before-length",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 5000},
        "max_completion_tokens",
        "max_completion_tokens=5000 cannot be greater than max_model_len=3184. Please request "
        "fewer output tokens. (parameter=max_completion_tokens, value=5000)",
        id="max_completion_tokens",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        "stream_options",
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        id="stream_options",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "temperature": -1},
        "temperature",
        "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        id="temperature",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "top_p": 0},
        "top_p",
        "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
        id="top_p=0",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": CHAT, "top_p": 1.5},
        "top_p",
        "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)",
        id="top_p>1",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": ""},
        "prompt",
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        id="empty-prompt",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "truncate_prompt_tokens": 5000},
        "truncate_prompt_tokens",
        "truncate_prompt_tokens=5000 cannot be greater than max_model_len = 3184. Please "
        "request a smaller truncation size. (parameter=truncate_prompt_tokens, value=5000)",
        id="truncate_prompt_tokens",
    ),
    pytest.param(
        "/v1/completions",  # vLLM's engine input check, after the sampling ones
        {"prompt": "hello there world", "truncate_prompt_tokens": 0},
        None,
        "The decoder prompt cannot be empty",
        id="truncated-to-nothing",
    ),
    pytest.param(
        "/v1/completions",  # fits the context, leaving no room for output
        {"prompt": [5 + i % 2000 for i in range(3184)]},
        "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        id="prompt-of-exactly-the-context",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "min_tokens": 20},
        None,
        "min_tokens must be less than or equal to max_tokens=16, got 20.",
        id="min_tokens",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "suffix": "y"},
        "suffix",
        "suffix is only supported for models with FIM completion rendering",
        id="suffix",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "n": 2, "temperature": 0},
        None,
        "n must be 1 when using greedy sampling, got 2.",
        id="greedy-n",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 0},
        "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        id="max_tokens=0",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), REFUSED)
async def test_requests_vllm_refuses_get_its_400(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None, message: str
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }


async def test_tokenize_takes_a_text_prompt_only(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": [1, 2, 3]})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "2 validation errors:\n"
        "  {'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid "
        "string', 'input': '<list of 3 items>'}\n"
        "  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': "
        "'<dict of 1 items>'}",
        "type": "Bad Request",
        "param": "body.prompt",
        "code": 400,
    }


# ---- 3. /metrics ---------------------------------------------------------------------------


def metrics(text: str) -> dict[str, float]:
    """`name{finished_reason}` -> value, for the counters and the e2e count."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[f"{s.name}{{{reason}}}" if reason else s.name] = s.value
    return out


async def test_every_finished_reason_series_exists_at_zero(client: httpx.AsyncClient) -> None:
    m = metrics((await client.get("/metrics")).text)
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert m[f"vllm:request_success_total{{{reason}}}"] == 0


async def test_a_stop_string_finish_is_counted(client: httpx.AsyncClient) -> None:
    plain = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    text = (await client.post("/v1/completions", json=plain)).json()["choices"][0]["text"]
    stop = text.split()[2]
    streamed = {
        **plain,
        "stop": [stop],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = sse((await client.post("/v1/completions", json=streamed)).text)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    generated = chunks[-2]["usage"]["completion_tokens"]  # up to the stop string
    prompt = (await client.post("/tokenize", json={"prompt": "hi"})).json()["count"]
    m = metrics((await client.get("/metrics")).text)
    assert m["vllm:request_success_total{stop}"] == 1
    assert m["vllm:request_success_total{length}"] == 1
    assert m["vllm:e2e_request_latency_seconds_count"] == 2
    assert m["vllm:prompt_tokens_total"] == 2 * prompt
    assert m["vllm:generation_tokens_total"] == 8 + generated


async def test_a_client_abort_counts_its_tokens_but_no_finish(fleet: Fleet) -> None:
    engine = fleet.workers[0].engine
    body = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 10:
                    break
        for _ in range(200):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        prompt = (await c.post("/tokenize", json={"prompt": "hi"})).json()["count"]
        m = metrics((await c.get("/metrics")).text)
    assert m["vllm:prompt_tokens_total"] == prompt
    assert m["vllm:generation_tokens_total"] >= 10  # what the engine made before the abort
    # vLLM's OutputProcessor.abort_requests drops a client's request without a finish
    assert all(v == 0 for k, v in m.items() if k.startswith("vllm:request_success_total"))
    assert m["vllm:e2e_request_latency_seconds_count"] == 0


# ---- 4. streamed usage ---------------------------------------------------------------------


async def test_continuous_usage_needs_include_usage(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    chunks = sse((await client.post("/v1/completions", json=body)).text)
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_chat_continuous_usage_is_on_the_role_chunk_too(client: httpx.AsyncClient) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    role, *deltas, last = sse((await client.post("/v1/chat/completions", json=body)).text)
    n = last["usage"]["prompt_tokens"]
    assert role["usage"] == {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "completion_tokens_details": None,
    }
    assert [d["usage"]["completion_tokens"] for d in deltas] == [1, 2]


# ---- 5. --no-prompt-tokens-details ---------------------------------------------------------


def _sim_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="kvroute")
    subs = top.add_subparsers()
    register(subs)
    return top, subs.choices["sim"]


def test_the_flag_is_documented_and_sets_the_config() -> None:
    top, sim = _sim_parser()
    assert "--no-prompt-tokens-details" in sim.format_help()
    assert config_from_args(top.parse_args(["sim"])).prompt_tokens_details is True
    args = top.parse_args(["sim", "--no-prompt-tokens-details"])
    assert config_from_args(args).prompt_tokens_details is False


async def test_without_prompt_tokens_details_usage_has_none() -> None:
    async with (
        run_fleet(1, BASE.replace(prompt_tokens_details=False)) as f,
        httpx.AsyncClient(base_url=f.urls[0], timeout=10) as c,
    ):
        whole = (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).json()
        chat = (await c.post("/v1/chat/completions", json={"messages": CHAT})).json()
        body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
        streamed = sse((await c.post("/v1/completions", json=body)).text)[-1]
    assert whole["usage"]["prompt_tokens_details"] is None  # dumped in full: null
    assert chat["usage"]["prompt_tokens_details"] is None
    assert "prompt_tokens_details" not in streamed["usage"]  # dumped without None: absent


async def test_vllm_xargs_take_what_vllms_field_takes(client: httpx.AsyncClient) -> None:
    """dict[str, str | int | float | list[...]]: the report mode rides in it; a null or an
    object is a 400 naming the key, as vLLM's request model refuses it."""
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 1}
    ok = {"kv_cache_report_mode": "full", "n": 2, "f": 0.5, "l": [1, "a"]}
    assert (await client.post("/v1/completions", json=body | {"vllm_xargs": ok})).status_code == 200
    for bad in (None, {"a": 1}, [None]):
        r = await client.post("/v1/completions", json=body | {"vllm_xargs": {"mode": bad}})
        assert r.status_code == 400 and "vllm_xargs" in r.text, r.text
