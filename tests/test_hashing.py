from __future__ import annotations

import pytest
import xxhash

from indexer.hashing import Namespace, TokenIdError, hash_blocks, hash_request, tokens_to_bytes

TOKENS = list(range(100, 164))  # 64 tokens


@pytest.mark.parametrize(
    ("n_tokens", "block_size", "blocks"),
    [(0, 16, 0), (15, 16, 0), (16, 16, 1), (31, 16, 1), (64, 16, 4), (64, 32, 2), (63, 32, 1)],
    ids=["empty", "partial-only", "one", "one-plus-tail", "four", "two-of-32", "tail-ignored"],
)
def test_only_full_blocks_count(n_tokens: int, block_size: int, blocks: int) -> None:
    assert len(hash_request(TOKENS[:n_tokens], block_size, Namespace())) == blocks


def test_block_hash_is_xxh3_of_le_uint32_seeded_by_previous() -> None:
    seed = Namespace().seed(16)
    got = hash_blocks(TOKENS[:32], 16, seed)
    first = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in TOKENS[:16]), seed)
    second = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in TOKENS[16:32]), first
    )
    assert got == [first, second]


def test_chain_prefix_property() -> None:
    longer = hash_request(TOKENS, 16, Namespace())
    shorter = hash_request(TOKENS[:40], 16, Namespace())
    assert longer[:2] == shorter
    changed = hash_request([*TOKENS[:20], 9, *TOKENS[21:]], 16, Namespace())
    assert changed[0] == longer[0] and changed[1:] != longer[1:]
    assert all(a != b for a, b in zip(changed[1:], longer[1:], strict=True))


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model="other-model"),
        Namespace(lora_name="adapter-a"),
        Namespace(cache_salt="tenant-1"),
        Namespace(lora_name="adapter-a", cache_salt="tenant-1"),
    ],
    ids=["model", "lora", "salt", "lora+salt"],
)
def test_namespaces_never_match_plain(other: Namespace) -> None:
    plain = hash_request(TOKENS, 16, Namespace())
    theirs = hash_request(TOKENS, 16, other)
    assert not set(plain) & set(theirs)


def test_block_size_is_part_of_the_namespace() -> None:
    assert Namespace().seed(16) != Namespace().seed(32)


def test_salt_and_lora_do_not_alias() -> None:
    assert Namespace(lora_name="x").seed(16) != Namespace(cache_salt="x").seed(16)


@pytest.mark.parametrize("bad", [[-1], [2**32]], ids=["negative", "too-large"])
def test_token_ids_out_of_range_are_errors(bad: list[int]) -> None:
    with pytest.raises(TokenIdError):
        tokens_to_bytes(bad)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(TOKENS, 0, 0)
