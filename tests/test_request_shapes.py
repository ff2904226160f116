"""Request fields that change the prompt vLLM runs: `add_special_tokens`,
`truncate_prompt_tokens` / `truncation_side`, and token-id prompts out of range. The router
must hash the tokens the engine caches, so each case is checked against the simulator's
tokenizer (vLLM's rules) through the decision service, with the model's tokenizer local and
with a worker's /tokenize."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engines.sim.tokenizer import SimTokenizer
from indexer.events import BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, hash_request
from indexer.index import PrefixIndex
from router.app import RouterApp
from router.core.config import REMOTE, Config, WorkerConfig
from router.core.errors import BadRequest
from router.openai_req import RoutingInput, parse
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer, truncate

pytestmark = pytest.mark.timeout(60)

ENGINE = SimTokenizer(PACKAGED_TOKENIZER)  # the worker's side
BOS = ENGINE.encode("x")[0]
BS = 32
MAX_MODEL_LEN = 4064
DOC = "The quick brown fox jumps over the lazy dog. " * 40
CHAT = [{"role": "system", "content": DOC}, {"role": "user", "content": "hi"}]


def engine_tokenize(body: dict[str, Any]) -> list[int]:
    """vLLM's /tokenize: completions add specials unless told not to, chat does not unless
    told to."""
    if "messages" in body:
        special = body.get("add_special_tokens", False)
        return ENGINE.encode_chat(body["messages"], add_special_tokens=special)
    return ENGINE.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))


class Worker:
    """One vLLM worker behind `httpx.MockTransport`: its models and /tokenize, recorded."""

    def __init__(self) -> None:
        self.tokenize_bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": "m", "object": "model", "max_model_len": MAX_MODEL_LEN}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            self.tokenize_bodies.append(body)
            return httpx.Response(200, json={"tokens": engine_tokenize(body)})
        return httpx.Response(200, json={})


@asynccontextmanager
async def router(tokenizer: str) -> AsyncIterator[tuple[RouterApp, Worker]]:
    worker = Worker()
    client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    config = Config(workers=(WorkerConfig("http://w:8000", mode="approx"),), tokenizer=tokenizer)
    local = LocalTokenizer(PACKAGED_TOKENIZER) if tokenizer != REMOTE else None
    app = RouterApp(config, tokenizer=local, client=client)
    try:
        await app.pool.set_workers(config.workers)
        worker.tokenize_bodies.clear()  # start-up probes
        yield app, worker
    finally:
        await app.pool.stop()
        await client.aclose()


def body_of(kind: str, **fields: Any) -> RoutingInput:
    doc: dict[str, Any] = {"model": "m", **fields}
    doc.setdefault("messages" if kind == "chat" else "prompt", CHAT if kind == "chat" else DOC)
    return parse(kind, json.dumps(doc).encode())


def predicted_overlap(engine_tokens: Sequence[int], router_tokens: Sequence[int]) -> int:
    """Blocks the index says are cached when the engine stored its own tokens' full blocks
    and the router looks up the tokens it computed."""
    index = PrefixIndex()
    index.add_worker("w", model="m")
    n = len(engine_tokens) // BS
    stored = BlockStored(
        [EngineBlockHash(i) for i in range(1, n + 1)], None, list(engine_tokens[: n * BS]), BS
    )
    index.apply("w", EventBatch(0.0, [stored]))
    found = index.find_matches(hash_request(list(router_tokens), BS, Namespace("m")))
    return found["w"].blocks if "w" in found else 0


LOCAL_AND_REMOTE = pytest.mark.parametrize(
    "tokenizer", [str(PACKAGED_TOKENIZER), REMOTE], ids=["local", "remote"]
)

SPECIALS = [
    pytest.param("completion", {}, ENGINE.encode(DOC), id="completion-default-bos"),
    pytest.param(
        "completion",
        {"add_special_tokens": False},
        ENGINE.encode(DOC, add_special_tokens=False),
        id="completion-false-no-bos",
    ),
    pytest.param("chat", {}, ENGINE.encode_chat(CHAT), id="chat-default-template-only"),
    pytest.param(
        "chat",
        {"add_special_tokens": True},
        ENGINE.encode_chat(CHAT, add_special_tokens=True),
        id="chat-true-extra-bos",
    ),
]


@LOCAL_AND_REMOTE
@pytest.mark.parametrize(("kind", "fields", "engine_tokens"), SPECIALS)
async def test_add_special_tokens_hashes_like_the_engine(
    tokenizer: str, kind: str, fields: dict[str, Any], engine_tokens: list[int]
) -> None:
    async with router(tokenizer) as (app, _):
        tokens = list(await app.routing.tokens(body_of(kind, **fields), None))
    assert tokens == engine_tokens
    assert predicted_overlap(engine_tokens, tokens) == len(engine_tokens) // BS


@pytest.mark.parametrize(
    ("kind", "fields", "sent"),
    [
        ("completion", {}, True),
        ("completion", {"add_special_tokens": False}, False),
        ("chat", {}, False),
        ("chat", {"add_special_tokens": True}, True),
    ],
    ids=["completion-default", "completion-false", "chat-default", "chat-true"],
)
async def test_the_worker_is_asked_to_tokenize_with_the_requests_specials(
    kind: str, fields: dict[str, Any], sent: bool
) -> None:
    async with router(REMOTE) as (app, worker):
        await app.routing.tokens(body_of(kind, **fields), None)
    assert [b["add_special_tokens"] for b in worker.tokenize_bodies] == [sent]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (0, False), ("true", True), ("off", False)],
    ids=["true", "false", "int-0", "str-true", "str-off"],
)
def test_add_special_tokens_reads_what_vllm_reads_as_a_boolean(value: Any, expected: bool) -> None:
    assert body_of("completion", add_special_tokens=value).add_special_tokens is expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"add_special_tokens": "maybe"}, "add_special_tokens"),
        ({"add_special_tokens": None}, "add_special_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": "ten"}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": "10.5"}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"prompt": [1, 2**32]}, "prompt"),
        ({"prompt": [2**64]}, "prompt"),
        ({"prompt": [5, -1]}, "prompt"),
    ],
    ids=[
        "specials-not-bool",
        "specials-null",
        "truncate-below-minus-1",
        "truncate-not-a-number",
        "truncate-fraction",
        "side-unknown",
        "token-id-2**32",
        "token-id-2**64",
        "token-id-negative",
    ],
)
def test_bad_fields_are_400s_naming_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        body_of("completion", **fields)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["param"] == param


async def test_a_token_id_past_uint32_never_reaches_hashing() -> None:
    """It used to pass parsing and fail in block hashing: a 500 with a traceback."""
    body = json.dumps({"model": "m", "prompt": [7] * BS + [2**32] * BS}).encode()
    async with router(str(PACKAGED_TOKENIZER)) as (app, _):
        with pytest.raises(BadRequest) as caught:
            await app.routing.decide(parse("completion", body))
    assert caught.value.param == "prompt"


# ---- truncate_prompt_tokens ---------------------------------------------------------------

LONG = "word " * 5000  # 5,001 tokens and BOS: over the context length


@LOCAL_AND_REMOTE
async def test_a_prompt_over_the_context_is_routed_when_truncation_brings_it_under(
    tokenizer: str,
) -> None:
    """vLLM truncates before its length check: a 5,002-token prompt with
    truncate_prompt_tokens=1000 is served, so kvroute must not answer 400. vLLM lets the
    tokenizer truncate from the left, which keeps BOS: BOS and the last 999 ids (checked
    against vllm.renderers.params.TokenizeParams of vLLM 0.32 on this tokenizer)."""
    full = ENGINE.encode(LONG)
    assert len(full) > MAX_MODEL_LEN
    rin = body_of("completion", prompt=LONG, truncate_prompt_tokens=1000, max_tokens=8)
    async with router(tokenizer) as (app, _):
        decision = await app.routing.decide(rin)
        tokens = list(await app.routing.tokens(rin, None, rin.keep_tokens(MAX_MODEL_LEN)))
    assert decision.request.prompt_tokens == 1000
    assert tokens == [BOS, *full[-999:]]


async def test_without_truncation_the_same_prompt_is_still_refused() -> None:
    async with router(str(PACKAGED_TOKENIZER)) as (app, _):
        with pytest.raises(BadRequest) as caught:
            await app.routing.decide(body_of("completion", prompt=LONG))
    assert caught.value.param == "prompt"


async def test_truncation_past_the_context_length_is_refused_as_vllm_does() -> None:
    rin = body_of("completion", truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    async with router(str(PACKAGED_TOKENIZER)) as (app, _):
        with pytest.raises(BadRequest) as caught:
            await app.routing.decide(rin)
    assert caught.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("kind", "fields", "keep"),
    [
        ("completion", {"truncate_prompt_tokens": -1}, MAX_MODEL_LEN - 1),
        ("completion", {"truncate_prompt_tokens": -1, "max_tokens": 0}, MAX_MODEL_LEN),
        ("completion", {"truncate_prompt_tokens": -1, "max_tokens": None}, MAX_MODEL_LEN - 1),
        ("chat", {"truncate_prompt_tokens": -1}, MAX_MODEL_LEN),
        ("chat", {"truncate_prompt_tokens": -1, "max_completion_tokens": 5}, MAX_MODEL_LEN - 1),
        ("completion", {"truncate_prompt_tokens": 7}, 7),
        ("completion", {}, None),
    ],
    ids=[
        "completion-minus-1",
        "completion-minus-1-no-output",
        "completion-minus-1-null-max-tokens-is-16",
        "chat-minus-1-no-max",
        "chat-minus-1-with-max",
        "explicit",
        "none",
    ],
)
def test_minus_one_means_the_context_less_the_output_token_vllm_holds_back(
    kind: str, fields: dict[str, Any], keep: int | None
) -> None:
    assert body_of(kind, **fields).keep_tokens(MAX_MODEL_LEN) == keep


HEAD = [BOS]
BODY = list(range(100, 110))


@pytest.mark.parametrize(
    ("ids", "keep", "side", "ends", "expected"),
    [
        (HEAD + BODY, 4, None, (1, 0), HEAD + BODY[-3:]),
        (HEAD + BODY, 4, "left", (1, 0), BODY[-4:]),
        (HEAD + BODY, 4, "right", (1, 0), HEAD + BODY[:3]),
        (BODY, 4, None, (0, 0), BODY[-4:]),
        (HEAD + BODY, 1, None, (1, 0), HEAD),
        (HEAD + BODY, 0, None, (1, 0), []),
        (HEAD + BODY, 11, None, (1, 0), HEAD + BODY),
    ],
    ids=[
        "default-keeps-bos",
        "explicit-left-cuts-bos",
        "right",
        "no-specials",
        "only-bos-fits",
        "zero",
        "short-enough",
    ],
)
def test_truncate_cuts_as_vllm_does(
    ids: list[int], keep: int, side: str | None, ends: tuple[int, int], expected: list[int]
) -> None:
    assert list(truncate(ids, keep, side, ends)) == expected


async def test_token_id_prompts_keep_their_last_ids() -> None:
    ids = list(range(1, 5001))
    rin = parse(
        "completion",
        json.dumps({"model": "m", "prompt": ids, "truncate_prompt_tokens": 64}).encode(),
    )
    async with router(str(PACKAGED_TOKENIZER)) as (app, _):
        tokens = list(await app.routing.tokens(rin, None, rin.keep_tokens(MAX_MODEL_LEN)))
        decision = await app.routing.decide(rin)
    assert tokens == ids[-64:] and decision.request.prompt_tokens == 64


def test_tool_traffic_renders_as_vllm_renders_it() -> None:
    """vLLM hands the template each tool as its request model dumps it (description and
    parameters present, null when not given, in that order), each tool call's JSON
    arguments parsed, and no null tool_calls; the template prints what it gets."""
    from router.tokenize_chat import compile_template, render

    template = compile_template(
        "{{ tools | tojson }}|{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}{% endif %};"
        "{% endfor %}"
    )
    body = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "content": "cold", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is cold.", "tool_calls": None},
        ],
    }
    rin = parse("chat", json.dumps(body).encode())
    assert rin.messages is not None and rin.tools is not None
    text = render(template, {}, rin.messages, False, {"tools": rin.tools})
    tools, _, turns = text.partition("|")
    function = {"name": "get_weather", "description": None, "parameters": None}
    assert json.loads(tools) == [{"type": "function", "function": function}]
    assert list(json.loads(tools)[0]["function"]) == ["name", "description", "parameters"]
    assert '"arguments": {"city": "Oslo"}' in turns
    assert turns.endswith("assistant:It is cold.;")  # the null tool_calls dropped, no 400
