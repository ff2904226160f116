"""Check 4b: chat rendering parity on the request shapes vLLM converts before its template.
Each chat goes through kvroute's request parser and local tokenizer and through the
engine's /tokenize, and the tokens must be equal: content parts of every text type, tool
definitions and tool calls (JSON arguments, malformed ones, empty lists), documents,
`continue_final_message` (string and list content, trailing spaces), developer messages
folded into the system message, the "openai" content format (a template that loops over a
message's parts, extra part fields included), and media: kvroute's tokens for a chat with
an image are the head of the engine's for the same chat with the image as text; and a
multimodal processor's own chat template, which vLLM renders chats without tools with.

vLLM only (the simulator renders string content only). The engine is the check's own,
started with `--trust-request-chat-template` so that a request may carry the template;
kvroute reads the same template from a copy of the model's tokenizer folder, and again as
the engines' `--chat-template` would give it (kvroute's flag of that name) and as the
request's own `chat_template` (kvroute's `--trust-request-chat-template`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from conformance.checks.tokenizer import _first_difference
from conformance.client import _json, client
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import TOKENIZE
from conformance.vllm_server import VllmServer
from router.openai_req import RoutingInput, parse
from router.tokenize import LocalTokenizer

# templates by name; None: the model's own (string content)
TOOLS = (
    "{{ bos_token }}{% if tools is not none %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if documents is not none %}<docs>{{ documents | tojson }}</docs>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m.name is defined %} {{ m.name }}{% endif %}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% if p.cache_control is defined %}{{ p.cache_control | tojson }}{% endif %}"
    "{% else %}<{{ p['type'] }}>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES: dict[str, str | None] = {"own": None, "tools": TOOLS, "parts": PARTS}

USER = {"role": "user", "content": "What is the weather in Oslo?"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
FIRST = {"type": "text", "text": "First part."}
TEXT_PARTS: list[Any] = [
    FIRST,
    {"type": "input_text", "text": "Input text part."},
    {"type": "output_text", "text": "Output text part."},
    {"type": "refusal", "refusal": "A refusal."},
    {"type": "thinking", "thinking": "A thought.", "closed": True},
    "A bare string part.",
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}

# (name, template, body fields)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("text-parts", "own", {"messages": [{"role": "user", "content": TEXT_PARTS}]}),
    # with tools vLLM skips the processor's template for the tokenizer's
    ("own-with-tools", "own", {"messages": [USER], "tools": [WEATHER]}),
    (
        "empty-parts",  # dropped before a string template, kept for an openai one
        "own",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}, FIRST, ""]}]},
    ),
    (
        "empty-parts-openai",
        "parts",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}, FIRST]}]},
    ),
    (
        "assistant-parts",
        "own",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": TEXT_PARTS[3:5]},
                {"role": "user", "content": "Go on."},
            ]
        },
    ),
    (
        "continue-string",
        "own",
        {"messages": [USER, {"role": "assistant", "content": "It is sunny, "}], **CONTINUE},
    ),
    (
        "continue-parts",
        "own",
        {"messages": [USER, {"role": "assistant", "content": TEXT_PARTS[:2]}], **CONTINUE},
    ),
    (
        "developer",
        "own",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                USER,
                {"role": "developer", "content": "Answer in Celsius."},
            ]
        },
    ),
    (
        "billing-header",
        "own",
        {
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=42\nBe terse."},
                USER,
            ]
        },
    ),
    ("no-tools", "tools", {"messages": [USER]}),
    (
        "tool-calls",
        "tools",
        {
            "tools": [WEATHER],
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "r"},
                {"role": "tool", "tool_call_id": "call_1", "content": [TEXT_PARTS[0]] * 2},
                {"role": "assistant", "content": "Cold.", "tool_calls": []},
                {"role": "user", "content": "Thanks!", "name": "bob"},
            ],
        },
    ),
    (
        "bad-arguments",
        "tools",
        {
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {**CALL, "function": {"name": "get_weather", "arguments": "{bad"}},
                        {**CALL, "id": "call_2", "function": {"name": "f", "arguments": "[1]"}},
                    ],
                },
            ],
        },
    ),
    (
        "documents",
        "tools",
        {
            "messages": [USER],
            "chat_template_kwargs": {"documents": [{"title": "t", "text": "d"}], "x": None},
        },
    ),
    ("parts-string", "parts", {"messages": [USER]}),
    (
        "parts-extras",
        "parts",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [{**FIRST, "cache_control": {"type": "ephemeral"}}],
                },
                {"role": "user", "content": TEXT_PARTS},
                {"role": "assistant", "content": None},
                {"role": "tool", "tool_call_id": "c", "content": TEXT_PARTS[:2]},
            ]
        },
    ),
    (
        "parts-continue",
        "parts",
        {"messages": [USER, {"role": "assistant", "content": TEXT_PARTS[:2]}], **CONTINUE},
    ),
]

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
IMAGE_AS_TEXT = {"type": "text", "text": "an image"}
MEDIA = [
    ("media-string", "own"),
    ("media-parts", "parts"),
]


def _media_chat(part: Mapping[str, Any]) -> list[dict[str, Any]]:
    doc = "A long system prompt, shared by every request of this tenant. " * 20
    look = [{"type": "text", "text": "Look at this:"}, part, "What is it?"]
    return [{"role": "system", "content": doc}, {"role": "user", "content": look}]


def _folder(model_dir: Path, out: Path, template: str | None) -> Path:
    """The model's tokenizer files with `template` as its chat template; None: its own, and
    its processor's files (a template the engine gets by request replaces both)."""
    out.mkdir(parents=True, exist_ok=True)
    names = ("tokenizer.json", "special_tokens_map.json")
    for name in names if template is not None else (*names, *PROCESSOR_FILES):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, out / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# A multimodal processor (transformers' LlavaProcessor over an image processor's config,
