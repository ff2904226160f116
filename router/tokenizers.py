"""Tokenizers per model: `--tokenizer PATH|remote` is the default for every model,
`--tokenizer MODEL=PATH|remote` (repeatable; `tokenizers: {MODEL: ...}` in YAML) overrides one.
A LoRA adapter uses its base model's tokenizer unless it has its own entry. The engines'
`--chat-template` (`chat_template`, or `chat_templates: {MODEL: ...}`) replaces the chat
template of the folder, and their `--chat-template-content-format` is followed too.

Local tokenizers are loaded once per folder at start, so a missing file stops start-up with
the field and the fix; "remote" means the worker's own `/tokenize` (the decision service
asks a worker of the model's pool)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.core.config import REMOTE, Config
from router.core.errors import ConfigError
from router.tokenize import LocalTokenizer
from router.tokenize_chat import load_template


@dataclass(frozen=True)
class ChatTemplates:
    """The engines' `--chat-template` (for every model, and per model) and
    `--chat-template-content-format`, as the router's local tokenizers must follow them."""

    default: str | None = None
    per_model: Mapping[str, str] = field(default_factory=dict)
    content_format: str = "auto"


class TokenizerSet:
    def __init__(
        self,
        default: str | None,
        per_model: Mapping[str, str] | None = None,
        *,
        preloaded: LocalTokenizer | None = None,
        templates: ChatTemplates | None = None,
    ) -> None:
        self._default = default or REMOTE
        self._specs = dict(per_model or {})
        t = templates or ChatTemplates()
        self._format = t.content_format
        # template texts read once, at start: None is the folder's own
        self._sources: dict[str | None, str | None] = {None: _read(t.default, "chat_template")}
        for model, value in t.per_model.items():
            self._sources[model] = _read(value, f"chat_templates.{model}")
        self._by_folder: dict[tuple[str, str | None], LocalTokenizer] = {}
        self._default_local = preloaded
        custom = self._sources[None] is not None or self._format != "auto"
        if (preloaded is None or custom) and self._default != REMOTE:
            self._default_local = self._load(self._default, "tokenizer", None)
        for model in {*self._specs, *t.per_model}:
            if self.spec(model) != REMOTE:
                self.local(model)

    @classmethod
    def from_config(cls, config: Config, preloaded: LocalTokenizer | None = None) -> TokenizerSet:
        templates = ChatTemplates(
            config.chat_template, config.chat_templates, config.chat_template_content_format
        )
        return cls(config.tokenizer, config.tokenizers, preloaded=preloaded, templates=templates)

    def _load(self, folder: str, field_name: str, model: str | None) -> LocalTokenizer:
        """The folder's tokenizer with `model`'s chat template (None: every model's)."""
        source = self._sources.get(model, self._sources[None])
        key = (str(Path(folder).resolve()), source)
        found = self._by_folder.get(key)
        if found is None:
            try:
                found = self._by_folder[key] = LocalTokenizer(
                    Path(folder), chat_template=source, content_format=self._format
                )
            except ConfigError as err:
                if err.param == "chat_template":
                    own = model is not None and model in self._sources
                    where = f"chat_templates.{model}" if own else "chat_template"
                    raise ConfigError(
                        err.message.replace("config field chat_template", f"config field {where}"),
                        param=where,
                    ) from None
                raise ConfigError(
                    err.message.replace("config field tokenizer", f"config field {field_name}"),
                    param=field_name,
                ) from None
        return found

    def spec(self, model: str, base: str | None = None) -> str:
        """PATH or "remote" for a request naming `model` (`base`: its base model if it is
        a LoRA adapter)."""
        owner = _first_in(self._specs, model, base)
        return self._default if owner is None else self._specs[owner]

    def local(self, model: str, base: str | None = None) -> LocalTokenizer | None:
        """The local tokenizer for `model`, or None when it is tokenized remotely."""
        spec = self.spec(model, base)
        if spec == REMOTE:
            return None
        owner = _first_in(self._specs, model, base)  # whose tokenizer entry
        styled = _first_in(self._sources, model, base)  # whose chat template entry
        if owner is None and styled is None:
            return self._default_local
        return self._load(spec, "tokenizer" if owner is None else f"tokenizers.{owner}", styled)

    @property
    def all_remote(self) -> bool:
        return self._default == REMOTE and all(s == REMOTE for s in self._specs.values())

    def min_tokens(self, tok: LocalTokenizer, texts: list[str]) -> int:
        """A lower bound on the tokens these texts make, without tokenizing them: no token
        covers more bytes than the tokenizer's longest, so a prompt over the model's length
        by this bound is over it for sure (it can never reject a prompt that fits)."""
        return math.ceil(sum(map(_utf8_len, texts)) / tok.max_token_bytes)


def _utf8_len(text: str) -> int:
    # an ASCII str knows it is (a flag, no scan): its length is its UTF-8 size, and the
    # usual prompt is not copied to be measured
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _first_in(entries: Mapping[Any, object], model: str, base: str | None) -> str | None:
    for name in (model, base):
        if name and name in entries:
            return name
    return None


def _read(value: str | None, field_name: str) -> str | None:
    if value is None:
        return None
    try:
        return load_template(value)
    except ValueError as exc:
        raise ConfigError(f"config field {field_name}: {exc}", param=field_name) from None
