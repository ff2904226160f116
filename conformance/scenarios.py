"""Small, deterministic request scenarios whose KV events become the golden fixtures and
whose follow-up probes hold kvroute's overlap against the engine's own `cached_tokens`.

Each scenario starts from an empty cache (POST /reset_prefix_cache) and sends token-id
prompts one at a time (max_tokens=1, so only prompt blocks are stored). A query asks: how
many leading full blocks of these tokens (in this LoRA/cache_salt namespace) does the engine
hold at the end of the scenario? The truth comes from the engine: the scenario is replayed
from a reset and the query's tokens plus one token are sent; `cached_tokens // block_size`
is the answer (the extra token keeps vLLM's "never serve the last prompt token from cache"
rule from hiding a block).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from conformance.targets import BYTES_HASHES, CACHE_SALT, LORA, RESET

BLOCK = 32  # every role runs block size 32 (the CPU backend's minimum)
VOCAB = (8, 2000)  # token ids clear of the tokenizer's specials (0-3) and of its end


@dataclass(frozen=True)
class Send:
    tokens: tuple[int, ...]
    lora: bool = False
    salt: str | None = None
    report_full: bool = False  # vllm_xargs {"kv_cache_report_mode": "full"}


@dataclass(frozen=True)
class Reset:
    pass


Step = Send | Reset


@dataclass(frozen=True)
class Query:
    id: str
    tokens: tuple[int, ...]
    lora: bool = False
    salt: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    role: str
    description: str
    steps: tuple[Step, ...]
    queries: tuple[Query, ...]
    needs: frozenset[str] = field(default_factory=frozenset)
    expect_events: frozenset[str] = frozenset({"BlockStored"})


class _Tokens:
    def __init__(self, name: str) -> None:
        self._rng = random.Random(f"kvroute-scenario-{name}")

    def __call__(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(*VOCAB) for _ in range(n))


def blocks(n: int, extra: int = 1) -> int:
    return n * BLOCK + extra


def _int_hashes() -> Scenario:
    t = _Tokens("int-hashes")
    a = t(blocks(3, 5))
    b = a[: 2 * BLOCK] + t(blocks(2, 7))
    queries = (
        Query("a-3", a[: 3 * BLOCK]),
        Query("b-4", b[: 4 * BLOCK]),
        Query("a-1", a[:BLOCK]),
        Query("a-2-then-new", a[: 2 * BLOCK] + t(BLOCK)),
        Query("unseen", t(2 * BLOCK)),
    )
    return Scenario(
        "int-hashes",
        "main",
        "two prompts sharing 2 blocks; uint64 block hashes",
        (Send(a), Send(b)),
        queries,
    )


def _eviction() -> Scenario:
    t = _Tokens("eviction")
    c = [t(blocks(36)) for _ in range(3)] + [t(blocks(24))]
    full = [p[: (len(p) // BLOCK) * BLOCK] for p in c]
    queries = (Query("c1", full[0]), Query("c2", full[1]), Query("c4", full[3]))
    return Scenario(
        "eviction",
        "main",
        "four prompts (36+36+36+24 blocks) overflow 127 KV blocks: the oldest loses its tail",
        tuple(Send(p) for p in c),
        queries,
        expect_events=frozenset({"BlockStored", "BlockRemoved"}),
    )


def _cleared() -> Scenario:
    t = _Tokens("all-blocks-cleared")
    d, e = t(blocks(3)), t(blocks(2))
    return Scenario(
        "all-blocks-cleared",
        "main",
        "a prompt, POST /reset_prefix_cache, another prompt (AllBlocksCleared rides with it)",
        (Send(d), Reset(), Send(e)),
        (Query("before-reset", d[: 3 * BLOCK]), Query("after-reset", e[: 2 * BLOCK])),
        needs=frozenset({RESET}),
        expect_events=frozenset({"BlockStored", "AllBlocksCleared"}),
    )


def _lora() -> Scenario:
    t = _Tokens("lora")
    lo = t(blocks(3))
    plain = lo[: 2 * BLOCK] + t(blocks(1))
    both = t(blocks(2))
    queries = (
        Query("lora-as-lora", lo[: 3 * BLOCK], lora=True),
        Query("lora-as-plain", lo[: 3 * BLOCK]),
        Query("plain-as-plain", plain[: 3 * BLOCK]),
        Query("plain-as-lora", plain[: 3 * BLOCK], lora=True),
        Query("lora-salt-as-both", both[: 2 * BLOCK], lora=True, salt="tenant-b"),
        Query("lora-salt-as-lora", both[: 2 * BLOCK], lora=True),
    )
    return Scenario(
        "lora",
        "main",
        "a LoRA (lora-a) prompt, a plain prompt sharing its first 2 blocks, a LoRA+salt prompt",
        (Send(lo, lora=True), Send(plain), Send(both, lora=True, salt="tenant-b")),
        queries,
        needs=frozenset({LORA, CACHE_SALT}),
    )


def _salt() -> Scenario:
    t = _Tokens("cache-salt")
    s = t(blocks(3))
    plain = s[: 2 * BLOCK] + t(blocks(1))
    queries = (
        Query("salted-as-a", s[: 3 * BLOCK], salt="tenant-a"),
        Query("salted-as-plain", s[: 3 * BLOCK]),
        Query("salted-as-b", s[: 3 * BLOCK], salt="tenant-b"),
        Query("plain-as-a", plain[: 3 * BLOCK], salt="tenant-a"),
        Query("plain-as-plain", plain[: 3 * BLOCK]),
    )
    return Scenario(
        "cache-salt",
        "main",
        "a prompt with cache_salt tenant-a and a plain prompt sharing its first 2 blocks",
        (Send(s, salt="tenant-a"), Send(plain)),
        queries,
        needs=frozenset({CACHE_SALT}),
    )


def _bytes_hashes() -> Scenario:
    t = _Tokens("bytes-hashes")
    a = t(blocks(3, 5))
    b = a[: 2 * BLOCK] + t(blocks(2, 7))
    s = t(blocks(2))
    e1, e2 = t(blocks(12)), t(blocks(12))
    queries = (
        Query("a-3", a[: 3 * BLOCK]),
        Query("b-4", b[: 4 * BLOCK]),
        Query("salted", s[: 2 * BLOCK], salt="tenant-a"),
        Query("e1", e1[: 12 * BLOCK]),
        Query("e2", e2[: 12 * BLOCK]),
    )
    return Scenario(
        "bytes-hashes",
        "bytes",
        "32-byte sha256_cbor hashes: shared prefix, cache_salt, eviction in 31 KV blocks",
        (Send(a), Send(b), Send(s, salt="tenant-a"), Send(e1), Send(e2)),
        queries,
        needs=frozenset({BYTES_HASHES, CACHE_SALT}),
        expect_events=frozenset({"BlockStored", "BlockRemoved"}),
    )


def _duplicate_block() -> Scenario:
    """vLLM never serves a prompt's last token from cache, so a block-aligned prompt whose
    blocks are all cached recomputes its last block into a second physical block with the
    same hash, and publishes BlockStored for it again. Evicting the older copy publishes
    BlockRemoved for that hash while the newer copy still serves hits. The filler prompt
    takes exactly the never-used blocks plus the older copy (127 usable blocks - 4)."""
    t = _Tokens("duplicate-block")
    p = t(3 * BLOCK)
    filler = t(124 * BLOCK)
    return Scenario(
        "duplicate-block",
        "main",
        "a 3-block prompt twice (its last block cached twice), then a filler that evicts "
        "only the older copy",
        (Send(p), Send(p), Send(filler)),
        (Query("p-3", p), Query("p-2", p[: 2 * BLOCK])),
        expect_events=frozenset({"BlockStored", "BlockRemoved"}),
    )


def _report_full() -> Scenario:
    """A request sent with vllm_xargs {"kv_cache_report_mode": "full"} makes vLLM publish
    BlockStored again for the prefix it found cached, no new block behind it. Fillers then
    evict the prompt (each BlockRemoved once): counted as second copies, the re-reported
    blocks would outlive the engine's cache in kvroute's index."""
    t = _Tokens("report-full")
    p = t(blocks(3, 5))
    fillers = [t(blocks(100)) for _ in range(2)]
    return Scenario(
        "report-full",
        "main",
        "a 3-block prompt, again with kv_cache_report_mode full (its cached blocks published "
        "again), then two 100-block fillers that evict it",
        (Send(p), Send(p, report_full=True), *(Send(f) for f in fillers)),
        (Query("p-3", p[: 3 * BLOCK]), Query("filler-100", fillers[1][: 100 * BLOCK])),
        expect_events=frozenset({"BlockStored", "BlockRemoved"}),
    )


def all_scenarios() -> list[Scenario]:
    """The fixture scenarios."""
    return [
        _int_hashes(),
        _eviction(),
        _cleared(),
        _lora(),
        _salt(),
        _duplicate_block(),
        _report_full(),
        _bytes_hashes(),
    ]


def for_role(role: str) -> Iterator[Scenario]:
    return (s for s in all_scenarios() if s.role == role)
