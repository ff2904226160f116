"""Check 4: tokenizer parity. kvroute's local tokenizer (`router.tokenize.LocalTokenizer`,
pointed at the folder the engine loads) gives exactly the engine's `/tokenize` tokens, for
completions and for chat (multi-turn, system prompts, list-of-parts content).

The local tokenizer cuts prompts into small pieces here and sees every prompt again with a
tail added, so what is compared is its prefix-reuse path (pieces of the prompt seen before,
only the rest encoded), not only whole-prompt encoding."""

from __future__ import annotations

from typing import Any

from conformance.client import client, tokenize_chat, tokenize_prompt
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import TOKENIZE
from router.tokenize import LocalTokenizer

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over 13 lazy dogs.",
    "  leading and trailing spaces  \n\n\ttabs\tand newlines\n",
    "Ünïcödé: naïve café, Straße, 東京, Москва, emoji 🚀🔥 and math ∑∫√",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n",
    "Text with special-looking tokens <s> </s> <|im_start|>user <|im_end|> inside.",
    "word " * 300,
    "",
]
TAILS = [" and then a different question?", "\n\nUser: 2+2 = ?  Ünï 🚀"]
NEXT_TURN = [{"role": "assistant", "content": "Sure, here."}, {"role": "user", "content": "Next?"}]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Summarize the plot of Hamlet in one line."},
    ],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Ünïcödé 🚀"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First part of the question."},
                {"type": "text", "text": "Second part, after a join."},
            ],
        }
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "System as parts."}]},
        {"role": "user", "content": "  spaces  and\nnewlines\n"},
    ],
]


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _record(f: Findings, kind: str, i: int, mine: list[int], theirs: list[int]) -> None:
    case = f"{kind}[{i}]"
    f.evidence.setdefault("cases", {})[case] = {"tokens": len(theirs), "equal": mine == theirs}
    if mine != theirs:
        at = _first_difference(mine, theirs)
        f.problems.append(
            f"{case}: kvroute {len(mine)} tokens, engine {len(theirs)}; first difference at "
            f"{at}: kvroute {mine[at : at + 5]} vs engine {theirs[at : at + 5]}"
        )


@check(
    "tokenizer",
    "kvroute's local tokenizer equals the engine's /tokenize for completions and chat "
    "(multi-turn, system, list content parts, unicode, special-token text), through its "
    "reused prefix pieces and its known-word path",
    needs=(TOKENIZE,),
    engines=("main",),
)
async def tokenizer(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    local = LocalTokenizer(ctx.tokenizer_dir, piece_chars=24, fine_chars=6)
    f.note("tokenizer_dir", str(ctx.tokenizer_dir))
    async with client(engine.url) as http:
        prompts = [*PROMPTS, *(p + t for p in PROMPTS for t in TAILS)]
        for i, prompt in enumerate(prompts):
            _record(
                f,
                "completion",
                i,
                local.completion(prompt),
                await tokenize_prompt(http, engine.model, prompt),
            )
        chats = [*CHATS, *([*c, *NEXT_TURN] for c in CHATS)]
        for i, messages in enumerate(chats):
            _record(
                f,
                "chat",
                i,
                local.chat(messages),
                await tokenize_chat(http, engine.model, messages),
            )
    f.note("compared", len(prompts) + len(chats))
    f.note("pieces_reused", local.pieces.hits)
    f.note("texts_from_known_words", local.words.hits)
    if not local.pieces.hits:  # each prompt comes thrice (alone, two tails): reuse must show
        f.problems.append("no prompt piece was reused: the prefix-reuse path went unchecked")
    if not local.words.hits:
        f.problems.append("no text was joined from known words: that path went unchecked")
