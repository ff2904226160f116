"""The simulated engine's KV block pool: vLLM v1's prefix cache, block for block.

This is the ground truth the router is checked against, so it shares nothing with the
router's index. It mirrors vLLM 0.32 (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`):

- engine block hash k = sha256(pickle((hash k-1 or NONE_HASH, tuple(tokens), extra_keys)));
  NONE_HASH = sha256(pickle(seed)), seed "vllm-none-hash" (or PYTHONHASHSEED); on the wire
  the last 8 bytes as uint64 (default) or the whole 32-byte digest;
- block 0 is the null block and never holds data, so `num_blocks - 1` are usable;
- a free queue in eviction order: freed blocks that carry a hash go to the tail (LRU), freed
  blocks without one to the head; allocation pops the head and evicts its hash
  (one `BlockRemoved` per block);
- identical blocks computed concurrently are not de-duplicated (vLLM's NOTE #1): both are
  cached and both stored events are published.

Pure: no IO, no clock. Events accumulate until `take_events`.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from engines.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent, WireHash

EngineHash = NewType("EngineHash", bytes)
"""The engine's own 32-byte block digest (vLLM's `BlockHash`)."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
MEDIUM = "GPU"
SPEC_KIND = "full_attention"
_U64 = (1 << 64) - 1


def sha256_pickle(obj: object) -> bytes:
    """vLLM's default `--prefix-caching-hash-algo sha256`."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@dataclass(frozen=True, slots=True)
class CacheKeys:
    """What, besides tokens, goes into a request's block hashes."""

    lora_name: str | None = None
    lora_path: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None

    def block_extra_keys(self, start_token: int) -> tuple[tuple[str, ...], ...] | None:
        """Tagged keys hashed into one block: LoRA on every block, cache_salt on block 0."""
        keys: list[tuple[str, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path or ""))
        if start_token == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


NO_KEYS = CacheKeys()


def event_extra_keys(keys: tuple[tuple[str, ...], ...] | None) -> list[Any] | None:
    """The untagged per-block form published in events (`to_event_extra_keys`)."""
    return None if keys is None else [k[1] for k in keys]


class Hasher:
    """Chained engine block hashes, as `hash_block_tokens` computes them."""

    def __init__(self, block_size: int, none_hash_seed: str = DEFAULT_NONE_HASH_SEED) -> None:
        self.block_size = block_size
        self.none_hash = EngineHash(sha256_pickle(none_hash_seed))

    def extend(
        self, hashes: list[EngineHash], tokens: Sequence[int], keys: CacheKeys = NO_KEYS
    ) -> list[EngineHash]:
        """Append the hashes of full blocks of `tokens` not hashed yet; returns `hashes`."""
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else self.none_hash
            block = tuple(tokens[i * bs : (i + 1) * bs])
            hashes.append(EngineHash(sha256_pickle((parent, block, keys.block_extra_keys(i * bs)))))
        return hashes

    def hashes(self, tokens: Sequence[int], keys: CacheKeys = NO_KEYS) -> list[EngineHash]:
        return self.extend([], tokens, keys)


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: EngineHash | None = None


@dataclass
class PoolCounters:
    evicted: int = 0
    stored: int = 0
    resets: int = 0


@dataclass
class BlockPool:
    """Blocks, their hashes, and the free queue in eviction order."""

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    int_hashes: bool = True
    emit_events: bool = True
    counters: PoolCounters = field(default_factory=PoolCounters)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Front = next to hand out. Block 0 is taken for good, as vLLM's null block is.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[EngineHash, dict[int, Block]] = {}
        self._events: list[WireEvent] = []

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: blocks held by requests (cached free ones are free)."""
        return 1.0 - self.num_free / self.usable

    def cached_hashes(self) -> set[EngineHash]:
        return set(self._cached)

    def free_order(self) -> list[Block]:
        """Free blocks, next to be reused first (tests, debugging)."""
        return list(self._free.values())

    def get_cached(self, block_hash: EngineHash) -> Block | None:
        blocks = self._cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def longest_hit(self, hashes: Sequence[EngineHash], max_blocks: int) -> list[Block]:
        """Cached blocks for the leading `hashes`, stopping at the first miss."""
        out: list[Block] = []
        if not self.enable_caching:
            return out
        for h in hashes[:max_blocks]:
            block = self.get_cached(h)
            if block is None:
                break
            out.append(block)
        return out

    # ---- mutations -----------------------------------------------------------------------

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks (a free one leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        holders = self._cached.get(h)
        if holders is not None and holders.pop(block.block_id, None) is not None:
            if not holders:
                del self._cached[h]
            self.counters.evicted += 1
            self._emit(BlockRemoved([self._wire(h)], MEDIUM, group_idx=0))
        block.block_hash = None

    def free(self, ordered: Iterable[Block]) -> None:
        """Drop one reference each; `ordered` lists blocks in eviction priority (vLLM frees a
        request's blocks tail first). Hashed blocks join the LRU tail, others the head."""
        last: list[Block] = []
        first: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                keep = block.block_hash is not None and self.enable_caching
                (last if keep else first).append(block)
        for block in reversed(first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        for block in last:
            self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[EngineHash],
        num_cached: int,
        num_full: int,
        tokens: Sequence[int],
        keys: CacheKeys = NO_KEYS,
    ) -> None:
        """Make blocks `num_cached..num_full-1` of a request reusable, with one BlockStored."""
        if not self.enable_caching or num_cached >= num_full:
            return
        new = []
        for i in range(num_cached, num_full):
            block, h = blocks[i], hashes[i]
            block.block_hash = h
            self._cached.setdefault(h, {})[block.block_id] = block
            new.append(self._wire(h))
        self.counters.stored += len(new)
        parent = self._wire(hashes[num_cached - 1]) if num_cached else None
        self._emit(self._stored(new, parent, num_cached, num_full, tokens, keys))

    def report_cached(
        self, hashes: Sequence[EngineHash], num_hit: int, tokens: Sequence[int], keys: CacheKeys
    ) -> None:
        """vLLM's `kv_cache_report_mode: full` (a request's `vllm_xargs`): BlockStored again,
        from the root, for the `num_hit` blocks a request found cached; nothing changes."""
        if num_hit:
            wire = [self._wire(h) for h in hashes[:num_hit]]
            self._emit(self._stored(wire, None, 0, num_hit, tokens, keys))

    def _stored(
        self,
        wire: list[WireHash],
        parent: WireHash | None,
        first: int,
        end: int,
        tokens: Sequence[int],
        keys: CacheKeys,
    ) -> BlockStored:
        bs = self.block_size
        return BlockStored(
            block_hashes=wire,
            parent_block_hash=parent,
            token_ids=list(tokens[first * bs : end * bs]),
            block_size=bs,
            lora_id=keys.lora_id,
            medium=MEDIUM,
            lora_name=keys.lora_name,
            extra_keys=[event_extra_keys(keys.block_extra_keys(i * bs)) for i in range(first, end)],
            group_idx=0,
            kv_cache_spec_kind=SPEC_KIND,
        )

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.num_free != self.usable:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        self.counters.resets += 1
        self._emit(AllBlocksCleared())
        return True

    def take_events(self) -> list[WireEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: WireEvent) -> None:
        if self.emit_events:
            self._events.append(event)

    def _wire(self, h: EngineHash) -> WireHash:
        return int.from_bytes(h, "big") & _U64 if self.int_hashes else bytes(h)
