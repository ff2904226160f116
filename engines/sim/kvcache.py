"""Per-request KV bookkeeping on top of the block pool (vLLM's `KVCacheManager`, one
full-attention group). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from engines.sim.blockpool import Block, BlockPool, CacheKeys, EngineHash, Hasher
from engines.sim.request import SimRequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: Hasher) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size

    @property
    def caching(self) -> bool:
        return self.pool.enable_caching

    def hashes(self, req: SimRequest) -> list[EngineHash]:
        """The request's full-block hashes, extended as its tokens grow."""
        n_full = req.num_tokens // self.block_size
        if len(req.block_hashes) < n_full:
            self.hasher.extend(req.block_hashes, req.all_ids(), req.keys)
        return req.block_hashes

    def computed_blocks(self, req: SimRequest) -> list[Block]:
        """Longest cached prefix; never the last token, whose logits must be computed."""
        if not self.caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.longest_hit(self.hashes(req), max_blocks)

    def peek(self, tokens: Sequence[int], keys: CacheKeys) -> int:
        """Leading full blocks of `tokens` cached right now (no cap, no state change)."""
        if not self.caching:
            return 0
        hashes = self.hasher.hashes(tokens, keys)
        return len(self.pool.longest_hit(hashes, len(hashes)))

    def allocate_slots(
        self,
        req: SimRequest,
        num_new: int,
        hit: Sequence[Block] = (),
        *,
        full_sequence_must_fit: bool = False,
        cache: bool = True,
    ) -> bool:
        """Reserve blocks for `num_new` more tokens (after adopting `hit`); False when the
        pool cannot hold them. Newly full blocks become cached at once, as in vLLM, unless
        `cache` is False (blocks a remote pull fills: cached when the pull is done)."""
        bs = self.block_size
        held = len(req.blocks) + len(hit)
        revived = sum(1 for b in hit if b.ref_cnt == 0)  # leave the free queue when touched
        computed = req.num_computed + len(hit) * bs
        if full_sequence_must_fit:
            need_full = max(cdiv(req.num_tokens, bs) - held, 0) + revived
            if need_full > self.pool.num_free:
                return False
        n_alloc = max(cdiv(computed + num_new, bs) - held, 0)
        if n_alloc + revived > self.pool.num_free:
            return False
        if hit:
            self.pool.touch(hit)
            req.blocks.extend(hit)
            req.num_cached_blocks = len(req.blocks)
        req.blocks.extend(self.pool.allocate(n_alloc))
        if cache:
            self.cache_blocks(req, min(computed + num_new, req.num_tokens))
        return True

    def cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        if not self.caching or num_full <= req.num_cached_blocks:
            return
        self.pool.cache_full_blocks(
            req.blocks, self.hashes(req), req.num_cached_blocks, num_full, req.all_ids(), req.keys
        )
        req.num_cached_blocks = num_full

    def free(self, req: SimRequest) -> None:
        """Release a request's blocks, tail first, so its tail is evicted first."""
        self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
