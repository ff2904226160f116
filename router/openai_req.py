"""What the router needs from an OpenAI-style request body, without changing the body (it is
forwarded byte for byte, unknown fields included).

Completions and chat are routed by their prompt. The rest of vLLM's API passes through,
routed by the body's `model` (embeddings by their input as well): `parse_passthrough`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from engines.vllm.lax import NotABool, NotAnInt, NotAPrompt, lax_bool, lax_int, lax_prompt
from router.core.errors import BadRequest

_decoder = msgspec.json.Decoder()

# POST paths whose body is a prompt to route by, and how it is tokenized
PROMPT_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

TOKEN_ID_END = 2**32  # token ids are hashed as uint32, as vLLM's events carry them


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class RoutingInput:
    kind: str  # "completion" | "chat" | "none" (no prompt: route by model and load)
    model: str
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # as sent: the tokenizer converts them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the template's kwargs as vLLM merges them (`_template_kwargs`), tools apart
    template_extra: dict[str, Any] | None = None
    tools: list[Any] | None = None  # as vLLM hands them to the template (`vllm_tools`)
    chat_template: str | None = None  # the request's own (engines that trust it render it)
    tool_choice: Any = None  # the request's, as sent
    # vLLM's defaults: the tokenizer's specials (BOS) for completions; none for chat,
    # whose template places its own
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep this many (-1: the context length)
    truncation_side: str | None = None  # "left" | "right"; None: the tokenizer's side
    # the side vLLM loads the tokenizer with (vllm/tokenizers/registry.py): left for
    # generative models, right for pooling ones (embeddings keep the text's start)
    tokenizer_side: str = "left"
    # vLLM's -1 leaves one token of the context for output when the request asks for any
    output_reserved: bool = True
    cache_salt: str | None = None
    stream: bool = False
    max_tokens: int = 16
    n: int = 1
    # the engine judges the prompt's length, not the router: an embeddings input may pass
    # the context length (vLLM chunks or truncates it: --max-embed-len, truncate_prompt_tokens)
    engine_judges_length: bool = False

    @classmethod
    def bodyless(cls, model: str = "") -> RoutingInput:
        """A request without a prompt (GET, or a body kvroute does not read)."""
        return cls("none", model)

    def rendered_tools(self, exclude_tools_when_none: bool = False) -> list[Any] | None:
        """The tools the chat template gets: none for a tool_choice "none" where the
        engines run with --exclude-tools-when-tool-choice-none."""
        if exclude_tools_when_none and self.tool_choice == "none":
            return None
        return self.tools

    def template_kwargs(self, exclude_tools_when_none: bool = False) -> dict[str, Any] | None:
        """What a chat template gets beside the messages: the kwargs, and the tools."""
        tools = self.rendered_tools(exclude_tools_when_none)
        if tools is None:
            return self.template_extra
        return {**(self.template_extra or {}), "tools": tools}

    def keep_tokens(self, max_model_len: int | None) -> int | None:
        """How many prompt tokens vLLM keeps (`truncate_prompt_tokens`); None: all. A -1
        needs the context length: unknown, nothing is cut."""
        k = self.truncate_prompt_tokens
        if k is None or max_model_len is None:
            return k if k is not None and k >= 0 else None
        if k > max_model_len:
            raise BadRequest(
                f"truncate_prompt_tokens={k} cannot be greater than max_model_len = "
                f"{max_model_len}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if k < 0:
            return max_model_len - 1 if self.output_reserved else max_model_len
        return k


def parse(kind: str, body: bytes) -> RoutingInput:
    doc = _object(body)
    model = doc.get("model")
    if model is None:
        model = ""  # vLLM's `model: str | None`: none named, the engine's default
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    salt = doc.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", param="cache_salt")
    asked = asked_tokens(doc, kind == "chat")
    common: dict[str, Any] = {
        "model": model,
        "cache_salt": salt or None,
        # `stream: null` is vLLM's default, false; "false" is false too
        "stream": doc.get("stream") is not None and _flag(doc, "stream", False),
        "max_tokens": 16 if asked is None else asked,
        "n": _n(doc),
        "add_special_tokens": _flag(doc, "add_special_tokens", kind != "chat"),
        "truncate_prompt_tokens": _truncate(doc),
        "truncation_side": _side(doc),
        # whether vLLM counts output tokens against the context when it resolves a -1
        # `truncate_prompt_tokens`: a completion's max_tokens (default 16, null too:
        # normalize_null_max_tokens), a chat's max_completion_tokens or else max_tokens
        # (default none)
        "output_reserved": bool(asked) if asked is not None else kind != "chat",
    }
    if kind == "chat":
        return _chat(doc, common)
    return _completion(doc, common)


def parse_request(kind: str | None, path: str, body: bytes) -> RoutingInput:
    """A request as every door routes it: completions and chat (`kind`, from the path) by
    their prompt, any other path by its body (`parse_passthrough`)."""
    return parse(kind, body) if kind is not None else parse_passthrough(path, body)


def parse_passthrough(path: str, body: bytes) -> RoutingInput:
    """Any other endpoint: its `model` if the body is a JSON object naming one; embeddings
    also by their input (tokenized like a completion prompt)."""
    if not body:
        return RoutingInput.bodyless()
    try:
        doc = _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return RoutingInput.bodyless()  # not ours to judge: the worker answers it
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, str):
        return RoutingInput.bodyless()
    if path == "/v1/embeddings" and isinstance(doc.get("input"), (str, list)):
        try:
            common = {
                "model": model,
                "truncate_prompt_tokens": _truncate(doc),
                "truncation_side": _side(doc),
                "tokenizer_side": "right",
                "add_special_tokens": _flag(doc, "add_special_tokens", True),
                "output_reserved": False,  # -1 keeps the whole context: no output
                "engine_judges_length": True,
            }
            return _completion({"prompt": doc["input"]}, common)
        except BadRequest:
            pass
    return RoutingInput.bodyless(model)


BOM = b"\xef\xbb\xbf"  # Python's json, which vLLM's server parses with, skips one


def _object(body: bytes) -> dict[str, Any]:
    try:
        doc = _decoder.decode(body[3:] if body.startswith(BOM) else body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def _int(doc: dict[str, Any], key: str, least: int, what: str) -> int | None:
    """An integer field as vLLM reads it (`lax_int`: "16" and 16.0 are 16); None if unset."""
    value = doc.get(key)
    if value is None:
        return None
    try:
        number = lax_int(value)
    except NotAnInt:
        number = least - 1
    if number < least:
        raise BadRequest(f"'{key}' must be {what}", param=key)
    return number


def _n(doc: dict[str, Any]) -> int:
    n = _int(doc, "n", 1, "a positive integer")
    return 1 if n is None else n


def asked_tokens(doc: dict[str, Any], chat: bool) -> int | None:
    """The output tokens the request asks for; None: unset (vLLM's default applies)."""
    # a completion request has no max_completion_tokens in vLLM: it ignores one sent
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = _int(doc, key, 0, "a non-negative integer")
        if value is not None:
            return value
    return None


def _flag(doc: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field as vLLM reads it (`lax_bool`: "false" and 0 are false)."""
    try:
        return lax_bool(doc.get(key, default))
    except NotABool:
        raise BadRequest(f"'{key}' must be a boolean", param=key) from None


def _truncate(doc: dict[str, Any]) -> int | None:
    return _int(doc, "truncate_prompt_tokens", -1, "an integer >= -1")


def _side(doc: dict[str, Any]) -> str | None:
    value = doc.get("truncation_side")
    if value not in (None, "left", "right"):
        raise BadRequest(
            "'truncation_side' must be either 'left' or 'right'", param="truncation_side"
        )
    return value


def _completion(doc: dict[str, Any], common: dict[str, Any]) -> RoutingInput:
    prompt = doc.get("prompt")
    if prompt is None and doc.get("prompt_embeds"):
        # embeddings in place of a prompt (`--enable-prompt-embeds`): no tokens to route by
        return RoutingInput("none", **common)
    try:
        batch, prompts = lax_prompt(prompt)
    except NotAPrompt:
        raise BadRequest(
            "'prompt' must be a string, a list of token ids, or a batch of either",
            param="prompt",
        ) from None
    if not prompts or (isinstance(prompts[0], list) and not prompts[0]):
        raise BadRequest("'prompt' is empty", param="prompt")
    for ids in prompts:
        if isinstance(ids, list) and ids:
            _check_ids(ids)
    # A batch of prompts is routed by its first prompt: the others go along to the same
    # worker, which runs `n` sequences for each (the load counted at the pick).
    if batch:
        common = {**common, "n": common["n"] * len(prompts)}
    first = prompts[0]
    if isinstance(first, str):
        return RoutingInput("completion", prompt_text=first, **common)
    return RoutingInput("completion", prompt_ids=first, **common)


def _check_ids(ids: list[int]) -> None:
    if min(ids) < 0 or max(ids) >= TOKEN_ID_END:
        bad = next(t for t in ids if not 0 <= t < TOKEN_ID_END)
        raise BadRequest(
            f"'prompt' holds token id {bad}, outside 0..{TOKEN_ID_END - 1}", param="prompt"
        )


def _chat(doc: dict[str, Any], common: dict[str, Any]) -> RoutingInput:
    messages = _messages(doc)
    generation = _flag(doc, "add_generation_prompt", True)
    continues = _flag(doc, "continue_final_message", False)
    # vLLM's request model refuses both set true; transformers refuses the default true
    if generation and continues:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    extra = doc.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    tools = doc.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    kwargs = _template_kwargs(doc, extra or {})
    if kwargs.get("tools") is not None:  # the request's chat_template_kwargs win
        tools = None
    template = doc.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise BadRequest("'chat_template' must be a string", param="chat_template")
    return RoutingInput(
        "chat",
        messages=messages,
        add_generation_prompt=generation,
        continue_final_message=continues,
        template_extra=kwargs or None,
        tools=None if tools is None else [vllm_tool(t) for t in tools],
        chat_template=template,
        tool_choice=doc.get("tool_choice"),
        **common,
    )


def _messages(doc: dict[str, Any]) -> list[dict[str, Any]]:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or a list of content parts",
                param="messages",
            )
    return messages


def _template_kwargs(doc: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    """The template's kwargs as vLLM's chat request builds them: `chat_template_kwargs`
    without its null and "auto" values, under the request's own `documents` and
    `reasoning_effort` (which also sets `enable_thinking`, unless asked). The two prompt
    flags are the request's own, passed apart."""
    out = {k: v for k, v in asked.items() if not _unset(v)}
    for key in ("add_generation_prompt", "continue_final_message"):
        out.pop(key, None)
    if doc.get("documents") is not None:
        out["documents"] = doc["documents"]
    effort = doc.get("reasoning_effort")
    if not _unset(effort):
        out["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in asked:
        out["enable_thinking"] = effort != "none"
    return out


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def vllm_tool(tool: Any) -> Any:
    """A tool as vLLM's request model dumps it for the template: `type` first, and the
    function's `description` and `parameters` present (null when not given), in that
    order; other keys after. The template's tojson prints what it is given, key order
    included."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    f = tool["function"]
    fn = {k: f.get(k) for k in ("name", "description", "parameters")}
    fn.update({k: v for k, v in f.items() if k not in fn})
    out = {"type": tool.get("type", "function"), "function": fn}
    out.update({k: v for k, v in tool.items() if k not in out})
    return out
