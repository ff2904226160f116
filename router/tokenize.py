"""Tokenization the way vLLM does it, from the model's own tokenizer files.

Completions: the tokenizer's post-processor adds its specials (BOS for Llama-style models).
Chat: the Jinja chat template from tokenizer_config.json is rendered like Hugging Face's
`apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`), then encoded
without specials, because the template places them itself.

Results are cached by content: routers see the same system prompts and documents again and
again, and tokenizing 2k tokens costs about a millisecond.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from router.core.errors import BadRequest, ConfigError

PACKAGED_TOKENIZER = (
    Path(__file__).resolve().parent.parent / "engines" / "sim" / "data" / "tokenizer"
)


class Tokens(list[int]):
    """Token ids that remember their block hashes per (block size, namespace), so a prompt
    seen again (same system prompt, same document) is neither re-tokenized nor re-hashed."""

    __slots__ = ("hash_memo",)

    def __init__(self, ids: list[int]) -> None:
        super().__init__(ids)
        self.hash_memo: dict[object, object] = {}


class TokenCache:
    """A small LRU keyed by request content."""

    def __init__(self, max_items: int = 4096) -> None:
        self._items: OrderedDict[Any, Tokens] = OrderedDict()
        self.max_items = max_items
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Tokens | None:
        ids = self._items.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: Any, ids: list[int]) -> Tokens:
        tokens = ids if isinstance(ids, Tokens) else Tokens(ids)
        self._items[key] = tokens
        if len(self._items) > self.max_items:
            self._items.popitem(last=False)
        return tokens


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str:
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


class LocalTokenizer:
    """A model's tokenizer folder: tokenizer.json + tokenizer_config.json."""

    def __init__(self, folder: Path, cache_items: int = 4096) -> None:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.exists():
            raise ConfigError(
                f"config field tokenizer: {tok_file} not found; point --tokenizer at the "
                "model's folder (the one vLLM loads), or use --tokenizer remote",
                param="tokenizer",
            )
        self.folder = folder
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = _compile_template(template) if template else None
        self.cache = TokenCache(cache_items)
        self._encode: Callable[..., Any] = self._tok.encode

    def completion(self, prompt: str) -> list[int]:
        key = ("c", prompt)
        ids = self.cache.get(key)
        if ids is None:
            ids = self.cache.put(key, self._encode(prompt, add_special_tokens=True).ids)
        return ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise BadRequest(
                "the model's tokenizer has no chat template, so chat requests cannot be "
                "tokenized; use /v1/completions or give the tokenizer a chat_template",
                param="messages",
            )
        msgs = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **(extra or {}),
            )
        except jinja2.exceptions.TemplateError as exc:
            raise BadRequest(
                f"chat template rejected the messages: {exc}", param="messages"
            ) from None

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> list[int]:
        key = (
            "m",
            json.dumps([messages, add_generation_prompt, extra], sort_keys=True, default=str),
        )
        ids = self.cache.get(key)
        if ids is None:
            text = self.render_chat(
                messages, add_generation_prompt=add_generation_prompt, extra=extra
            )
            ids = self._encode(text, add_special_tokens=False).ids
            self.cache.put(key, ids)
        return ids
