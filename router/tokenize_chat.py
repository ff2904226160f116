"""Chat templates rendered the way vLLM 0.32 renders them: the Jinja template of the model
folder, sandboxed like transformers' `apply_chat_template` (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`, its `tojson`, the `{% generation %}` tag), given the
messages as vLLM's OpenAI server converts them (`router.tokenize_conversation`), in the
content format it detects from the template, and cut as `continue_final_message` cuts."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from router.core.errors import BadRequest
from router.tokenize_chat_format import content_format
from router.tokenize_conversation import MEDIA_MARK, ContentFormat, conversation

# transformers appends this to the final message's text and cuts the rendering there
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training
    masks; rendering prints its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and what vLLM reads from its source."""

    template: jinja2.Template
    source: str
    content_format: ContentFormat  # how messages' content is handed to it
    speaks_developer: bool  # names the "developer" role: otherwise it becomes "system"


def compile_template(source: str, fmt: str = "auto") -> ChatTemplate:
    """`fmt`: "auto" detects the content format from the template, as vLLM does by default;
    "string" or "openai" is what the engines' `--chat-template-content-format` forces."""
    try:
        template = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"not a valid Jinja template: {exc} (line {exc.lineno})") from None
    return ChatTemplate(
        template,
        source,
        content_format(_ENV, source) if fmt == "auto" else fmt,  # type: ignore[arg-type]
        '"developer"' in source or "'developer'" in source,
    )


@functools.lru_cache(maxsize=64)
def request_template(source: str, fmt: str = "auto") -> ChatTemplate:
    """A request's own `chat_template` (`--trust-request-chat-template`), compiled once:
    clients that send one send the same one again."""
    try:
        return compile_template(source, fmt)
    except ValueError as exc:
        raise BadRequest(f"'chat_template' is {exc}", param="chat_template") from None


def load_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: a file's path, or the
    template itself (a value holding any of `{`, `}` or a newline that is not a file)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(
            f"{value!r} looks like a file path but cannot be read ({exc.strerror}): give the "
            "file the engines' --chat-template names (mounted where the router runs), or the "
            "template itself; vLLM's built-in template names are not known to the router"
        ) from None


def token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some configs
        return str(value.get("content", ""))
    return "" if value is None else str(value)


# The key of a multimodal processor's template among a folder's templates: not a name a
# request or a configuration can give.
PROCESSOR = "\x00processor"
PROCESSOR_CONFIGS = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


def processor_template(folder: Path) -> str | None:
    """The chat template of the folder's multimodal processor, which vLLM renders a chat
    without tools with before the tokenizer's (`resolve_chat_template`: AutoProcessor's,
    when it loads a processor). As transformers' processor loads it: processor_config.json's
    `chat_template`, else chat_template.json's (legacy), else chat_template.jinja. A folder
    whose configurations name no processor class has none: AutoProcessor gives its
    tokenizer. (Where the engines cannot load the processor, a missing dependency, they
    fall back to the tokenizer's: the start-up chat probe reports it, and --chat-template
    fixes it.)"""
    if not any(_names_processor(folder / name) for name in PROCESSOR_CONFIGS):
        return None
    for name in ("processor_config.json", "chat_template.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, dict):
                value = value.get("default")
            if isinstance(value, str):
                return value
    single = folder / "chat_template.jinja"
    return single.read_text(encoding="utf-8") if single.is_file() else None


def _names_processor(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return isinstance(doc, dict) and bool(doc.get("processor_class") or doc.get("chat_template"))


def chat_templates(
    folder: Path, cfg: Mapping[str, Any], fmt: str = "auto"
) -> dict[str, ChatTemplate]:
    """The folder's templates by name, as transformers loads them: `chat_template.jinja` and
    `additional_chat_templates/*.jinja` when there are any (they win), else the
    tokenizer_config.json entry (one template, or a list of named ones); and under
    `PROCESSOR` a multimodal processor's (`processor_template`)."""
    sources = {}
    single = folder / "chat_template.jinja"
    if single.is_file():
        sources["default"] = single.read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            sources[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if not sources:
        entry = cfg.get("chat_template")
        if isinstance(entry, list):
            sources = {t["name"]: t["template"] for t in entry}
        elif entry:
            sources["default"] = entry
    processor = processor_template(folder)
    if processor is not None:
        sources[PROCESSOR] = processor
    return {name: compile_template(source, fmt) for name, source in sources.items()}


def pick(templates: Mapping[str, ChatTemplate], tools: Any) -> ChatTemplate | None:
    """The template a request gets, in vLLM's order: without tools, a multimodal
    processor's; "tool_use" when it carries tools and there is one; else the default."""
    if tools is None and PROCESSOR in templates:
        return templates[PROCESSOR]
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def render(
    template: ChatTemplate | None,
    specials: Mapping[str, str],
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    extra: Mapping[str, Any] | None,
    *,
    continue_final_message: bool = False,
) -> str:
    """The chat as the text the engine tokenizes, or, when a message holds media, the
    text before the first one; 400 when it cannot be rendered."""
    if template is None:
        raise BadRequest(
            "the model's tokenizer has no chat template, so chat requests cannot be "
            "tokenized; use /v1/completions or give the tokenizer a chat_template",
            param="messages",
        )
    if continue_final_message and add_generation_prompt:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    msgs = conversation(
        messages, template.content_format, speaks_developer=template.speaks_developer
    )
    final = _tag_final(msgs, template.source) if continue_final_message else None
    # transformers: the tokenizer's specials, then the kwargs over them, then these
    kwargs = {**specials, "tools": None, "documents": None, **(extra or {})}
    kwargs["add_generation_prompt"] = add_generation_prompt
    try:
        text = template.template.render(messages=msgs, **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        raise BadRequest(f"chat template rejected the messages: {exc}", param="messages") from None
    if final is not None:
        text = _cut_final(text, final)
    at = text.find(MEDIA_MARK)
    return text if at < 0 else text[:at]


def _tag_final(msgs: list[dict[str, Any]], source: str) -> str:
    """Append the tag to the final message's (last) text, as transformers does for
    `continue_final_message`; the text it had."""
    content = msgs[-1].get("content")
    if "content" not in source:
        raise BadRequest(
            'continue_final_message is set to "content" but this is not an accepted field '
            "in the chat_template",
            param="continue_final_message",
        )
    if isinstance(content, str):
        msgs[-1] = {**msgs[-1], "content": content + _CONTINUE_TAG}
        return content
    parts = list(content or [])
    for i in reversed(range(len(parts))):
        if isinstance(parts[i], dict) and "text" in parts[i]:
            text = str(parts[i]["text"])
            parts[i] = {**parts[i], "text": text + _CONTINUE_TAG}
            msgs[-1] = {**msgs[-1], "content": parts}
            return text
    raise BadRequest(
        "continue_final_message is set but we could not find any text to continue in the "
        "final message!",
        param="continue_final_message",
    )


def _cut_final(text: str, final: str) -> str:
    """The rendering up to where the final message's text ends (its trailing spaces gone
    when the template trimmed them)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise BadRequest(
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template",
            param="continue_final_message",
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
