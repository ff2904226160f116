"""Chat messages as vLLM 0.32's OpenAI server hands them to the chat template (its
`renderers/chat_utils.py` `parse_chat_messages` and the request model before it), so that
the text kvroute renders, and the block hashes after it, are the engine's.

- Content parts of every text type (`text`, `input_text`, `output_text`, `refusal`,
  `thinking`) become text. A "string" template gets each message's texts joined by newlines;
  an "openai" template (one that loops over `message['content']`) gets a list of
  `{"type": "text", "text": ...}` parts, media parts as `{"type": "image"}` and so on.
- A media part cannot be rendered here: the engine writes its model's own placeholder and
  expands it into image tokens, and hashes those blocks with the media's hash besides. Only
  the text before it can match a cache, so the first media part becomes `MEDIA_MARK`, and
  the renderer keeps what comes before the mark (`router.tokenize_chat.render`).
- Message fields the template sees are the ones vLLM copies, in its order; tool calls as
  its request model validates them, their JSON arguments parsed (malformed: `{}`); a tool
  message's text parts joined; `developer` turned into `system` when the template never
  names that role."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from router.core.errors import BadRequest

ContentFormat = Literal["string", "openai"]

# Stands in for the first media part; the rendered text is cut where it appears.
MEDIA_MARK = "\x00kvroute:media\x00"

# part type -> the key holding its text
TEXT_TYPES = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# part type -> the modality vLLM names it by in an "openai" template's parts
MEDIA_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
    "prompt_embeds": "prompt_embeds",
}
# what a part without a `type` (or with a `uuid`) is taken for, by its first key found
_UNTYPED = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# keys of vLLM's content part types; the others ride along on an "openai" template's parts
_PART_FIELDS = frozenset(
    {
        *("audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil"),
        *("image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text"),
        *("thinking", "type", "uuid", "video_embeds", "video_url"),
    }
)
_SKIP_NONE = ("text", "refusal")
_BILLING_HEADER = "x-anthropic-billing-header"


def conversation(
    messages: Sequence[Mapping[str, Any]], fmt: ContentFormat, *, speaks_developer: bool
) -> list[dict[str, Any]]:
    """The messages the template renders. A media part's place holds `MEDIA_MARK`."""
    media = _Media()
    out = [_message(m, fmt, media) for m in messages]
    if not speaks_developer and any(m["role"] == "developer" for m in out):
        out = _merge_systems([_as_system(m) for m in out])
    return out


class _Media:
    """Whether the first media part has been replaced by the mark yet."""

    def __init__(self) -> None:
        self.seen = False

    def mark(self) -> bool:
        first, self.seen = not self.seen, True
        return first


def _message(m: Mapping[str, Any], fmt: ContentFormat, media: _Media) -> dict[str, Any]:
    role = m["role"]
    parts = _parts(m.get("content"))
    if role == "system":
        parts = _strip_billing_header(parts)
    out: dict[str, Any] = {"role": role, "content": _content(parts, fmt, media)}
    if role == "assistant":
        _assistant_fields(m, out)
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        out["content"] = _tool_content(out["content"])
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _content(parts: list[Any], fmt: ContentFormat, media: _Media) -> Any:
    """vLLM's `_parse_chat_message_content_parts`."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            if fmt == "openai":
                out.append({"type": "text", "text": part})
            elif part:  # vLLM keeps only parts that parsed to something: "" is dropped
                out.append(part)
            continue
        if not isinstance(part, dict):
            raise BadRequest("a content part must be a string or an object", param="messages")
        kind = _kind(part)
        if kind in MEDIA_TYPES:
            if fmt == "string":
                # The engine puts its placeholders at the head of the message's text (or
                # in the part's place when it interleaves): the text is certain only up
                # to the start of the content.
                return MEDIA_MARK if media.mark() else ""
            out.append(_openai_media(part, kind, media))
            continue
        value = part.get("name") if kind == "tool_reference" else part.get(TEXT_TYPES[kind])
        if value is None and kind in _SKIP_NONE:
            continue
        if fmt == "string":
            # an empty text, or a tool reference without a name, parses to nothing there
            text = "" if value is None and kind == "tool_reference" else _text(value)
            if text:
                out.append(text)
        elif kind == "tool_reference":
            out.append({"type": "tool_reference", "name": value})
        else:
            out.append({"type": "text", "text": value, **_extra_fields(part)})
    return out if fmt == "openai" else "\n".join(out)


def _kind(part: Mapping[str, Any]) -> str:
    """The part's type as vLLM reads it (`_parse_chat_message_content_mm_part`)."""
    kind = part.get("type")
    uuid = part.get("uuid")
    known = isinstance(kind, str) and (kind in TEXT_TYPES or kind in MEDIA_TYPES)
    if (known or kind == "tool_reference") and uuid is None:
        return str(kind)
    if kind is None or uuid is not None:
        found = next((k for k in _UNTYPED if k in part), None)
        if found is None:
            raise BadRequest("Missing 'type' field in multimodal part.", param="type")
        return found
    if not isinstance(kind, str):
        raise BadRequest("Invalid 'type' field in multimodal part.", param="type")
    supported = ", ".join(sorted({*TEXT_TYPES, *MEDIA_TYPES, "tool_reference"}))
    raise BadRequest(
        f"Unsupported chat content part type: {kind!r}. Supported types: {supported}.",
        param="type",
    )


