"""The engines' chat-template flags, mirrored: `--chat-template` (a file or the template
itself, for every model or one), `--chat-template-content-format`, and
`--trust-request-chat-template` (a request's own `chat_template`). An engine started with
one of them renders chats differently from its tokenizer folder, and a router that did not
follow would hash other blocks than the engine stores: no prefix would ever match."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from router.app import RouterApp
from router.cli import build_parser
from router.core.config import REMOTE, Config, WorkerConfig
from router.core.errors import BadRequest, ConfigError
from router.openai_req import parse
from router.serve_cli import load_config
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer
from router.tokenizers import TokenizerSet

pytestmark = pytest.mark.timeout(60)

RAW = Tokenizer.from_file(str(PACKAGED_TOKENIZER / "tokenizer.json"))
PLAIN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MINE = "{% for m in messages %}<<{{ m['role'] | upper }}>>{{ m['content'] }}{% endfor %}"
CHAT = [{"role": "user", "content": "Hello there"}]


def _config(argv: list[str], env: dict[str, str] | None = None) -> Config:
    args = build_parser(only="serve").parse_args(["serve", "--worker", "http://a:1", *argv])
    return load_config(args, env or {})


def _rendered(tokenizers: TokenizerSet, model: str, base: str | None = None) -> str:
    local = tokenizers.local(model, base)
    assert local is not None
    return local.render_chat(CHAT, add_generation_prompt=False)


def test_the_flags_reach_the_config(tmp_path: Path) -> None:
    path = tmp_path / "tool_chat.jinja"
    path.write_text(PLAIN)
    cfg = _config(
        [
            *("--chat-template", str(path), "--chat-template", f"lora-a={MINE}"),
            *("--chat-template-content-format", "openai", "--trust-request-chat-template"),
        ]
    )
    assert cfg.chat_template == str(path)
    assert cfg.chat_templates == {"lora-a": MINE}
    assert cfg.chat_template_content_format == "openai"
    assert cfg.trust_request_chat_template is True
    # a template itself, "=" inside, is the default, not one model's
    literal = "{{ x == 1 }}"
    assert _config(["--chat-template", literal]).chat_template == literal
    env = {"KVROUTE_CHAT_TEMPLATE": str(path), "KVROUTE_TRUST_REQUEST_CHAT_TEMPLATE": "yes"}
    from_env = _config([], env)
    assert from_env.chat_template == str(path) and from_env.trust_request_chat_template


def test_a_bad_content_format_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"chat_template_content_format.*auto, string, openai"):
        _config(["--chat-template-content-format", "auto"], {})  # the flag has choices
        Config(workers=(WorkerConfig("http://a:1"),), chat_template_content_format="x").validate()


def test_the_template_replaces_the_folders_for_every_model_or_one(tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    folder = str(PACKAGED_TOKENIZER)
    cfg = Config(tokenizer=folder, chat_template=str(path), chat_templates={"base-b": MINE})
    tokenizers = TokenizerSet.from_config(cfg)
    assert _rendered(tokenizers, "any") == "[user] Hello there\n"
    assert _rendered(tokenizers, "base-b") == "<<USER>>Hello there"
    assert _rendered(tokenizers, "adapter", base="base-b") == "<<USER>>Hello there"
    # the folder's own without the flag
    own = TokenizerSet.from_config(Config(tokenizer=folder))
    assert _rendered(own, "any").startswith("<s><|im_start|>user\nHello there")


def test_a_preloaded_tokenizer_still_follows_the_flag() -> None:
    cfg = Config(tokenizer=str(PACKAGED_TOKENIZER), chat_template=MINE)
    tokenizers = TokenizerSet.from_config(cfg, preloaded=LocalTokenizer(PACKAGED_TOKENIZER))
    assert _rendered(tokenizers, "m") == "<<USER>>Hello there"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"chat_template": "templates/missing.jinja"}, "chat_template: .*looks like a file path"),
        ({"chat_templates": {"m": "nope.jinja"}}, r"chat_templates\.m: .*looks like a file path"),
        ({"chat_template": "{% for m in messages %}"}, "chat_template: not a valid Jinja"),
        ({"chat_templates": {"m": "{{ oops"}}, r"chat_templates\.m: not a valid Jinja"),
    ],
    ids=["missing-file", "missing-file-per-model", "syntax", "syntax-per-model"],
)
def test_a_template_that_cannot_load_stops_start_up_naming_the_field(
    fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        TokenizerSet.from_config(Config(tokenizer=str(PACKAGED_TOKENIZER), **fields))


def test_a_forced_content_format_hands_the_template_a_list_of_parts() -> None:
    looping = "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    # a template auto-detection reads as "string" (it never loops over the content)
    auto = LocalTokenizer(PACKAGED_TOKENIZER, chat_template=looping)
    forced = LocalTokenizer(PACKAGED_TOKENIZER, chat_template=looping, content_format="openai")
    assert auto.render_chat(CHAT, add_generation_prompt=False) == '"Hello there"'
    assert forced.render_chat(CHAT, add_generation_prompt=False) == (
        '[{"type": "text", "text": "Hello there"}]'
    )


def test_a_request_template_that_does_not_compile_is_a_400() -> None:
    local = LocalTokenizer(PACKAGED_TOKENIZER)
    with pytest.raises(BadRequest, match=r"'chat_template' is not a valid Jinja template"):
        local.render_chat(CHAT, template_source="{% if %}")


Answer = Callable[[httpx.Request], httpx.Response]


def engine(chat: Callable[[dict[str, Any]], list[int]]) -> Answer:
    """A worker answering /v1/models, and /tokenize: prompts with the packaged tokenizer,
    chats with `chat(body)` (how the engine renders them)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": "m", "object": "model", "max_model_len": 4064}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            if "messages" not in body:  # the router's own probes
                return httpx.Response(200, json={"tokens": RAW.encode(body["prompt"]).ids})
            return httpx.Response(200, json={"tokens": chat(body)})
        return httpx.Response(200, json={})

    return answer


