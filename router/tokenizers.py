"""Tokenizers per model: `--tokenizer PATH|remote` is the default for every model,
`--tokenizer MODEL=PATH|remote` (repeatable; `tokenizers: {MODEL: ...}` in YAML) overrides one.
A LoRA adapter uses its base model's tokenizer unless it has its own entry.

Local tokenizers are loaded once per folder at start, so a missing file stops start-up with
the field and the fix; "remote" means the worker's own `/tokenize` (the decision service
asks a worker of the model's pool)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from router.core.config import REMOTE, Config
from router.core.errors import ConfigError
from router.tokenize import LocalTokenizer


class TokenizerSet:
    def __init__(
        self,
        default: str | None,
        per_model: Mapping[str, str] | None = None,
        *,
        preloaded: LocalTokenizer | None = None,
    ) -> None:
        self._default = default or REMOTE
        self._specs = dict(per_model or {})
        self._by_folder: dict[str, LocalTokenizer] = {}
        self._default_local = preloaded
        if preloaded is None and self._default != REMOTE:
            self._default_local = self._load(self._default, "tokenizer")
        for model, spec in self._specs.items():
            if spec != REMOTE:
                self._load(spec, f"tokenizers.{model}")

    @classmethod
    def from_config(cls, config: Config, preloaded: LocalTokenizer | None = None) -> TokenizerSet:
        return cls(config.tokenizer, config.tokenizers, preloaded=preloaded)

    def _load(self, folder: str, field_name: str) -> LocalTokenizer:
        key = str(Path(folder).resolve())
        found = self._by_folder.get(key)
        if found is None:
            try:
                found = self._by_folder[key] = LocalTokenizer(Path(folder))
            except ConfigError as err:
                raise ConfigError(
                    err.message.replace("config field tokenizer", f"config field {field_name}"),
                    param=field_name,
                ) from None
        return found

    def spec(self, model: str, base: str | None = None) -> str:
        """PATH or "remote" for a request naming `model` (`base`: its base model if it is
        a LoRA adapter)."""
        for name in (model, base):
            if name and name in self._specs:
                return self._specs[name]
        return self._default

    def local(self, model: str, base: str | None = None) -> LocalTokenizer | None:
        """The local tokenizer for `model`, or None when it is tokenized remotely."""
        spec = self.spec(model, base)
        if spec == REMOTE:
            return None
        if model not in self._specs and (base is None or base not in self._specs):
            return self._default_local
        return self._load(spec, f"tokenizers.{model}")

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
