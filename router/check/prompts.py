"""Fresh probe prompts: unique from their first block, so no cache anywhere holds them yet.

The nonce comes first: block 0 differs from every prompt ever sent, so every block of the
chain is new to every worker and the router's index."""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable

_WORD_TEXT = (
    "cache block prefix token router worker engine event stream index hash chain probe "
    "request answer model layer query value memory batch queue step decode prefill load "
    "score reuse eviction window context document paragraph sentence river mountain forest "
    "ocean garden library window market station harbor bridge castle valley meadow winter "
    "summer autumn spring morning evening night signal network packet socket server client"
)
WORDS = tuple(_WORD_TEXT.split())

# Tokenizer parity probes: specials-adjacent text, digits, punctuation, non-ASCII, spacing.
TOKENIZER_TEXT = (
    'router-check tokenizer probe: naïve café — 3.14159 tokens, {"json": true}, '
    "tabs\tand  double  spaces,\nnew lines, UPPER and lower, 12345678901234567890!"
)
TOKENIZER_CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": TOKENIZER_TEXT},
]


def fresh_text(words: int, tag: str = "probe") -> str:
    """About `words` words behind a unique nonce."""
    nonce = uuid.uuid4().hex[:16]
    rng = random.Random(nonce)
    body = " ".join(rng.choice(WORDS) for _ in range(max(words, 1)))
    return f"{nonce} router-check {tag}: {body}."


Counter = Callable[[str], Awaitable[int | None]]


async def sized_text(tokens: int, count: Counter, tag: str = "probe") -> str:
    """A fresh text of about `tokens` tokens, measured once with the engine's tokenizer
    (`count`; None when it cannot tell) and rescaled."""
    guess = max(tokens * 3 // 4, 1)
    text = fresh_text(guess, tag)
    measured = await count(text)
    if not measured:
        return text
    return fresh_text(max(round(guess * tokens / measured), 1), tag)
