"""The tokenizer's caches stay bounded whatever the traffic: block-hash memos under many
`cache_salt`s."""

from __future__ import annotations

import random

import pytest

from indexer.hashing import Namespace, hash_request
from router.core.picker import _hashes
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer
from router.tokenize_store import HashMemo

SALTS = 3 * HashMemo.MAX_ENTRIES


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    return LocalTokenizer(PACKAGED_TOKENIZER)


def system_prompt() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(["alpha", "beta", "route", "cache"]) for _ in range(600))


async def test_salts_on_one_shared_prefix_keep_its_memo_within_the_cap(
    tok: LocalTokenizer,
) -> None:
    system = system_prompt()
    for i in range(4):  # the prefix becomes a known piece after a few sightings
        await tok.acompletion(f"{system} question {i}")
    plain = Namespace("m")
    for i in range(SALTS):
        tokens = await tok.acompletion(f"{system} user {i} asks")
        salted = Namespace("m", None, f"tenant-{i}")
        assert list(_hashes(tokens, 16, salted)) == hash_request(tokens, 16, salted)
        assert list(_hashes(tokens, 16, plain)) == hash_request(tokens, 16, plain)
    assert tokens.shared_prefix is not None
    memo = tokens.shared_prefix[1]
    assert len(memo) == HashMemo.MAX_ENTRIES
    assert (16, plain) in memo  # read on every pick, so never the one pushed out


async def test_salts_on_one_cached_prompt_keep_its_memo_within_the_cap(
    tok: LocalTokenizer,
) -> None:
    prompt = system_prompt() + " the same question every time"
    for i in range(SALTS):
        tokens = await tok.acompletion(prompt)
        salted = Namespace("m", None, f"tenant-{i}")
        assert list(_hashes(tokens, 16, salted)) == hash_request(tokens, 16, salted)
    assert tokens is await tok.acompletion(prompt)  # one cached Tokens, one memo
    assert len(tokens.hash_memo) == HashMemo.MAX_ENTRIES