def _openai_media(part: Mapping[str, Any], kind: str, media: _Media) -> dict[str, Any]:
    if media.mark():
        return {"type": "text", "text": MEDIA_MARK}
    # rendered after the mark, so cut off: what it holds does not matter
    return {"type": MEDIA_TYPES[kind], **_extra_fields(part)}


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise BadRequest("a text content part must hold a string", param="messages")
    return value


def _extra_fields(part: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k not in _PART_FIELDS}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Claude Code's attribution line changes on every request; vLLM drops it from system
    text so that the prompt after it still hits the cache."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _assistant_fields(m: Mapping[str, Any], out: dict[str, Any]) -> None:
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadRequest("'tool_calls' must be a list", param="tool_calls")
        if calls:  # an empty list is dropped: the template takes its plain path
            out["tool_calls"] = [_tool_call(c) for c in calls]
    reasoning = m.get("reasoning")
    if reasoning is None:  # the request model renames the deprecated field
        reasoning = m.get("reasoning_content")
    if reasoning is not None:
        out["reasoning"] = reasoning
        out["reasoning_content"] = reasoning


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call as vLLM's request model validates it (its fields first, in their order,
    then the others) with its JSON `arguments` parsed into an object."""
    if not isinstance(call, dict):
        raise BadRequest("assistant tool_calls entries must be objects.", param="tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise BadRequest(
            "chat completions only support assistant tool_calls of type 'function'.",
            param="tool_calls",
        )
    fn = _ordered(function, ("arguments", "name"))
    fn["arguments"] = _arguments(function.get("arguments"))
    out = _ordered(call, ("id", "function", "type"))
    out["function"] = fn
    return out


def _ordered(d: Mapping[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
    out = {k: d[k] for k in first if k in d}
    out.update((k, v) for k, v in d.items() if k not in out)
    return out


def _arguments(arguments: Any) -> Any:
    """vLLM keeps a conversation going past bad arguments: whatever is not a JSON object
    becomes `{}`."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # nested past the parser's depth: bad too
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _tool_content(content: Any) -> Any:
    """Tool results sent as text parts are joined into one string (most templates take a
    string there); a list with anything but text stays a list."""
    if not isinstance(content, list):
        return content
    if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return content
    texts = [p.get("text", "") for p in content if isinstance(p, dict)]
    return "\n".join(texts) if texts else ""


def _as_system(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] != "developer":
        return m
    return {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}


def _merge_systems(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_consolidate_system_messages`: every system message merged into one, first
    (some templates accept a system message only there)."""
    systems = [i for i, m in enumerate(msgs) if m["role"] == "system"]
    if not systems or systems == [0]:
        return msgs
    texts = [_system_text(msgs[i].get("content")) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in msgs if m["role"] != "system")]


def _system_text(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    texts = [p.get("text") if isinstance(p, dict) else p for p in content]
    return "\n".join(t for t in texts if isinstance(t, str))
