"""Router-side chained block hashes.

The router computes its own hash for every full block of tokens and never tries to reproduce
an engine's hash function (vLLM's depends on the hash algorithm flag, pickle and
PYTHONHASHSEED). Engine hashes are treated as opaque ids and mapped onto router hashes per
worker (see `indexer.index`).

Block hash k = xxh3-64(tokens of block k as little-endian uint32, seed = hash of block k-1);
block 0 is seeded from a namespace of (model, LoRA name, cache_salt, block size), so that an
adapter's or a tenant's blocks never match plain ones.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

RouterBlockHash = NewType("RouterBlockHash", int)
"""A hash the router computed from token ids. Navigation in the index uses only these."""

EngineBlockHash = NewType("EngineBlockHash", int)
"""An engine's block id as published in KV events (uint64, or a 32-byte digest as an int)."""

_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


class TokenIdError(ValueError):
    """A token id that cannot be a vocabulary index (negative or >= 2**32)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """What separates otherwise identical token prefixes in an engine's cache."""

    model: str = ""
    lora_name: str | None = None
    cache_salt: str | None = None

    def seed(self, block_size: int) -> int:
        """Seed for block 0. The block size is part of it: a 16-token chain never
        matches a 32-token one."""
        return namespace_seed(self, block_size)


_SEED_CACHE: dict[tuple[Namespace, int], int] = {}


def namespace_seed(ns: Namespace, block_size: int) -> int:
    key = (ns, block_size)
    seed = _SEED_CACHE.get(key)
    if seed is None:
        text = "\x00".join(
            ("kvroute/1", ns.model, ns.lora_name or "", ns.cache_salt or "", str(block_size))
        )
        seed = _xxh3(text.encode("utf-8"))
        if len(_SEED_CACHE) < 4096:  # bounded: namespaces come from request fields
            _SEED_CACHE[key] = seed
    return seed


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the layout every block hash is computed over."""
    try:
        arr = array("I", tokens)
    except OverflowError as exc:
        raise TokenIdError(f"token id out of range 0..2**32-1: {exc}") from None
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def hash_blocks(tokens: Sequence[int], block_size: int, seed: int) -> list[RouterBlockHash]:
    """Chained hashes of the full blocks of `tokens`; a partial tail block never counts."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    view = memoryview(tokens_to_bytes(tokens[: n_blocks * block_size]))
    step = block_size * 4
    out: list[RouterBlockHash] = []
    append = out.append
    h = seed
    for off in range(0, n_blocks * step, step):
        h = _xxh3(view[off : off + step], h)
        append(h)  # type: ignore[arg-type]  # NewType over int: same object, no wrapper cost
    return out


def hash_request(tokens: Sequence[int], block_size: int, ns: Namespace) -> list[RouterBlockHash]:
    """Hashes for a request's prompt: the chain starts at the namespace seed."""
    return hash_blocks(tokens, block_size, ns.seed(block_size))
