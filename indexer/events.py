"""Engine-neutral KV events, as the index applies them.

Engine adapters (`engines.vllm.events`) decode wire bytes into these; the index never sees
a wire format. Engine hashes stay opaque ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from indexer.hashing import EngineBlockHash

DEFAULT_TIER = "GPU"


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks that became reusable on a worker, in chain order."""

    engine_hashes: Sequence[EngineBlockHash]
    parent: EngineBlockHash | None
    token_ids: Sequence[int]
    block_size: int
    tier: str = DEFAULT_TIER
    lora_name: str | None = None
    cache_salt: str | None = None
    # Per-block identities the router cannot derive from text (multimodal ids); a block
    # with one never matches a text-only request.
    block_extras: Sequence[str | None] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks a worker evicted from one tier."""

    engine_hashes: Sequence[EngineBlockHash]
    tier: str = DEFAULT_TIER


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The worker dropped its whole prefix cache (e.g. /reset_prefix_cache)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One engine step's events, with the engine's timestamp and data-parallel rank."""

    ts: float
    events: Sequence[KvEvent]
    dp_rank: int | None = None
    skipped: int = 0  # events the adapter could not use (other KV groups, unknown types)
