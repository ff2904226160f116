"""Chat requests rendered as vLLM 0.32's OpenAI server renders them before it tokenizes:
the template's content format ("string": text parts joined; "openai": a list of parts),
every text part type, media parts (routed by the text before them), continue_final_message,
and the messages and template kwargs vLLM hands the template.

The content-format table was checked against vLLM 0.32.0's own `_detect_content_format`
(same verdict for every row); the `tokenizer-chat` conformance check compares whole
renderings with a real engine's /tokenize."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_chat_template_flags import engine
from tokenizers import Tokenizer

from router.app import RouterApp
from router.core.config import REMOTE, Config, WorkerConfig
from router.core.errors import BadRequest
from router.openai_req import parse
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer
from router.tokenize_chat import compile_template, render

pytestmark = pytest.mark.timeout(60)

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
# a template that loops over a message's parts, shaped like Gemma 3's: the system text is
# read from the first part, media parts print a placeholder
GEMMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'][0]['text'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "<start_of_turn>{{ message['role'] }}\n{% if loop.first %}{{ prefix }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# the packaged tokenizer's template: string content
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PARTS_AS_JSON = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% for p in m['content'] %}{{ p | tojson }}{% endfor %};{% endfor %}"
)


def rendered(source: str, messages: list[dict[str, Any]], *, gen: bool = True, **kw: Any) -> str:
    return render(compile_template(source), SPECIALS, messages, gen, kw.pop("extra", None), **kw)


# ---- the content format, as vLLM detects it ------------------------------------------

FORMATS = [
    pytest.param("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string", id="plain"),
    pytest.param(
        "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
        "openai",
        id="loop-over-content",
    ),
    pytest.param(
        "{% for m in messages %}{% for c in m.content | list %}x{% endfor %}{% endfor %}",
        "openai",
        id="attribute-and-filter",
    ),
    pytest.param(GEMMA_LIKE, "openai", id="gemma-like-alias-of-messages"),
    pytest.param(
        "{% macro r(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m['content']) }}{% endfor %}",
        "openai",
        id="macro-parameter",
    ),
    pytest.param(
        "{% for m in messages %}{% set content = m['content'] %}"
        "{% for item in content %}{{ item }}{% endfor %}{% endfor %}",
        "openai",
        id="bare-content",
    ),
    pytest.param(
        "{% macro r(x) %}{% for p in x %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.role) }}{% endfor %}",
        "string",
        id="macro-over-something-else",
    ),
    pytest.param(
        "{% set first = messages[0] %}{% for c in first['content'] %}{% endfor %}",
        "string",
        id="indexed-message-is-not-a-loop",
    ),
    pytest.param(
        "{% for i, m in messages %}{% for c in m['content'] %}{% endfor %}{% endfor %}",
        "string",
        id="tuple-target-unreadable",
    ),
    pytest.param(CHATML, "string", id="packaged-chatml"),
]


@pytest.mark.parametrize(("source", "expected"), FORMATS)
def test_content_format_is_detected_as_vllm_detects_it(source: str, expected: str) -> None:
    assert compile_template(source).content_format == expected


# ---- content parts -------------------------------------------------------------------


def test_an_openai_format_template_gets_content_as_a_list_of_parts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    assert rendered(GEMMA_LIKE, messages) == (
        "<s><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    )


def test_openai_format_parts_carry_their_extra_fields_and_every_text_type() -> None:
    content = [
        {"type": "input_text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "thinking", "thinking": "t", "closed": True},
        {"type": "refusal", "refusal": "no"},
        {"type": "text"},  # no text: skipped
    ]
    text = rendered(PARTS_AS_JSON, [{"role": "user", "content": content}])
    assert text == (
        'user:{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}'
        '{"type": "text", "text": "t"}{"type": "text", "text": "no"};'
    )


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "x"},
        {"type": "input_text", "text": "x"},
        {"type": "output_text", "text": "x"},
        {"type": "refusal", "refusal": "x"},
        {"type": "thinking", "thinking": "x", "closed": True},
        "x",
    ],
    ids=["text", "input_text", "output_text", "refusal", "thinking", "bare-string"],
)
def test_a_string_template_gets_every_text_part_joined_by_newlines(part: Any) -> None:
    content = [{"type": "text", "text": "first"}, part]
    assert rendered(CHATML, [{"role": "user", "content": content}]) == (
        "<s><|im_start|>user\nfirst\nx<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "audio", "text": "x"}, "Unsupported chat content part type: 'audio'"),
        ({"text": "x"}, "Missing 'type' field"),
    ],
    ids=["unknown-type", "no-type"],
)
def test_parts_vllm_refuses_are_400s(part: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        rendered(CHATML, [{"role": "user", "content": [part]}])


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


@pytest.mark.parametrize(
    ("source", "prefix"),
    [
        # the placeholders go at the head of the message's text: certain up to its start
        (CHATML, "<s><|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"),
        # the template writes the part itself: certain up to the part
        (GEMMA_LIKE, "<s><start_of_turn>user\nS\n\nLook:"),
    ],
    ids=["string", "openai"],
)
@pytest.mark.parametrize(
    "media",
    [
        IMAGE,
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"image_url": "u"},
    ],
    ids=["image_url", "input_audio", "untyped-image"],
)
def test_media_is_routed_by_the_text_before_it(
    source: str, prefix: str, media: dict[str, Any]
) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, media, "and this"]},
        {"role": "user", "content": [IMAGE]},
    ]
    assert rendered(source, messages) == prefix


def test_a_media_request_tokenizes_to_its_certain_prefix() -> None:
    local = LocalTokenizer(PACKAGED_TOKENIZER)
    raw = Tokenizer.from_file(str(PACKAGED_TOKENIZER / "tokenizer.json"))
    doc = "The quick brown fox jumps over the lazy dog. " * 20
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": ["hi", IMAGE]}]
    prefix = f"<s><|im_start|>system\n{doc}<|im_end|>\n<|im_start|>user\n"
    assert local.chat(messages) == raw.encode(prefix, add_special_tokens=False).ids


# ---- continue_final_message -----------------------------------------------------------

REPLY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here "}]


def test_continue_final_message_ends_at_the_final_text() -> None:
    text = rendered(CHATML, REPLY, gen=False, continue_final_message=True)
    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, here "


def test_continue_final_message_after_a_template_trimmed_the_text() -> None:
    # the template trims, so the text the tag follows lost its space: cut and right-strip
    text = rendered(GEMMA_LIKE, REPLY, gen=False, continue_final_message=True)
    assert text == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>assistant\nSure, here"


def test_continue_final_message_continues_the_last_text_part() -> None:
    final = {"role": "assistant", "content": [{"type": "text", "text": "A"}, "B"]}
    text = rendered(PARTS_AS_JSON, [final], gen=False, continue_final_message=True)
    assert text == 'assistant:{"type": "text", "text": "A"}{"type": "text", "text": "B'


def test_continue_final_message_without_a_generation_prompt_is_a_400_otherwise() -> None:
    body = {"model": "m", "messages": REPLY, "continue_final_message": True}
    with pytest.raises(BadRequest, match="Cannot set both"):
        parse("chat", json.dumps(body).encode())
    rin = parse("chat", json.dumps({**body, "add_generation_prompt": "false"}).encode())
    assert rin.continue_final_message and not rin.add_generation_prompt


@asynccontextmanager
async def router(tokenizer: str, seen: list[dict[str, Any]]) -> AsyncIterator[RouterApp]:
    def chat(body: dict[str, Any]) -> list[int]:
        seen.append(body)
        return LocalTokenizer(PACKAGED_TOKENIZER).chat(  # stands in for the engine's render
            body["messages"],
            add_generation_prompt=body["add_generation_prompt"],
            continue_final_message=body.get("continue_final_message", False),
        )

    client = httpx.AsyncClient(transport=httpx.MockTransport(engine(chat)))
    config = Config(workers=(WorkerConfig("http://w:8000", mode="approx"),), tokenizer=tokenizer)
    local = LocalTokenizer(PACKAGED_TOKENIZER) if tokenizer != REMOTE else None
    app = RouterApp(config, tokenizer=local, client=client)
    try:
        await app.pool.set_workers(config.workers)
        seen.clear()  # start-up probes
        yield app
    finally:
        await app.pool.stop()
        await client.aclose()


@pytest.mark.parametrize("tokenizer", [str(PACKAGED_TOKENIZER), REMOTE], ids=["local", "remote"])
async def test_the_router_tokenizes_a_continued_message_as_vllm_does(tokenizer: str) -> None:
    raw = Tokenizer.from_file(str(PACKAGED_TOKENIZER / "tokenizer.json"))
    body = {"messages": REPLY, "continue_final_message": True, "add_generation_prompt": False}
    rin = parse("chat", json.dumps({"model": "m", **body}).encode())
    seen: list[dict[str, Any]] = []
    async with router(tokenizer, seen) as app:
        tokens = list(await app.routing.tokens(rin, None))
    text = "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, here "
    assert tokens == raw.encode(text, add_special_tokens=False).ids
    chats = [b for b in seen if "messages" in b]
    assert all(b["continue_final_message"] for b in chats) and len(chats) == (tokenizer == REMOTE)


# ---- what else vLLM hands the template ------------------------------------------------

TOOLS_AND_DOCS = (
    "{% if tools is not none %}T{{ tools | length }}{% endif %}"
    "{% if documents is not none %}D{% endif %}{{ flag }}|"
    "{% for m in messages %}{{ m | tojson }}{% endfor %}"
)


def test_tools_and_documents_are_none_unless_given() -> None:
    messages = [{"role": "user", "content": "x"}]
    assert rendered(TOOLS_AND_DOCS, messages).startswith("|")
    extra = {"tools": [], "documents": [{"text": "d"}], "flag": "F"}
    assert rendered(TOOLS_AND_DOCS, messages, extra=extra).startswith("T0DF|")


@pytest.mark.parametrize(
    ("kwargs", "fields", "expected"),
    [
        ({"flag": None, "mode": "auto", "keep": 1}, {}, {"keep": 1}),
        ({"add_generation_prompt": False}, {}, {}),
        ({}, {"documents": [{"text": "d"}]}, {"documents": [{"text": "d"}]}),
        ({}, {"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
        ({"enable_thinking": True}, {"reasoning_effort": "low"}, None),
    ],
    ids=["unset-values-dropped", "request-flags-win", "documents", "effort", "asked-thinking"],
)
def test_template_kwargs_merge_as_vllm_merges_them(
    kwargs: dict[str, Any], fields: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    body = {"model": "m", "messages": REPLY, "chat_template_kwargs": kwargs, **fields}
    rin = parse("chat", json.dumps(body).encode())
    if expected is None:
        expected = {"enable_thinking": True, "reasoning_effort": "low"}
    assert (rin.template_extra or {}) == expected


def test_messages_carry_the_fields_vllm_copies_in_its_order() -> None:
    messages = [
        {"role": "user", "content": "q", "name": "bob", "unknown": 1},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "because",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{bad"}, "id": "c"}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}] * 2},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    turns = rendered(TOOLS_AND_DOCS, messages).split("|", 1)[1]
    expected = [
        {"role": "user", "content": "q", "name": "bob"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "function": {"arguments": {}, "name": "f"}, "type": "function"}
            ],
            "reasoning": "because",
            "reasoning_content": "because",
        },
        {"role": "tool", "content": "r\nr", "tool_call_id": "c"},
        {"role": "assistant", "content": "done"},
    ]
    assert turns == "".join(json.dumps(m) for m in expected)


def test_developer_messages_become_one_system_message_when_the_template_has_no_such_role() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "D"}], "tools": []},
    ]
    assert rendered(CHATML, messages, gen=False) == (
        "<s><|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
    )
    speaks = CHATML + "{% if false %}developer: {{ 'developer' }}{% endif %}"
    assert "<|im_start|>developer\nD" in rendered(speaks, messages, gen=False)


def test_claude_codes_billing_line_is_dropped_from_system_text() -> None:
    system = "x-anthropic-billing-header: cc_version=1; cch=abc\nYou are Claude Code."
    text = rendered(CHATML, [{"role": "system", "content": system}], gen=False)
    assert text == "<s><|im_start|>system\nYou are Claude Code.<|im_end|>\n"


def _folder(tmp_path: Path, config: Mapping[str, Any], files: Mapping[str, str]) -> Path:
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((PACKAGED_TOKENIZER / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_request_with_tools_gets_the_tool_use_template(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    local = LocalTokenizer(_folder(tmp_path, {"chat_template": named}, {}))
    chat = [{"role": "user", "content": "x"}]
    assert local.render_chat(chat) == "plain"
    assert local.render_chat(chat, extra={"tools": []}) == "tools"


def test_template_files_win_over_the_config_entry(tmp_path: Path) -> None:
    files = {"chat_template.jinja": "file", "additional_chat_templates/tool_use.jinja": "tools"}
    local = LocalTokenizer(_folder(tmp_path, {"chat_template": "config"}, files))
    chat = [{"role": "user", "content": "x"}]
    assert local.render_chat(chat) == "file"
    assert local.render_chat(chat, extra={"tools": []}) == "tools"


# ---- what vLLM drops before the template ----------------------------------------------


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


@pytest.mark.parametrize(
    ("content", "string", "openai_texts"),
    [
        ([_text(""), _text("hi")], "hi", ["", "hi"]),
        ([_text("a"), _text(""), _text("b")], "a\nb", ["a", "", "b"]),
        ([{"type": "refusal", "refusal": ""}, _text("x")], "x", ["", "x"]),
        ([{"type": "tool_reference"}, _text("x")], "x", [None, "x"]),
    ],
    ids=["empty-first", "empty-between", "empty-refusal", "unnamed-tool-reference"],
)
def test_parts_that_parse_to_nothing_are_dropped_from_string_content(
    content: list[Any], string: str, openai_texts: list[str | None]
) -> None:
    """vLLM keeps a part for a string template only if it parsed to something (an empty
    text joined in would put a newline before the next); an openai template gets them all
    (checked against vLLM 0.32's parse_chat_messages)."""
    from router.tokenize_conversation import conversation

    msgs = [{"role": "user", "content": content}]
    (as_string,) = conversation(msgs, "string", speaks_developer=True)
    assert as_string["content"] == string
    (as_parts,) = conversation(msgs, "openai", speaks_developer=True)
    assert [p.get("text", p.get("name")) for p in as_parts["content"]] == openai_texts


def test_tool_call_arguments_nested_past_the_parsers_depth_are_an_empty_object() -> None:
    from router.tokenize_conversation import conversation

    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": deep}}
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    (out,) = conversation(msgs, "string", speaks_developer=True)
    assert out["tool_calls"][0]["function"]["arguments"] == {}


# ---- a multimodal processor's template ---------------------------------------------------

PROC = "{{ bos_token }}{% for m in messages %}[P {{ m['role'] }}] {{ m['content'] }}{% endfor %}"


def folder_with(tmp_path: Path, files: Mapping[str, str]) -> Path:
    """The packaged tokenizer's folder, plus `files`."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((PACKAGED_TOKENIZER / name).read_bytes())
    for name, text in files.items():
        (out / name).write_text(text)
    return out


PREPROCESSOR = json.dumps({"processor_class": "LlavaProcessor"})


@pytest.mark.parametrize(
    ("files", "processor"),
    [
        ({"preprocessor_config.json": PREPROCESSOR, "chat_template.json": json.dumps({"chat_template": PROC})}, True),  # noqa: E501
        ({"processor_config.json": json.dumps({"chat_template": PROC})}, True),
        ({"chat_template.json": json.dumps({"chat_template": PROC})}, False),
        ({"preprocessor_config.json": PREPROCESSOR}, False),
        ({"preprocessor_config.json": "{}", "chat_template.json": json.dumps({"chat_template": PROC})}, False),  # noqa: E501
    ],
    ids=["legacy-chat-template-json", "processor-config-key", "no-processor", "no-template", "no-processor-class"],  # noqa: E501
)  # fmt: skip
def test_a_multimodal_processors_template_renders_chats_without_tools(
    tmp_path: Path, files: Mapping[str, str], processor: bool
) -> None:
    """vLLM renders a chat without tools with AutoProcessor's template, before the
    tokenizer's; a folder without a processor's configuration has no processor (checked
    against vLLM 0.32 by the tokenizer-chat conformance check)."""
    local = LocalTokenizer(folder_with(tmp_path, files))
    chat = [{"role": "user", "content": "Hello"}]
    text = local.render_chat(chat, add_generation_prompt=False)
    assert ("[P user] Hello" in text) == processor
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with_tools = local.render_chat(chat, add_generation_prompt=False, extra={"tools": [tool]})
    assert "[P user]" not in with_tools  # with tools: the tokenizer's template


async def test_a_processor_template_the_workers_do_not_render_with_is_reported(
    tmp_path: Path,
) -> None:
    """Where the engines' processor does not load (a missing dependency), vLLM renders
    chats with the tokenizer's template: the start-up chat probe reports the mismatch on
    every worker, naming the fix (kvroute never switches on its own: one worker's image
    must not change how the whole fleet's chats are hashed)."""
    from test_serve import kvroute

    legacy = json.dumps({"chat_template": PROC})
    folder = folder_with(
        tmp_path, {"preprocessor_config.json": PREPROCESSOR, "chat_template.json": legacy}
    )
    async with kvroute(tokenizer=str(folder)) as s:
        problems = [h.problems.get("tokenizer") or "" for h in s.app.pool.handles.values()]
        assert len(problems) == 2
        for p in problems:
            assert "tokenizer mismatch" in p and "chat probe" in p
            assert "processor" in p and "--chat-template" in p


@pytest.mark.parametrize(
    ("choice", "flag", "rendered"),
    [("none", True, False), ("none", False, True), ("auto", True, True), (None, True, True)],
)
def test_tool_choice_none_renders_without_tools_where_the_engines_exclude_them(
    choice: str | None, flag: bool, rendered: bool
) -> None:
    """vLLM's --exclude-tools-when-tool-choice-none (checked against vLLM 0.32 by the
    tokenizer-chat conformance check), mirrored by kvroute's flag of that name."""
    from router.cli import build_parser
    from router.serve_cli import load_config

    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    if choice is not None:
        doc["tool_choice"] = choice
    rin = parse("chat", json.dumps(doc).encode())
    assert ("tools" in (rin.template_kwargs(flag) or {})) == rendered
    assert (rin.rendered_tools(flag) is not None) == rendered
    args = ["serve", "--worker", "http://a:1", "--exclude-tools-when-tool-choice-none"]
    assert load_config(
        build_parser("serve").parse_args(args), {}
    ).exclude_tools_when_tool_choice_none
