"""Chat templates rendered the way vLLM renders them: the Jinja template from
tokenizer_config.json, sandboxed like Hugging Face's `apply_chat_template` (trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`); OpenAI content parts flattened to text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox

from router.core.errors import BadRequest


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some configs
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def flatten_content(content: Any) -> Any:
    """OpenAI content parts -> a string, as vLLM does for string-content templates."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    "only text content parts can be routed by prefix; got "
                    f"{part.get('type') if isinstance(part, dict) else type(part).__name__}",
                    param="messages",
                )
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    return content


def chat_template(cfg: Mapping[str, Any]) -> jinja2.Template | None:
    """The template of a tokenizer_config.json (named templates: "default"), compiled."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return compile_template(template) if template else None


def render(
    template: jinja2.Template | None,
    specials: Mapping[str, str],
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    extra: Mapping[str, Any] | None,
) -> str:
    """The chat as the text the engine tokenizes; 400 when it cannot be rendered."""
    if template is None:
        raise BadRequest(
            "the model's tokenizer has no chat template, so chat requests cannot be "
            "tokenized; use /v1/completions or give the tokenizer a chat_template",
            param="messages",
        )
    msgs = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
    try:
        return template.render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **specials, **(extra or {})
        )
    except jinja2.exceptions.TemplateError as exc:
        raise BadRequest(f"chat template rejected the messages: {exc}", param="messages") from None
