"""The prompt mixes of `kvroute bench proxy`: each request's body is valid JSON, the varying
part really varies, the shared-prefix tail is ~30 tokens, prompts are ~2k tokens."""

from __future__ import annotations

import json
import random
import re

import pytest

from router.bench.proxy_prompts import MIXES, Mix, _body_around
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    return LocalTokenizer(PACKAGED_TOKENIZER)


@pytest.mark.parametrize("name", MIXES)
def test_prompts_are_about_2k_tokens(tok: LocalTokenizer, name: str) -> None:
    prompt = Mix(name, tok).prompt("abc123", 7, random.Random(1))
    assert 1900 <= len(tok.completion(prompt)) <= 2200


def test_every_request_differs_but_shares_the_prefix(tok: LocalTokenizer) -> None:
    mix = Mix("shared-prefix", tok)
    rng = random.Random(1)
    prompts = [mix.prompt("abc123", n, rng) for n in range(50)]
    assert len(set(prompts)) == 50 and all(p.startswith(mix.prefix) for p in prompts)
    tails = [len(tok.completion(p[len(mix.prefix) :])) - 1 for p in prompts]
    assert 20 <= sorted(tails)[25] <= 40


def test_lua_body_parts_make_valid_json(tok: LocalTokenizer) -> None:
    mix = Mix("shared-prefix", tok)
    head, foot = _body_around(mix.prefix)
    body = json.loads(head + "Question abc-1: cache router" + foot)
    assert body["prompt"] == mix.prefix + "Question abc-1: cache router"
    lua = mix.lua()
    assert "function request()" in lua and "init(args)" in lua
    assert re.search(r"local count = 6\b", lua)
    assert "wrk.body" in Mix("repeated", tok).lua()
