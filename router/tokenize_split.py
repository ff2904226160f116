"""Where a prompt can be cut so that tokenizing the pieces gives exactly the whole's tokens.

This is what lets prefix reuse be exact: a prompt is cut at content-defined points, each
piece is tokenized (and remembered) on its own, and the pieces' tokens, concatenated, are the
prompt's tokens. It holds for one family of tokenizers, checked from tokenizer.json at load:

- no normalizer, no truncation, no padding;
- the GPT-2 byte-level pre-tokenizer (`ByteLevel`, `use_regex: true`,
  `add_prefix_space: false`), whose regex is
  ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``;
- a BPE model without dropout (BPE runs on each pre-token alone, so pre-token boundaries
  are token boundaries);
- added tokens without lstrip/rstrip/single_word and without whitespace in their text;
- a post-processor that only puts special ids around the sequence (none, ByteLevel,
  TemplateProcessing with one sequence, or a Sequence of those).

The cut: position p with ``text[p] == " "`` and ``text[p-1]`` not whitespace. Why the pieces
tokenize like the whole:

1. Added tokens are found first (leftmost-longest) and split the text. None contains a space,
   so no occurrence spans p; the occurrences chosen left of p depend only on text left of p,
   and the scan resumes at or after p exactly as it would in ``text[p:]``.
2. The regex partitions each remaining piece into matches. In every alternative a space
   can only open a match or sit in an all-whitespace match, so no match holds a non-space
   followed by a space: a match ends at p. Scanning ``text[p:]`` alone gives the same
   matches (no alternative looks behind). Scanning ``text[:p]`` alone gives the same matches
   too: the only place the end of the string could differ from the space at p is where a
   match ending at p-1 looks one character on, and there every alternative treats a space
   and the end alike (a character class fails on both, ``(?!\\S)`` succeeds on both).
3. BPE merges never cross a pre-token, so the tokens are the concatenation per piece; the
   post-processor's special ids go around the whole once.

`tests/test_tokenize_prefix.py` checks this on random texts with hypothesis (every cut of
every text), and the conformance `tokenizer` check compares the cut path with real vLLM.
Python's ``str.isspace`` is a superset of the regex engine's ``\\s``, so testing
``text[p-1]`` with it is conservative.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_CUT = re.compile(r"(?<=\S) ")  # a space right after a non-whitespace character
_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


@dataclass(frozen=True)
class Splittable:
    """How to rebuild a sequence from its pieces: the post-processor's special ids before
    and after it (`add_special_tokens=True`); empty for none."""

    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()


def splittable(spec: Mapping[str, Any]) -> Splittable | str:
    """`Splittable` when the proof above covers this tokenizer.json, else the reason not."""
    for field in ("normalizer", "truncation", "padding"):
        if spec.get(field) is not None:
            return f"{field} is set"
    pre = spec.get("pre_tokenizer") or {}
    if any(pre.get(k) != v for k, v in _PRE_TOKENIZER.items()):
        return f"pre_tokenizer {pre.get('type')} is not GPT-2 byte-level"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "model is not BPE without dropout"
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return f"added token {added.get('content')!r} strips or matches words"
        if any(c.isspace() for c in str(added.get("content", ""))):
            return f"added token {added.get('content')!r} contains whitespace"
    return _post_processor(spec.get("post_processor"))


def _post_processor(pp: Mapping[str, Any] | None) -> Splittable | str:
    if pp is None or pp.get("type") == "ByteLevel":
        return Splittable()
    if pp.get("type") == "Sequence":
        found = [_post_processor(p) for p in pp.get("processors") or []]
        bad = [f for f in found if isinstance(f, str)]
        real = [f for f in found if isinstance(f, Splittable) and f != Splittable()]
        if bad or len(real) > 1:
            return bad[0] if bad else "several post-processors add specials"
        return real[0] if real else Splittable()
    if pp.get("type") == "TemplateProcessing":
        return _template(pp)
    return f"post_processor {pp.get('type')} is not supported"


def _template(pp: Mapping[str, Any]) -> Splittable | str:
    specials = pp.get("special_tokens") or {}
    parts: list[list[int]] = [[], []]
    side = 0
    for piece in pp.get("single") or []:
        if "Sequence" in piece:
            if side:
                return "template has more than one sequence"
            side = 1
        elif "SpecialToken" in piece:
            name = piece["SpecialToken"].get("id")
            parts[side].extend(int(i) for i in (specials.get(name) or {}).get("ids", []))
        else:
            return "template piece not understood"
    if not side:
        return "template has no sequence"
    return Splittable(tuple(parts[0]), tuple(parts[1]))


def cut_points(text: str, every: int) -> list[int]:
    """Cut positions roughly `every` characters apart: the first safe cut at or after each
    previous cut + `every`. The choice depends only on the text up to the cut (and the one
    character at it), so two prompts that share a prefix cut it at the same places."""
    cuts: list[int] = []
    search = _CUT.search
    pos = every
    while pos < len(text):
        m = search(text, pos)
        if m is None:
            break
        cut = m.start()
        cuts.append(cut)
        pos = cut + every
    return cuts


def pieces(text: str, every: int) -> list[str]:
    """`text` cut at `cut_points`; their concatenation is `text`."""
    out: list[str] = []
    start = 0
    for cut in cut_points(text, every):
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out
