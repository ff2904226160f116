"""Truncation keeps the end vLLM keeps: with no `truncation_side`, vLLM lets the tokenizer
cut on the side it loaded it with, left for generative models and right for pooling ones
(vllm/tokenizers/registry.py), so an embeddings input keeps its first tokens and the
tokenizer's specials."""

from __future__ import annotations

import json

import pytest

from router.openai_req import parse, parse_passthrough
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer, truncate

HEAD, BODY, TAIL = [1], list(range(10, 20)), [2]
TEN = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize(
    ("ids", "side", "ends", "expected"),
    [
        (HEAD + BODY, None, (1, 0), HEAD + BODY[:3]),
        (HEAD + BODY + TAIL, None, (1, 1), HEAD + BODY[:2] + TAIL),
        (BODY, None, (0, 0), BODY[:4]),
        (HEAD + BODY + TAIL, "left", (1, 1), BODY[-3:] + TAIL),
        (HEAD + BODY + TAIL, "right", (1, 1), HEAD + BODY[:3]),
    ],
    ids=["keeps-bos", "keeps-bos-and-sep", "no-specials", "explicit-left", "explicit-right"],
)
def test_a_pooling_tokenizer_keeps_the_start(
    ids: list[int], side: str | None, ends: tuple[int, int], expected: list[int]
) -> None:
    assert list(truncate(ids, 4, side, ends, tokenizer_side="right")) == expected


def test_embeddings_input_keeps_its_first_tokens() -> None:
    body = {"model": "m", "input": TEN, "truncate_prompt_tokens": 5}
    rin = parse_passthrough("/v1/embeddings", json.dumps(body).encode())
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    ids = tok.completion(TEN)
    got = truncate(ids, 5, rin.truncation_side, tok.special_ends, tokenizer_side=rin.tokenizer_side)
    assert list(got) == ids[:5]
    assert tok._tok.decode(list(got)) == "one two three four"


def test_completions_keep_the_end() -> None:
    body = {"model": "m", "prompt": TEN, "truncate_prompt_tokens": 5}
    rin = parse("completion", json.dumps(body).encode())
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    ids = tok.completion(TEN)
    got = truncate(ids, 5, rin.truncation_side, tok.special_ends, tokenizer_side=rin.tokenizer_side)
    assert list(got) == ids[:1] + ids[-4:]


async def test_the_router_hashes_an_embeddings_input_by_its_first_tokens() -> None:
    """The decision service's own path: what it hashes is the start vLLM's pooling keeps."""
    from engines.sim.config import SimConfig
    from engines.sim.fleet import run_fleet
    from router.app import RouterApp
    from router.core.config import Config, WorkerConfig
    from router.procs import serve_in_process

    async with run_fleet(1, SimConfig(block_size=16, kv_blocks=64)) as fleet:
        config = Config(workers=(WorkerConfig(fleet.urls[0]),), tokenizer=str(PACKAGED_TOKENIZER))
        app = RouterApp(config.validate())
        async with serve_in_process(app):
            body = {"model": "kvroute-sim", "input": TEN, "truncate_prompt_tokens": 5}
            rin = parse_passthrough("/v1/embeddings", json.dumps(body).encode())
            got = await app.routing.tokens(rin, None, rin.keep_tokens(None))
            ids = LocalTokenizer(PACKAGED_TOKENIZER).completion(TEN)
            assert list(got) == ids[:5]
