"""Check 4c: truncation parity. A request with `truncate_prompt_tokens` runs a cut prompt
(from the left by the tokenizer, keeping its BOS; or from the side `truncation_side`
names; token-id prompts and chats too), and kvroute must hash the blocks of that cut
prompt: otherwise each such request's prefix is predicted where the engine holds none.
Each case goes through kvroute's decision service (the model's tokenizer folder local, the
engine discovered as its worker, so its context length and block size are the engine's)
and to the engine with `return_token_ids`: the decision's prompt length and block hashes
must be those of the engine's `prompt_token_ids`."""

from __future__ import annotations

import json
from typing import Any

import httpx

from conformance.checks.tokenizer import _first_difference
from conformance.client import _json, client
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import ENGINE
from indexer.hashing import hash_request
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.openai_req import parse
from router.tokenize import LocalTokenizer

DOC = " ".join(f"Paragraph {i} of the contract says what party {i % 7} owes." for i in range(60))
IDS = [(7 * i) % 1500 + 10 for i in range(300)]
CHAT = [
    {"role": "system", "content": DOC},
    {"role": "user", "content": "Which party owes the most? Answer in one line."},
]
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("text-default-side", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200}),
    ("text-left", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "truncation_side": "left"}),  # noqa: E501
    ("text-right", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "truncation_side": "right"}),  # noqa: E501
    ("text-no-specials", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "add_special_tokens": False}),  # noqa: E501
    ("text-no-specials-sent", "completion", {"prompt": DOC, "add_special_tokens": False}),
    ("text-shorter-than-kept", "completion", {"prompt": "A short prompt.", "truncate_prompt_tokens": 200}),  # noqa: E501
    ("text-minus-1", "completion", {"prompt": DOC, "truncate_prompt_tokens": -1}),
    ("ids-default-side", "completion", {"prompt": IDS, "truncate_prompt_tokens": 150}),
    ("ids-right", "completion", {"prompt": IDS, "truncate_prompt_tokens": 150, "truncation_side": "right"}),  # noqa: E501
    ("chat-default-side", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180}),
    ("chat-right", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180, "truncation_side": "right"}),  # noqa: E501
    ("chat-specials", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180, "add_special_tokens": True}),  # noqa: E501
]  # fmt: skip


async def _engine_ids(http: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> list[int]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    doc = _json(await http.post(path, json={**body, "max_tokens": 1, "return_token_ids": True}))
    ids = doc.get("prompt_token_ids") if kind == "chat" else doc["choices"][0]["prompt_token_ids"]
    if not isinstance(ids, list):
        raise AssertionError(f"no prompt_token_ids in the engine's answer: {doc}")
    return ids


@check(
    "truncation",
    "with truncate_prompt_tokens (default side, left, right; text, token ids, chat; with and "
    "without special tokens), kvroute's decision hashes the blocks of the prompt the engine "
    "ran (its prompt_token_ids)",
    needs=(ENGINE,),
    engines=("main",),
)
async def truncation(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    config = Config(
        workers=(WorkerConfig(engine.url, mode="approx"),), tokenizer=str(ctx.tokenizer_dir)
    )
    async with client(engine.url) as http:
        app = RouterApp(config, tokenizer=LocalTokenizer(ctx.tokenizer_dir), client=http)
        try:
            await app.pool.set_workers(config.workers)
            for name, kind, fields in CASES:
                body = {"model": engine.model, **fields}
                theirs = await _engine_ids(http, kind, body)
                rin = parse(kind, json.dumps(body).encode())
                decision = await app.routing.decide(rin)
                ((size, hashes),) = decision.hashes.items()
                ns = app.routing.namespace(rin, None)
                _record(f, name, decision.prompt_tokens, list(hashes), theirs, size, ns)
        finally:
            await app.pool.stop()
    cut = [c for c, *_ in CASES if f.evidence["cases"][c]["engine_tokens"] in (150, 180, 200)]
    f.note("cases_cut_by_the_engine", cut)
    f.require(len(cut) >= 8, f"only {len(cut)} cases were cut: the check would prove little")


def _record(
    f: Findings, case: str, mine: int, hashes: list[int], theirs: list[int], size: int, ns: Any
) -> None:
    expected = [int(h) for h in hash_request(theirs, size, ns)]
    same = mine == len(theirs) and hashes == expected
    f.evidence.setdefault("cases", {})[case] = {
        "kvroute_tokens": mine,
        "engine_tokens": len(theirs),
        "blocks": len(expected),
        "equal": same,
    }
    if not same:
        at = _first_difference(hashes, expected)
        f.problems.append(
            f"{case}: kvroute {mine} tokens, engine {len(theirs)}; block hashes differ from "
            f"block {at} of {len(expected)}"
        )
