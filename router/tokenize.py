"""Tokenization the way vLLM does it, from the model's own tokenizer files.

Completions: the tokenizer's post-processor adds its specials (BOS for Llama-style models).
Chat: the chat template (`router.tokenize_chat`) is rendered, then encoded without specials,
because the template places them itself. A request's `add_special_tokens` overrides either
default, as in vLLM; `truncate` cuts a prompt to its `truncate_prompt_tokens` as vLLM does.

Fast on real traffic, and exact:

- whole requests are cached by content (`TokenCache`), with their block hashes;
- a prompt is cut into pieces at points where tokenization provably splits
  (`router.tokenize_split`), and the pieces of prefixes seen before are reused
  (`PieceStore`), so a new question after a known 2k-token document costs only its tail;
  both caches keep a text from its second sighting on, so distinct prompts churn nothing;
- the rest is cut at every safe point into words, and a text whose words are known is
  their ids joined (`router.tokenize_words`: ~0.3 ms for 2k tokens of known words against
  ~0.8 ms in the tokenizer), so distinct prompts of a familiar vocabulary skip it too;
- what is still left runs in a thread (`encode_batch_fast` releases the GIL; `encode`
  does not), unless it is so small that the hop would cost more than it saves;
- tokenizers the proof does not cover are always encoded whole.

    tok = LocalTokenizer(folder)
    ids = await tok.acompletion(prompt)      # every door, on the event loop
    ids = tok.completion(prompt)             # start-up probes, tests: same path, inline
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from router.core.errors import ConfigError
from router.tokenize_chat import (
    chat_templates,
    compile_template,
    pick,
    render,
    request_template,
    token_text,
)
from router.tokenize_split import Splittable, pieces, splittable
from router.tokenize_store import (
    Anchors,
    PieceStore,
    PrefixMemos,
    TokenCache,
    Tokens,
    Walk,
)
from router.tokenize_threads import WAYS, in_threads
from router.tokenize_words import WordIds

__all__ = ["PACKAGED_TOKENIZER", "LocalTokenizer", "TokenCache", "Tokens"]

log = logging.getLogger("kvroute.tokenize")

PACKAGED_TOKENIZER = (
    Path(__file__).resolve().parent.parent / "engines" / "sim" / "data" / "tokenizer"
)

# Measured with `python -m router.bench.tokenize` (see its JSON):
PIECE_CHARS = 512  # coarse pieces (~200 tokens): few lookups over a long known prefix
FINE_CHARS = 64  # fine pieces where a prompt leaves the known text: little to re-encode
INLINE_CHARS = 512  # encode at most this much on the event loop: a thread hop costs the
# loop about as much CPU as encoding ~100 characters, and adds ~100 us of wall time


@dataclass
class _Plan:
    """A text's pieces: the ones already known (`walk`) and the texts to encode: the pieces
    seen once before, each alone (they will be kept), then the rest as one text; `ids` of
    each, as far as their words are known (`router.tokenize_words`)."""

    walk: Walk
    texts: list[str]
    ids: list[bytes | None]

    def todo(self) -> list[str]:
        return [t for t, ids in zip(self.texts, self.ids, strict=True) if ids is None]

    def done(self, encoded: list[bytes]) -> list[bytes]:
        """`ids` with the texts left to encode filled in, in order."""
        it = iter(encoded)
        return [next(it) if ids is None else ids for ids in self.ids]


class LocalTokenizer:
    """A model's tokenizer folder: tokenizer.json + tokenizer_config.json."""

    def __init__(
        self,
        folder: Path,
        cache_items: int = 4096,
        *,
        piece_chars: int = PIECE_CHARS,
        fine_chars: int = FINE_CHARS,
        inline_chars: int = INLINE_CHARS,
        chat_template: str | None = None,
        content_format: str = "auto",
    ) -> None:
        """`chat_template` (the template's text) replaces the folder's, as the engines'
        `--chat-template` does; `content_format` is their `--chat-template-content-format`."""
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.exists():
            raise ConfigError(
                f"config field tokenizer: {tok_file} not found; point --tokenizer at the "
                "model's folder (the one vLLM loads), or use --tokenizer remote",
                param="tokenizer",
            )
        self.folder = folder
        # Parallelism comes from requests in threads; rayon spreading one request's pieces
        # over the cores spun and doubled the CPU per request (2 cores: 1.7 vs 0.9 ms). An
        # operator's explicit setting wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self._specials = {
            "bos_token": token_text(cfg.get("bos_token")),
            "eos_token": token_text(cfg.get("eos_token")),
        }
        self.content_format = content_format
        try:
            if chat_template is not None:
                self._templates = {"default": compile_template(chat_template, content_format)}
            else:
                self._templates = chat_templates(folder, cfg, content_format)
        except ValueError as exc:
            where = "chat_template" if chat_template is not None else f"{folder}'s chat template"
            raise ConfigError(f"config field {where}: {exc}", param="chat_template") from None
        self.cache = TokenCache(cache_items)
        self.pieces = PieceStore()
        self.prefixes = PrefixMemos()
        self.anchors = Anchors(piece_chars)
        self.words = WordIds(self._encode_words)
        self.piece_chars = piece_chars
        self.fine_chars = fine_chars
        self.inline_chars = inline_chars
        self.split = self._check_split(json.loads(tok_file.read_text()))
        # the length floor's divisor, known before the first request (a 128k vocabulary
        # takes tens of milliseconds to walk)
        self.max_token_bytes = longest_token_bytes(self._tok)
        probe = "Hello world"
        self.special_ends = special_ends(
            self._tok.encode(probe, add_special_tokens=True).ids,
            self._tok.encode(probe, add_special_tokens=False).ids,
        )

    @property
    def bos_token(self) -> str:
        return self._specials["bos_token"]

    @property
    def eos_token(self) -> str:
        return self._specials["eos_token"]

    def _check_split(self, spec: Mapping[str, Any]) -> Splittable | None:
        """Prefix reuse only where the proof holds; the special ids it adds around a
        sequence are confirmed against the tokenizer itself."""
        found = splittable(spec)
        if isinstance(found, Splittable):
            probe = "<s> Hello world, again: 12 apples  and\n\t naïve 🚀 text"
            whole = self._tok.encode(probe, add_special_tokens=True).ids
            bare = self._tok.encode(probe, add_special_tokens=False).ids
            if whole == [*found.head, *bare, *found.tail]:
                return found
            found = "its post-processor adds other ids than the template says"
        log.info("tokenizer %s: whole prompts only, no prefix reuse (%s)", self.folder, found)
        return None

    # ---- completions -----------------------------------------------------------------

    def completion(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        key = ("c", prompt, add_special_tokens)
        return self._tokens(key, prompt, specials=add_special_tokens).tolist()

    async def acompletion(self, prompt: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        key = ("c", prompt, add_special_tokens)
        return await self._atokens(key, prompt, specials=add_special_tokens)

    # ---- chat ------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        template_source: str | None = None,
    ) -> str:
        """The chat's text as vLLM renders it; with media, the text before the first.
        `template_source`: the request's own template (`--trust-request-chat-template`)."""
        template = (
            pick(self._templates, (extra or {}).get("tools"))
            if template_source is None
            else request_template(template_source, self.content_format)
        )
        return render(
            template,
            self._specials,
            messages,
            add_generation_prompt,
            extra,
            continue_final_message=continue_final_message,
        )

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        continue_final_message: bool = False,
        template_source: str | None = None,
    ) -> list[int]:
        key, hit, text = self._chat_text(
            messages,
            add_generation_prompt,
            extra,
            add_special_tokens,
            continue_final_message,
            template_source,
        )
        if hit is None:
            hit = self._tokens(key, text, specials=add_special_tokens)
        return hit.tolist()

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        continue_final_message: bool = False,
        template_source: str | None = None,
    ) -> Sequence[int]:
        key, hit, text = self._chat_text(
            messages,
            add_generation_prompt,
            extra,
            add_special_tokens,
            continue_final_message,
            template_source,
        )
        if hit is not None:
            return hit
        return await self._atokens(key, text, specials=add_special_tokens)

    def _chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        extra: Mapping[str, Any] | None,
        add_special_tokens: bool,
        continue_final_message: bool,
        template_source: str | None,
    ) -> tuple[Any, Tokens | None, str]:
        """A chat's cache key, and its tokens when cached, else its rendered text."""
        how: tuple[Any, ...] = (add_generation_prompt, extra, add_special_tokens)
        how += (continue_final_message, *(() if template_source is None else (template_source,)))
        key = _chat_key(messages, *how)
        hit = self.cache.get(key)
        if hit is not None:
            return key, hit, ""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            extra=extra,
            continue_final_message=continue_final_message,
            template_source=template_source,
        )
        return key, None, text

    # ---- the one path: cache, known pieces, encode the rest ---------------------------

    def _tokens(self, key: Any, text: str, *, specials: bool) -> Tokens:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        plan = self._plan(text)
        todo = plan.todo()
        return self._finish(key, plan, self._encode(todo, specials) if todo else [], specials)

    async def _atokens(self, key: Any, text: str, *, specials: bool) -> Tokens:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        plan = self._plan(text)
        todo = plan.todo()
        if sum(map(len, todo)) <= self.inline_chars:
            new = self._encode(todo, specials) if todo else []
        else:
            new = await self._in_threads(todo, specials)
        return self._finish(key, plan, new, specials)

    async def _in_threads(self, texts: list[str], specials: bool) -> list[bytes]:
        """Encode in the pool; each long text is cut (at safe points) into WAYS runs, so an
        idle moment spreads one prompt over the cores."""
        if self.split is None:
            return await in_threads(lambda run: self._encode(run, specials), texts)
        runs = [pieces(t, max(len(t) // WAYS, 1)) for t in texts]
        each = [r for run in runs for r in run]
        flat = await in_threads(lambda run: self._encode(run, specials), each)
        out, at = [], 0
        for r in runs:
            out.append(b"".join(flat[at : at + len(r)]))
            at += len(r)
        return out

    def _plan(self, text: str) -> _Plan:
        if self.split is None:
            return _Plan(Walk(rest=[text]), [text], [None])
        fine = self.fine_chars
        start = self.anchors.find(text)
        offset = 0 if start is None else len(start.text) - 1  # the anchor's cut
        rest = text[offset:]
        walk = self.pieces.walk(pieces(rest, self.piece_chars), lambda p: pieces(p, fine), start)
        self.anchors.note(text, walk, offset)
        left = "".join(walk.rest[walk.admit :])
        texts = [*walk.rest[: walk.admit], *([left] if left else [])]
        return _Plan(walk, texts, [self.words.ids(t) for t in texts])

    def _encode_words(self, words: list[str]) -> list[bytes]:
        return self._encode(words, specials=False)

    def _encode(self, texts: list[str], specials: bool) -> list[bytes]:
        """Ids of each text as array('I') bytes. Runs in a worker thread for big texts:
        `encode_batch_fast` releases the GIL (and skips offsets, which nobody here reads)."""
        whole = self.split is None and specials
        found = self._tok.encode_batch_fast(texts, add_special_tokens=whole)
        return [array("I", e.ids).tobytes() for e in found]

    def _finish(self, key: Any, plan: _Plan, new: list[bytes], specials: bool) -> Tokens:
        split = self.split
        ids = plan.done(new)
        out = Tokens(split.head if split is not None and specials else ())
        walk = plan.walk
        if walk.known:
            known = len(out) + sum(map(len, walk.known)) // 4
            out.shared_prefix = self.prefixes.get(walk.parent, specials, known)
        out.frombytes(b"".join([*walk.known, *ids]))
        if split is not None:
            if specials:
                out.extend(split.tail)
            self.pieces.add(walk, ids[: walk.admit])
        return self.cache.put(key, out)


def longest_token_bytes(tok: Tokenizer) -> int:
    """The most UTF-8 bytes any vocabulary entry spells (byte-level BPE stores each raw byte
    as one character of up to 2 UTF-8 bytes, so this over-counts: a safe bound)."""
    vocab: dict[str, Any] = tok.get_vocab(with_added_tokens=True)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


def special_ends(whole: Sequence[int], bare: Sequence[int]) -> tuple[int, int]:
    """How many special ids the tokenizer puts before and after a text's own ids, from one
    text encoded with (`whole`) and without (`bare`) them."""
    n = len(bare)
    for head in range(len(whole) - n + 1):
        if list(whole[head : head + n]) == list(bare):
            return head, len(whole) - n - head
    return 0, 0


def truncate(
    ids: Sequence[int],
    keep: int,
    side: str | None,
    ends: tuple[int, int] = (0, 0),
    *,
    tokenizer_side: str = "left",
) -> Sequence[int]:
    """The prompt vLLM runs for `truncate_prompt_tokens=keep` (`truncation_side=side`).

    Without a side, vLLM lets the tokenizer truncate, on the side it loaded it with
    (`tokenizer_side`: left for generative models, right for pooling ones), which keeps
    the special ids it adds (`ends`: how many at the head and the tail, as `special_ends`
    finds them; (0, 0) for a prompt of token ids or one encoded without specials): BOS
    and the last (or first) ids. With an explicit side, vLLM cuts the encoded prompt,
    specials included."""
    if len(ids) <= keep:
        return ids
    if keep == 0:
        return []
    if side == "right":
        return list(ids[:keep])
    head, tail = ends if side is None else (0, 0)
    end = len(ids) - tail
    body = max(keep - head - tail, 0)
    kept = ids[head : head + body] if side is None and tokenizer_side == "right" else None
    out = [*ids[:head], *(ids[end - body : end] if kept is None else kept), *ids[end:]]
    return out[-keep:] if kept is None else out[:keep]


def _chat_key(messages: Sequence[Mapping[str, Any]], *how: Any) -> tuple[str, str]:
    """`how`: the prompt flags, kwargs and (when the request has one) its template. Key
    order is kept: templates print tools and arguments with `tojson`, which keeps it, so
    two orders are two renderings."""
    return "m", json.dumps([messages, *how], default=str)