# no weights), whose chat template vLLM renders a chat without tools with, before the
# tokenizer's: the model's own template with a mark in front, so the two tell apart.
PROCESSOR_FILES = ("preprocessor_config.json", "chat_template.json")
PREPROCESSOR = {
    "processor_class": "LlavaProcessor",
    "image_processor_type": "CLIPImageProcessor",
    "crop_size": {"height": 224, "width": 224},
    "size": {"shortest_edge": 224},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
PROCESSOR_MARK = "[processor] "


def _with_processor(model_dir: Path, out: Path) -> Path:
    """A copy of the model's folder with a multimodal processor and its chat template."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    own = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": PROCESSOR_MARK + own}))
    return out


def _kvroute_tokens(local: LocalTokenizer, rin: RoutingInput) -> list[int]:
    """Tokens as the router's decision service asks for them (`router.routing`)."""
    assert rin.messages is not None
    return local.chat(
        rin.messages,
        add_generation_prompt=rin.add_generation_prompt,
        extra=rin.template_kwargs(),
        add_special_tokens=rin.add_special_tokens,
        continue_final_message=rin.continue_final_message,
        template_source=rin.chat_template,  # as with --trust-request-chat-template
    )


def _record(f: Findings, case: str, mine: list[int], theirs: list[int], head: bool) -> None:
    same = mine == (theirs[: len(mine)] if head else theirs)
    f.evidence.setdefault("cases", {})[case] = {
        "tokens": len(theirs),
        "kvroute": len(mine),
        "equal" if not head else "head": same,
    }
    if not same:
        at = _first_difference(mine, theirs)
        f.problems.append(
            f"{case}: kvroute {len(mine)} tokens, engine {len(theirs)}; first difference at "
            f"{at}: kvroute {mine[at : at + 5]} vs engine {theirs[at : at + 5]}"
        )


@check(
    "tokenizer-chat",
    "kvroute renders chat requests as vLLM does: text part types, tools and tool calls, "
    "documents, continue_final_message, developer messages, an openai-format template, "
    "media routed by the text before it (kvroute's tokens = engine's /tokenize)",
    needs=(TOKENIZE,),
    targets=("vllm",),
)
async def tokenizer_chat(ctx: Context, f: Findings) -> None:
    work = ctx.folder("tokenizer-chat")
    model_dir = _with_processor(ctx.tokenizer_dir, work / "model")
    locals_ = {
        name: LocalTokenizer(_folder(model_dir, work / name, t), piece_chars=24, fine_chars=6)
        for name, t in TEMPLATES.items()
    }
    # the same templates given as the engines' --chat-template, over the model's own folder
    flagged = {
        name: LocalTokenizer(model_dir, chat_template=t, piece_chars=24, fine_chars=6)
        for name, t in TEMPLATES.items()
        if t is not None
    }
    plain = LocalTokenizer(model_dir, piece_chars=24, fine_chars=6)
    compared = 0
    server = VllmServer(
        model_dir,
        num_gpu_blocks=32,
        kv_events=False,
        extra_args=("--trust-request-chat-template", "--exclude-tools-when-tool-choice-none"),
        log_dir=work,
    )
    with server:
        async with client(server.url) as http:
            for name, template, fields in CASES:
                rin = parse("chat", json.dumps({"model": "m", **fields}).encode())
                mine = _kvroute_tokens(locals_[template], rin)
                theirs = await _engine_tokens(http, server.model, fields, template)
                _record(f, name, mine, theirs, head=False)
                compared += 1
                if template in flagged:
                    mine = _kvroute_tokens(flagged[template], rin)
                    _record(f, f"{name} [--chat-template]", mine, theirs, head=False)
                    own = {"model": "m", **fields, "chat_template": TEMPLATES[template]}
                    mine = _kvroute_tokens(plain, parse("chat", json.dumps(own).encode()))
                    _record(f, f"{name} [request chat_template]", mine, theirs, head=False)
                    compared += 2
            for name, template in MEDIA:
                rin = parse(
                    "chat", json.dumps({"model": "m", "messages": _media_chat(IMAGE)}).encode()
                )
                mine = _kvroute_tokens(locals_[template], rin)
                fields = {"messages": _media_chat(IMAGE_AS_TEXT)}
                theirs = await _engine_tokens(http, server.model, fields, template)
                _record(f, name, mine, theirs, head=True)
                f.require(len(mine) >= 32, f"{name}: the text before the image fills no block")
            await _choice_none(f, http, server.model, locals_["tools"])
    f.require(compared > len(CASES), "no case used a template given by flag or by request")
    plain_chat = locals_["own"].render_chat([USER])
    tools_chat = locals_["own"].render_chat([USER], extra={"tools": [WEATHER]})
    f.require(
        plain_chat.startswith(PROCESSOR_MARK) and not tools_chat.startswith(PROCESSOR_MARK),
        "the processor's template did not render the chats without tools, so the cases "
        "equal to the engine's prove nothing of it",
    )
    f.note("compared", compared + len(MEDIA))


async def _choice_none(
    f: Findings, http: httpx.AsyncClient, model: str, local: LocalTokenizer
) -> None:
    """With --exclude-tools-when-tool-choice-none the engine's chat completion renders a
    tool_choice "none" chat without its tools (its /tokenize does not: the prompt it ran
    comes from `return_token_ids`); so does kvroute with the flag of that name."""
    fields = {"messages": [USER], "tools": [WEATHER], "tool_choice": "none"}
    rin = parse("chat", json.dumps({"model": "m", **fields}).encode())
    body = {"model": model, **fields, "chat_template": TEMPLATES["tools"]}
    body |= {"max_tokens": 1, "return_token_ids": True}
    doc = _json(await http.post("/v1/chat/completions", json=body))
    theirs = [int(t) for t in doc["prompt_token_ids"]]
    mine = local.chat(rin.messages or [], extra=rin.template_kwargs(True))
    _record(f, "tool-choice-none [--exclude-tools-when-tool-choice-none]", mine, theirs, False)
    with_tools = local.chat(rin.messages or [], extra=rin.template_kwargs(False))
    f.require(with_tools != theirs, "the tools template rendered no tools: the case proves nothing")


async def _engine_tokens(
    http: httpx.AsyncClient, model: str, fields: Mapping[str, Any], template: str
) -> list[int]:
    body = {"model": model, **fields}
    if TEMPLATES[template] is not None:
        body["chat_template"] = TEMPLATES[template]
    return [int(t) for t in _json(await http.post("/tokenize", json=body))["tokens"]]
