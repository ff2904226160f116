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

Bounded: at `max_words` the cache starts over (natural text fills it again within a few
requests). Keys and values are `str` and `bytes`, which the garbage collector never walks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_WORD_START = re.compile(r"(?<=\S)(?= )")  # every safe cut (router.tokenize_split)


def words(text: str) -> list[str]:
    """`text` cut at every safe point; their concatenation is `text`."""
    return _WORD_START.split(text)


class WordIds:
    """Word -> its ids (array('I') bytes), with a bounded, self-limiting learner.

    `encode_words(texts)` must return each text's ids encoded alone, without specials."""

    SAMPLE_CHARS = 256  # a text's opening words tell whether the rest is worth looking up
    COOLDOWN = 7  # after a text mostly of new words, skip this many texts unlooked

    def __init__(
        self,
        encode_words: Callable[[list[str]], list[bytes]],
        max_words: int = 1 << 16,
        learn: int = 48,
    ) -> None:
        self._encode = encode_words
        self._ids: dict[str, bytes] = {}
        self.max_words = max_words
        self.learn = learn
        self._cooldown = 0
        self.hits = 0  # texts answered from known words (after learning a few)
        self.misses = 0  # texts left to the caller

    def ids(self, text: str) -> bytes | None:
        """The ids of `text` (array('I') bytes, no specials), or None when too many of its
        words are new: the caller encodes it whole."""
        if self._cooldown or not self._promising(text):
            self._cooldown = max(self._cooldown - 1, 0)
            self.misses += 1
            return None
        cut = words(text)
        got = list(map(self._ids.get, cut))
        if None not in got:
            self.hits += 1
            return b"".join(got)  # type: ignore[arg-type]
        new = list(dict.fromkeys(w for w, ids in zip(cut, got, strict=True) if ids is None))
        learned = self._remember(new[: self.learn])
        if len(new) > self.learn:
            self.misses += 1
            return None
        self.hits += 1
        pairs = zip(cut, got, strict=True)
        return b"".join([learned[w] if ids is None else ids for w, ids in pairs])

    def _promising(self, text: str) -> bool:
        """Are most of the opening words known? If not, they are learned (a vocabulary
        that comes back is known after a text or two), and a grown cache looks at the next
        COOLDOWN texts not at all: a stream it cannot help costs ~10 us a text."""
        opening = words(text[: self.SAMPLE_CHARS])[:-1]  # the last may be cut short
        new = [w for w in opening if w not in self._ids]
        if len(new) * 2 <= len(opening):
            return True
        self._remember(list(dict.fromkeys(new)))
        if len(self._ids) >= self.max_words // 4:
            self._cooldown = self.COOLDOWN + 1
        return False

    def _remember(self, new: list[str]) -> dict[str, bytes]:
        if not new:
            return {}
        learned = dict(zip(new, self._encode(new), strict=True))
        if len(self._ids) + len(learned) > self.max_words:
            self._ids.clear()
        self._ids.update(learned)
        return learned

    def __len__(self) -> int:
        return len(self._ids)
