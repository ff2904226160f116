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
LONG = "OVER"  # replaced by a text longer than the engine's context
CUT_BY_MINUS_1 = -1  # the engine's context less the one token kept for output
# (name, kind, request fields, the prompt tokens the engine must run: None when not cut)
CASES: list[tuple[str, str, dict[str, Any], int | None]] = [
    ("text-default-side", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200}, 200),
    ("text-left", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "truncation_side": "left"}, 200),  # noqa: E501
    ("text-right", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "truncation_side": "right"}, 200),  # noqa: E501
    ("text-no-specials", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200, "add_special_tokens": False}, 200),  # noqa: E501
    ("text-no-specials-sent", "completion", {"prompt": DOC, "add_special_tokens": False}, None),
    ("text-side-alone", "completion", {"prompt": DOC, "truncation_side": "right"}, None),
    ("text-shorter-than-kept", "completion", {"prompt": "A short prompt.", "truncate_prompt_tokens": 200}, None),  # noqa: E501
    ("text-only-bos-fits", "completion", {"prompt": DOC, "truncate_prompt_tokens": 1}, 1),
    ("text-minus-1", "completion", {"prompt": LONG, "truncate_prompt_tokens": -1}, CUT_BY_MINUS_1),
    ("text-minus-1-null-max", "completion", {"prompt": LONG, "truncate_prompt_tokens": -1, "max_tokens": None}, CUT_BY_MINUS_1),  # noqa: E501
    ("ids-default-side", "completion", {"prompt": IDS, "truncate_prompt_tokens": 150}, 150),
    ("ids-right", "completion", {"prompt": IDS, "truncate_prompt_tokens": 150, "truncation_side": "right"}, 150),  # noqa: E501
    ("batch-first-prompt", "completion", {"prompt": [DOC, "Another prompt."], "truncate_prompt_tokens": 200}, 200),  # noqa: E501
    ("chat-default-side", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180}, 180),
    ("chat-right", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180, "truncation_side": "right"}, 180),  # noqa: E501
    ("chat-specials", "chat", {"messages": CHAT, "truncate_prompt_tokens": 180, "add_special_tokens": True}, 180),  # noqa: E501
    # vLLM's request models read integers as pydantic's lax mode does
    ("text-kept-as-text", "completion", {"prompt": DOC, "truncate_prompt_tokens": "200"}, 200),
    ("text-kept-as-float", "completion", {"prompt": DOC, "truncate_prompt_tokens": 200.0}, 200),
    ("text-minus-1-as-text", "completion", {"prompt": LONG, "truncate_prompt_tokens": "-1", "max_tokens": "1"}, CUT_BY_MINUS_1),  # noqa: E501
    ("chat-kept-as-text", "chat", {"messages": CHAT, "truncate_prompt_tokens": " 180 "}, 180),
    ("chat-minus-1", "chat", {"messages": [{"role": "user", "content": LONG}], "truncate_prompt_tokens": -1}, CUT_BY_MINUS_1),  # noqa: E501
]  # fmt: skip


async def _engine_ids(http: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> list[int]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    doc = _json(await http.post(path, json=body))
    ids = doc.get("prompt_token_ids") if kind == "chat" else doc["choices"][0]["prompt_token_ids"]
    if not isinstance(ids, list):
        raise AssertionError(f"no prompt_token_ids in the engine's answer: {doc}")
    return ids


def _filled(value: Any, long: str) -> Any:
    """The request fields with LONG replaced, in messages too."""
    if value == LONG:
        return long
    if isinstance(value, dict):
        return {k: _filled(v, long) for k, v in value.items()}
    if isinstance(value, list):
        return [_filled(v, long) for v in value]
    return value


@check(
    "truncation",
    "with truncate_prompt_tokens (default side, left, right, -1, 1; text, token ids, a "
    "batch, chat; with and without special tokens; given as text or a float), the engine "
    "runs the prompt cut as asked and kvroute's decision hashes the blocks of that prompt "
    "(its prompt_token_ids)",
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
            limit = app.fleet.max_model_len(engine.model)
            if limit is None:
                raise AssertionError("the engine's /v1/models gave no max_model_len")
            f.note("max_model_len", limit)
            long = "word " * (limit + 100)
            for name, kind, fields, cut in CASES:
                # max_tokens 1 unless the case sets it; the same body to both
                body = {"model": engine.model, "max_tokens": 1, "return_token_ids": True}
                body |= _filled(fields, long)
                theirs = await _engine_ids(http, kind, body)
                rin = parse(kind, json.dumps(body).encode())
                decision = await app.routing.decide(rin)
                ((size, hashes),) = decision.hashes.items()
                ns = app.routing.namespace(rin, None)
                want = limit - 1 if cut == CUT_BY_MINUS_1 else cut
                _record(f, name, decision.prompt_tokens, list(hashes), theirs, size, ns, want)
        finally:
            await app.pool.stop()
    f.note("cases_cut", sum(1 for *_, cut in CASES if cut is not None))


def _record(
    f: Findings,
    case: str,
    mine: int,
    hashes: list[int],
    theirs: list[int],
    size: int,
    ns: Any,
    want: int | None,
) -> None:
    expected = [int(h) for h in hash_request(theirs, size, ns)]
    same = mine == len(theirs) and hashes == expected
    f.evidence.setdefault("cases", {})[case] = {
        "kvroute_tokens": mine,
        "engine_tokens": len(theirs),
        "blocks": len(expected),
        "equal": same,
    }
    if want is not None and len(theirs) != want:
        f.problems.append(f"{case}: the engine ran {len(theirs)} prompt tokens, not {want}")
    if not same:
        at = _first_difference(hashes, expected)
        f.problems.append(
            f"{case}: kvroute {mine} tokens, engine {len(theirs)}; block hashes differ from "
            f"block {at} of {len(expected)}"
        )
