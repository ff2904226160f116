"""The simulated engine's tokenizer: a Hugging Face `tokenizers` folder, used as vLLM uses it.

Completions encode with the tokenizer's specials (BOS), chat requests render the folder's
Jinja chat template the way transformers' `apply_chat_template` does (sandboxed,
`trim_blocks`, `lstrip_blocks`) and encode the text without adding specials: the template
writes its own BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"
_WORD = re.compile(r" [a-z]{3,12}")


class ChatTemplateError(ValueError):
    """Messages the chat template rejects (unknown role, missing content, ...)."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def message_text(content: Any) -> str:
    """A message's content as the template sees it: text parts joined by newlines (vLLM's
    "string" content format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise ChatTemplateError(f"unsupported content part: {str(part)[:80]}")
        return "\n".join(parts)
    raise ChatTemplateError(f"message content must be a string or a list of parts, got {content!r}")


class SimTokenizer:
    def __init__(self, folder: Path | str = DEFAULT_TOKENIZER_DIR) -> None:
        self.folder = Path(folder)
        try:
            self.tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
            config: dict[str, Any] = json.loads((self.folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot load a tokenizer from {self.folder}: {exc} (expected tokenizer.json "
                "and tokenizer_config.json, as `python -m engines.sim.make_tokenizer` writes)"
            ) from None
        self.config = config
        self.bos_token: str = str(config.get("bos_token") or "")
        self.eos_token: str = str(config.get("eos_token") or "")
        self.model_max_length = int(config.get("model_max_length") or 4096)
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None
        eos = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int = eos if eos is not None else 0

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, add_special_tokens: bool = True, keep: int | None = None
    ) -> list[int]:
        """`keep`: at most this many ids, truncated as transformers truncates for vLLM (the
        tokenizer's own truncation, from the left for a generative model): the text's ids
        are cut from the left to leave room for the special tokens the post-processor adds,
        and those stay."""
        if keep is None:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        enc = self.tok.encode(text, add_special_tokens=False)
        post = self.tok.post_processor if add_special_tokens else None
        added = post.num_special_tokens_to_add(False) if post is not None else 0
        if len(enc.ids) + added > keep:
            enc.truncate(max(keep - added, 0), direction="left")
        if post is not None:
            enc = self.tok.post_process(enc, add_special_tokens=True)
        return list(enc.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self.tok.id_to_token(i) or "" for i in ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(f"the tokenizer in {self.folder} has no chat template")
        msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
        kwargs = dict(template_kwargs or {})
        kwargs.update(bos_token=self.bos_token, eos_token=self.eos_token)
        kwargs.update(add_generation_prompt=add_generation_prompt)
        try:
            text = self._template.render(messages=msgs, **kwargs)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        if continue_final_message and msgs:
            final = msgs[-1]["content"]
            cut = text.rfind(final) if final else -1
            if cut >= 0:
                text = text[: cut + len(final)]
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        keep: int | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        return self.encode(text, add_special_tokens=add_special_tokens, keep=keep)

    @cached_property
    def word_ids(self) -> list[int]:
        """Tokens that decode to one plain lower-case word with a leading space: what the
        simulated model writes, so that streamed text concatenates cleanly."""
        special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        ids = []
        for token, i in sorted(self.tok.get_vocab(with_added_tokens=False).items()):
            if token not in special and _WORD.fullmatch(self.decode([i])):
                ids.append(i)
        if not ids:  # an unusual vocabulary: any non-special token will do
            ids = [i for t, i in self.tok.get_vocab().items() if t not in special]
        return sorted(ids)

    def piece(self, token_id: int) -> str:
        """Text one generated token adds (specials add nothing, as with skip_special_tokens)."""
        return self.decode([token_id], skip_special_tokens=True)