@asynccontextmanager
async def router(
    tokenizer: str, trust: bool, seen: list[dict[str, Any]]
) -> AsyncIterator[RouterApp]:
    """A router before one worker whose /tokenize renders with the request's template when
    it has one (as an engine that trusts it does)."""

    def chat(body: dict[str, Any]) -> list[int]:
        seen.append(body)
        text = LocalTokenizer(PACKAGED_TOKENIZER).render_chat(
            body["messages"],
            add_generation_prompt=body["add_generation_prompt"],
            template_source=body.get("chat_template"),
        )
        return list(RAW.encode(text).ids)

    client = httpx.AsyncClient(transport=httpx.MockTransport(engine(chat)))
    config = Config(
        workers=(WorkerConfig("http://w:8000", mode="approx"),),
        tokenizer=tokenizer,
        trust_request_chat_template=trust,
    )
    app = RouterApp(config, client=client)
    try:
        await app.pool.set_workers(config.workers)
        seen.clear()
        yield app
    finally:
        await app.pool.stop()
        await client.aclose()


@pytest.mark.parametrize("tokenizer", [str(PACKAGED_TOKENIZER), REMOTE], ids=["local", "remote"])
@pytest.mark.parametrize("trust", [True, False], ids=["trusted", "untrusted"])
async def test_a_requests_own_template_is_rendered_only_where_the_engines_trust_it(
    tokenizer: str, trust: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "m", "messages": CHAT, "chat_template": MINE}
    rin = parse("chat", json.dumps(body).encode())
    seen: list[dict[str, Any]] = []
    with caplog.at_level(logging.WARNING):
        async with router(tokenizer, trust, seen) as app:
            tokens = list(await app.routing.tokens(rin, None))
            await app.routing.tokens(parse("chat", json.dumps(body).encode()), None)
    own = LocalTokenizer(PACKAGED_TOKENIZER).render_chat(CHAT)
    text = "<<USER>>Hello there" if trust else own
    assert tokens == RAW.encode(text, add_special_tokens=tokenizer == REMOTE).ids
    sent = {b.get("chat_template") for b in seen}
    assert sent == ({MINE if trust else None} if tokenizer == REMOTE else set())
    warned = [r for r in caplog.records if "--trust-request-chat-template" in r.getMessage()]
    assert len(warned) == (0 if trust else 1)  # once, not per request


@pytest.mark.parametrize("flag", [True, False], ids=["flag", "no-flag"])
async def test_an_engine_with_its_own_template_is_caught_unless_given_the_flag(flag: bool) -> None:
    """The start-up probe tokenizes a chat here and on the worker: an engine run with
    --chat-template renders another text, which /health names with the fix."""

    own = LocalTokenizer(PACKAGED_TOKENIZER, chat_template=MINE)
    worker = engine(lambda body: own.chat(body["messages"]))
    client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    config = Config(
        workers=(WorkerConfig("http://w:8000", mode="approx"),),
        tokenizer=str(PACKAGED_TOKENIZER),
        chat_template=MINE if flag else None,
    )
    app = RouterApp(config, client=client)
    try:
        await app.pool.set_workers(config.workers)
        (handle,) = app.pool.handles.values()
        await app.pool.checks.check_tokenizers(handle)
        problem = handle.problems.get("tokenizer")
    finally:
        await app.pool.stop()
        await client.aclose()
    if flag:
        assert problem is None
    else:
        assert problem is not None and "chat probe" in problem and "--chat-template" in problem
