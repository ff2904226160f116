"""The ids of text known word by word: exact, from the same proof as prefix reuse.

`router.tokenize_split` proves that a prompt cut at any of its safe points (a space right
after a non-whitespace character) tokenizes as the concatenation of its pieces. Cut at
every safe point, the pieces are words with their leading space (" cache", " blocks.",
" 12:"), and natural text repeats its words: so the ids of each word are remembered, and a
text whose words are all known is its words' ids joined, with no tokenizer call at all.
A word's ids depend on its text alone, so a hit is exactly what the tokenizer would say.

Measured on the packaged tokenizer (`python -m router.bench.tokenize`): a ~2k-token prompt
of known words costs ~0.3 ms of CPU here against ~0.7-0.9 ms for `encode_batch_fast`. The
tokenizer pays ~3 us per text it is given, so unknown words are encoded in one batch only
when they are few (`learn`); a text mostly of new words (code, identifiers, a language
without spaces) is encoded whole by the caller. Its opening words decide that before the
rest is looked at (and are learned, so a vocabulary that comes back is soon known), and a
grown cache then skips the next few texts unlooked: traffic the cache cannot help costs
~10 us a text.

Bounded: at `max_words` words or `max_chars` characters the cache starts over (natural
text fills it again within a few requests), and a word longer than `MAX_WORD_CHARS` is
encoded but not kept: a run without spaces (Chinese, base64, minified JSON) is one "word"
that seldom comes back, and 3,000 distinct 3,000-character Chinese prompts kept 126 MB.
Keys and values are `str` and `bytes`, which the garbage collector never walks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_WORD_START = re.compile(r"(?<=\S)(?= )")  # every safe cut (router.tokenize_split)
_SPACE_AFTER_SPACE = re.compile(r"\s ")  # a space that is not a cut


def words(text: str) -> list[str]:
    """`text` cut at every safe point; their concatenation is `text`."""
    return _WORD_START.split(text)


def _keys(text: str) -> tuple[str | None, list[str]]:
    """The text's words as lookup keys: its first word when it does not start with a
    space, then every word starting with one, without it. Where every space follows a
    non-space (most text), every space is a cut and `str.split` finds the words (~3x
    faster than the regex split)."""
    if text[:1] not in ("", " ") and not _SPACE_AFTER_SPACE.search(text):
        rest = text.split(" ")
        return rest[0], rest[1:]
    cut = words(text)
    if cut[0][:1] == " ":
        return None, [w[1:] for w in cut]
    return cut[0], [w[1:] for w in cut[1:]]


class WordIds:
    """Word -> its ids (array('I') bytes), with a bounded, self-limiting learner. Words
    that start with a space are kept without it (a text's other words); a first word
    without one has its own table.

    `encode_words(texts)` must return each text's ids encoded alone, without specials."""

    SAMPLE_CHARS = 256  # a text's opening words tell whether the rest is worth looking up
    MAX_WORD_CHARS = 128  # natural words, numbers and URLs fit; longer runs are not kept
    COOLDOWN = 7  # after a text mostly of new words, skip this many texts unlooked

    def __init__(
        self,
        encode_words: Callable[[list[str]], list[bytes]],
        max_words: int = 1 << 16,
        learn: int = 48,
        max_chars: int = 1 << 21,
    ) -> None:
        self._encode = encode_words
        self._spaced: dict[str, bytes] = {}  # " " + key -> ids
        self._first: dict[str, bytes] = {}  # a text's first word, no space before it
        self.max_words = max_words
        self.max_chars = max_chars
        self.chars = 0  # characters of the words kept
        self.learn = learn
        self._cooldown = 0
        self.hits = 0  # texts answered from known words (after learning a few)
        self.misses = 0  # texts left to the caller

    def ids(self, text: str) -> bytes | None:
        """The ids of `text` (array('I') bytes, no specials), or None when too many of its
        words are new: the caller encodes it whole."""
        if not text:
            return b""
        if self._cooldown or not self._promising(text):
            self._cooldown = max(self._cooldown - 1, 0)
            self.misses += 1
            return None
        first, rest = _keys(text)
        got = list(map(self._spaced.get, rest))
        head = self._first.get(first) if first is not None else b""
        if head is not None and None not in got:
            self.hits += 1
            return head + b"".join(got)  # type: ignore[arg-type]
        new = list(dict.fromkeys(k for k, ids in zip(rest, got, strict=True) if ids is None))
        learned, first_ids = self._remember(first if head is None else None, new[: self.learn])
        if len(new) > self.learn:
            self.misses += 1
            return None
        self.hits += 1
        pairs = zip(rest, got, strict=True)
        head = head if head is not None else first_ids
        return head + b"".join([learned[k] if ids is None else ids for k, ids in pairs])

    def _promising(self, text: str) -> bool:
        """Are most of the opening words known? If not, they are learned (a vocabulary
        that comes back is known after a text or two), and a grown cache looks at the next
        COOLDOWN texts not at all: a stream it cannot help costs ~10 us a text."""
        first, rest = _keys(text[: self.SAMPLE_CHARS])
        rest = rest[:-1] if len(text) > self.SAMPLE_CHARS else rest  # the last may be cut
        new = [k for k in rest if k not in self._spaced]
        if len(new) * 2 <= len(rest):
            return True
        self._remember(first if first not in self._first else None, list(dict.fromkeys(new)))
        if len(self) >= self.max_words // 4:
            self._cooldown = self.COOLDOWN + 1
        return False

    def _remember(self, first: str | None, new: list[str]) -> tuple[dict[str, bytes], bytes]:
        """Encode `new` spaced words (and a new first word) and keep the short ones; their
        ids by key, and the first word's ids (b"" without one)."""
        texts = [" " + k for k in new] + ([first] if first is not None else [])
        if not texts:
            return {}, b""
        found = self._encode(texts)
        learned = dict(zip(new, found, strict=False))
        keep = {k: ids for k, ids in learned.items() if len(k) <= self.MAX_WORD_CHARS}
        first_ids = found[-1] if first is not None else b""
        short_first = [first] if first is not None and len(first) <= self.MAX_WORD_CHARS else []
        chars = sum(map(len, keep)) + sum(map(len, short_first))
        count = len(self) + len(keep) + len(short_first)
        if count > self.max_words or self.chars + chars > self.max_chars:
            self._spaced.clear()
            self._first.clear()
            self.chars = 0
        self._spaced.update(keep)
        self._first.update((word, first_ids) for word in short_first)
        self.chars += chars
        return learned, first_ids

    def __len__(self) -> int:
        return len(self._spaced) + len(self._first)
