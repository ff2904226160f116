"""The prefix index: which workers hold which router block hashes, and in which tier.

Layout, chosen for lookup speed from Python:
- each worker gets a bit; `_masks[router_hash]` is the set of workers holding that block in
  the default tier (GPU), other tiers keep their own mask maps (usually empty);
- per worker, `eng` maps engine hash -> router hash (BlockRemoved and parent chaining carry
  engine hashes only), `kids` counts held children per parent, and `holes` counts held blocks
  whose parent this worker does not hold.

When no worker has holes (what vLLM's tail-first LRU eviction produces), the mask along a
request's chain can only shrink, so `find_matches` binary-searches for the points where it
shrinks instead of touching every block. With holes anywhere it scans linearly; both paths
give the same answer.

At the `max_entries` bound (worker x block pairs) the storing worker's oldest stored block is
dropped first (FIFO by store time) and `evicted_at_bound` counts it. Prefixes through a dropped
block stop matching until the worker stores it again; size the bound above the fleet's total
KV blocks so it only trips when events were lost.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import repeat
from operator import or_
from typing import NamedTuple

import xxhash

from indexer.events import DEFAULT_TIER, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.hashing import (
    EngineBlockHash,
    Namespace,
    RouterBlockHash,
    hash_blocks,
    tokens_to_bytes,
)

_xxh3 = xxhash.xxh3_64_intdigest


_TIER_RANK = {DEFAULT_TIER: 0, "CPU": 1, "DISK": 2, "STORAGE": 2}


def tier_rank(tier: str) -> tuple[int, str]:
    """Faster tiers first: GPU, CPU, disk/storage, then any other name alphabetically."""
    return (_TIER_RANK.get(tier, 3), tier)


class UnknownWorker(KeyError):
    """An operation named a worker the index does not know."""

    def __init__(self, worker: str) -> None:
        super().__init__(worker)
        self.worker = worker

    def __str__(self) -> str:
        return f"unknown worker {self.worker!r}"


class Overlap(NamedTuple):
    """Leading blocks a worker holds contiguously from a request's first block."""

    blocks: int
    by_tier: dict[str, int]


@dataclass
class ApplyResult:
    """What applying one batch did; the ingest layer turns these into counters."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    evicted_at_bound: int = 0


@dataclass
class _Worker:
    name: str
    bit: int
    model: str
    eng: dict[EngineBlockHash, RouterBlockHash] = field(default_factory=dict)
    kids: dict[int, int] = field(default_factory=dict)
    holes: int = 0
    # vLLM can cache a second copy of a block (same hash) and then publishes BlockStored
    # again and one BlockRemoved per copy: (engine hash, tier) -> copies beyond the first.
    copies: dict[tuple[EngineBlockHash, str], int] = field(default_factory=dict)
    entries: int = 0


class PrefixIndex:
    """Router block hash -> workers (and tiers) holding it. Pure: no IO, no clock."""

    def __init__(self, max_entries: int = 20_000_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._workers: dict[str, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._masks: dict[int, int] = {}
        self._other: dict[str, dict[int, int]] = {}
        self._parent: dict[int, int | None] = {}
        self._entries = 0
        self._holes_total = 0
        self.evicted_at_bound = 0

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, name: str, model: str = "") -> None:
        """Register a worker; `model` seeds its chains (see `indexer.hashing.Namespace`)."""
        if name in self._workers:
            self._workers[name].model = model
            return
        bit = self._free_bits.pop() if self._free_bits else self._take_bit()
        w = _Worker(name=name, bit=1 << bit, model=model)
        self._workers[name] = w
        self._by_bit[w.bit] = w

    def _take_bit(self) -> int:
        self._next_bit += 1
        return self._next_bit - 1

    def workers(self) -> list[str]:
        return list(self._workers)

    def _worker(self, name: str) -> _Worker:
        try:
            return self._workers[name]
        except KeyError:
            raise UnknownWorker(name) from None

    def clear_worker(self, name: str) -> int:
        """Forget everything a worker holds; returns how many entries went."""
        w = self._worker(name)
        dropped = w.entries
        for rh in set(w.eng.values()):
            self._drop_bits(w, rh)
        self._holes_total -= w.holes
        self._entries -= w.entries
        w.eng.clear()
        w.copies.clear()
        w.kids.clear()
        w.holes = 0
        w.entries = 0
        return dropped

    def remove_worker(self, name: str) -> None:
        self.clear_worker(name)
        w = self._workers.pop(name)
        del self._by_bit[w.bit]
        self._free_bits.append(w.bit.bit_length() - 1)

    def _drop_bits(self, w: _Worker, rh: int) -> None:
        """Clear a worker's bit on one block in every tier, and forget the block's parent
        once nobody holds it. Entry/kids/holes bookkeeping is the caller's."""
        keep = ~w.bit
        alive = 0
        for masks in (self._masks, *self._other.values()):
            m = masks.get(rh, 0) & keep
            if m:
                masks[rh] = m
                alive |= m
            else:
                masks.pop(rh, None)
        if not alive:
            self._parent.pop(rh, None)

    def _held_elsewhere(self, rh: int) -> bool:
        if rh in self._masks:
            return True
        return any(rh in t for t in self._other.values())

    # ---- events --------------------------------------------------------------------------

    def apply(self, name: str, batch: EventBatch) -> ApplyResult:
        """Apply one decoded batch for a worker, in order."""
        w = self._worker(name)
        res = ApplyResult()
        for event in batch.events:
            if type(event) is BlockStored:
                self._apply_stored(w, event, res)
            elif type(event) is BlockRemoved:
                self._apply_removed(w, event, res)
            elif type(event) is AllBlocksCleared:
                self.clear_worker(name)
                res.cleared += 1
        return res

    def _apply_stored(self, w: _Worker, e: BlockStored, res: ApplyResult) -> None:
        if e.parent is None:
            parent: int | None = None
            seed = Namespace(w.model, e.lora_name, e.cache_salt).seed(e.block_size)
        else:
            parent = w.eng.get(e.parent)
            if parent is None:  # its parent's event was missed: never guess a chain
                res.unknown_parent += 1
                return
            seed = parent
        if e.block_extras is None:
            rhs = hash_blocks(e.token_ids, e.block_size, seed)
        else:
            rhs = _hash_with_extras(e.token_ids, e.block_size, seed, e.block_extras)
        self.store_hashes(w.name, e.engine_hashes, rhs, parent, e.tier, res)

    def store_hashes(
        self,
        name: str,
        engine_hashes: Sequence[EngineBlockHash],
        router_hashes: Sequence[RouterBlockHash],
        parent: int | None,
        tier: str = DEFAULT_TIER,
        res: ApplyResult | None = None,
        *,
        count_copies: bool = True,
    ) -> None:
        """Record a chain of already-hashed blocks (the index-only half of a BlockStored).
        A block stored again counts as another cached copy unless `count_copies` is off
        (callers that only refresh, like the TTL index)."""
        w = self._worker(name)
        res = res if res is not None else ApplyResult()
        if self._store_fresh_chain(w, engine_hashes, router_hashes, parent, tier, res):
            return
        eng, kids, bit = w.eng, w.kids, w.bit
        masks = self._masks if tier == DEFAULT_TIER else self._other.setdefault(tier, {})
        parents = self._parent
        multi_tier = bool(self._other)
        # The first block's parent may be missing (a hole); every later block's parent is
        # the block stored just before it, held by construction.
        check_parent = True
        new = 0
        for eh, rh in zip(engine_hashes, router_hashes, strict=True):
            m = masks.get(rh, 0)
            if not m & bit:
                masks[rh] = m | bit
                new += 1
                if not (multi_tier and self._held_outside(rh, bit, tier)):
                    if self._entries + new > self.max_entries:
                        self._entries += new - 1
                        w.entries += new - 1
                        new = 1
                        self._evict_one(w, res)
                        check_parent = True
                    parents.setdefault(rh, parent)
                    if parent is not None:
                        kids[parent] = kids.get(parent, 0) + 1
                        if check_parent and not self._held_any(parent, bit):
                            w.holes += 1
                            self._holes_total += 1
                    if w.holes:
                        k = kids.get(rh)
                        if k:
                            w.holes -= k
                            self._holes_total -= k
                else:
                    new -= 1  # already held in another tier: no new entry
                res.stored += 1
            elif count_copies and eng.get(eh) == rh:
                key = (eh, tier)
                w.copies[key] = w.copies.get(key, 0) + 1
            eng[eh] = rh
            parent = rh
            check_parent = False
        w.entries += new
        self._entries += new

    def _store_fresh_chain(
        self,
        w: _Worker,
        engine_hashes: Sequence[EngineBlockHash],
        router_hashes: Sequence[RouterBlockHash],
        parent: int | None,
        tier: str,
        res: ApplyResult,
    ) -> bool:
        """The common case, done with C-level dict updates: a chain none of whose blocks the
        worker holds yet, one tier, no holes, room under the bound. False: take the general
        path."""
        n = len(router_hashes)
        if (
            not n
            or tier != DEFAULT_TIER
            or self._other
            or w.holes
            or self._entries + n > self.max_entries
            or len(engine_hashes) != n
        ):
            return False
        masks, bit = self._masks, w.bit
        get = masks.get
        olds = [get(rh, 0) for rh in router_hashes]
        if reduce(or_, olds) & bit:
            return False
        masks.update(zip(router_hashes, [m | bit for m in olds], strict=True))
        chain = list(router_hashes)
        self._parent.update(zip(chain, [parent, *chain[:-1]], strict=True))
        kids = w.kids
        # blocks the worker did not hold had no held kids
        kids.update(zip(chain[:-1], repeat(1, n - 1), strict=True))
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if not self._held_any(parent, bit):
                w.holes += 1
                self._holes_total += 1
        w.eng.update(zip(engine_hashes, chain, strict=True))
        w.entries += n
        self._entries += n
        res.stored += n
        return True

    def remove_hashes(
        self,
        name: str,
        engine_hashes: Sequence[EngineBlockHash],
        tier: str = DEFAULT_TIER,
        res: ApplyResult | None = None,
    ) -> ApplyResult:
        """Drop blocks by engine hash from one tier (a BlockRemoved without the event)."""
        res = res if res is not None else ApplyResult()
        self._apply_removed(self._worker(name), BlockRemoved(engine_hashes, tier), res)
        return res

    def _apply_removed(self, w: _Worker, e: BlockRemoved, res: ApplyResult) -> None:
        eng, bit = w.eng, w.bit
        tier = e.tier
        masks = self._masks if tier == DEFAULT_TIER else self._other.get(tier, {})
        for eh in e.engine_hashes:
            rh = eng.get(eh)
            if rh is None:
                res.unknown_removed += 1
                continue
            m = masks.get(rh, 0)
            if not m & bit:
                res.unknown_removed += 1
                if not self._held_any(rh, bit):
                    del eng[eh]  # an alias of a block already gone
                continue
            if w.copies and self._drop_copy(w, eh, tier):
                res.removed += 1
                continue  # another copy of the block is still cached
            m &= ~bit
            if m:
                masks[rh] = m
            else:
                del masks[rh]
            res.removed += 1
            if self._other and self._held_any(rh, bit):
                continue  # still held in another tier
            del eng[eh]
            self._unhold(w, rh)
        self._prune_tiers()

    @staticmethod
    def _drop_copy(w: _Worker, eh: EngineBlockHash, tier: str) -> bool:
        key = (eh, tier)
        n = w.copies.get(key, 0)
        if not n:
            return False
        if n > 1:
            w.copies[key] = n - 1
        else:
            del w.copies[key]
        return True

    def _unhold(self, w: _Worker, rh: int) -> None:
        w.entries -= 1
        self._entries -= 1
        bit = w.bit
        p = self._parent.get(rh)
        if p is not None:
            k = w.kids.get(p, 0) - 1
            if k > 0:
                w.kids[p] = k
            else:
                w.kids.pop(p, None)
            if not self._held_any(p, bit):
                w.holes -= 1
                self._holes_total -= 1
        kids_held = w.kids.get(rh, 0)
        if kids_held:
            w.holes += kids_held
            self._holes_total += kids_held
        if not self._held_elsewhere(rh):
            self._parent.pop(rh, None)

    def _evict_one(self, w: _Worker, res: ApplyResult) -> None:
        victim = w if w.entries else max(self._workers.values(), key=lambda x: x.entries)
        eh, rh = next(iter(victim.eng.items()))
        del victim.eng[eh]
        for tier in (DEFAULT_TIER, *self._other):
            victim.copies.pop((eh, tier), None)
        self._unhold(victim, rh)  # while its bits still say who held it
        self._drop_bits(victim, rh)
        res.evicted_at_bound += 1
        self.evicted_at_bound += 1

    def _held_any(self, rh: int, bit: int) -> bool:
        if self._masks.get(rh, 0) & bit:
            return True
        return any(t.get(rh, 0) & bit for t in self._other.values())

    def _held_outside(self, rh: int, bit: int, tier: str) -> bool:
        if tier != DEFAULT_TIER and self._masks.get(rh, 0) & bit:
            return True
        return any(t.get(rh, 0) & bit for name, t in self._other.items() if name != tier)

    def _prune_tiers(self) -> None:
        for name in [n for n, t in self._other.items() if not t]:
            del self._other[name]

    # ---- lookup --------------------------------------------------------------------------

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        """Per worker, the leading blocks of `router_hashes` it holds contiguously, by tier.
        Workers with no overlap are absent."""
        if not router_hashes:
            return {}
        if self._holes_total == 0 and not self._other:
            ends = self._ends_bisect(router_hashes)
        else:
            ends = self._ends_linear(router_hashes)
        out: dict[str, Overlap] = {}
        for bits, count in ends:
            while bits:
                low = bits & -bits
                bits ^= low
                w = self._by_bit[low]
                out[w.name] = Overlap(count, self._split_tiers(router_hashes, count, low))
        return out

    def _ends_bisect(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(workers, blocks) pairs: those workers hold exactly the first `blocks` blocks.
        Valid only while no worker has holes: then the mask along a chain only shrinks."""
        get = self._masks.get
        first = get(hashes[0], 0)
        if not first:
            return []
        last_i = len(hashes) - 1
        last = get(hashes[last_i], 0) & first
        ends: list[tuple[int, int]] = []
        if first != last:
            stack = [(0, first, last_i, last)]
            while stack:
                lo, mlo, hi, mhi = stack.pop()
                if hi - lo == 1:
                    ends.append((mlo & ~mhi, hi))
                    continue
                mid = (lo + hi) >> 1
                mm = get(hashes[mid], 0) & mlo
                if mm != mlo:
                    stack.append((lo, mlo, mid, mm))
                if mm != mhi:
                    stack.append((mid, mm, hi, mhi))
        if last:
            ends.append((last, last_i + 1))
        return ends

    def _ends_linear(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        masks, others = self._masks, list(self._other.values())
        ends: list[tuple[int, int]] = []
        active = -1
        for i, h in enumerate(hashes):
            m = masks.get(h, 0)
            for t in others:
                m |= t.get(h, 0)
            m &= active
            if m != active:
                if i:
                    ends.append((active & ~m, i))
                active = m
                if not active:
                    return ends
        ends.append((active, len(hashes)))
        return ends

    def _split_tiers(self, hashes: Sequence[int], count: int, bit: int) -> dict[str, int]:
        if not self._other:
            return {DEFAULT_TIER: count}
        split: dict[str, int] = {}
        others = sorted(self._other.items(), key=lambda kv: tier_rank(kv[0]))
        for h in hashes[:count]:  # a block held in several tiers counts in the fastest
            if self._masks.get(h, 0) & bit:
                tier = DEFAULT_TIER
            else:
                tier = next(n for n, t in others if t.get(h, 0) & bit)
            split[tier] = split.get(tier, 0) + 1
        return split

    # ---- introspection -------------------------------------------------------------------

    def entries_of(self, name: str) -> int:
        """How many blocks a worker holds (any tier)."""
        w = self._workers.get(name)
        return w.entries if w is not None else 0

    def holds(self, name: str) -> set[RouterBlockHash]:
        """Every router hash a worker holds in any tier (tests, `kvroute events replay`)."""
        return set(self._worker(name).eng.values())

    def stats(self) -> dict[str, object]:
        return {
            "workers": len(self._workers),
            "blocks": len(self._parent),
            "entries": self._entries,
            "max_entries": self.max_entries,
            "evicted_at_bound": self.evicted_at_bound,
            "per_worker": {w.name: w.entries for w in self._workers.values()},
            "memory_bytes_estimate": self.memory_estimate(),
        }

    def verify(self) -> None:
        """Recompute the bookkeeping from scratch and compare (tests and debugging)."""
        holes_total = 0
        for w in self._workers.values():
            held = {rh for rh in w.eng.values() if self._held_any(rh, w.bit)}
            assert len(held) == w.entries, (w.name, len(held), w.entries)
            kids: dict[int, int] = {}
            holes = 0
            for rh in held:
                p = self._parent[rh]
                if p is not None:
                    kids[p] = kids.get(p, 0) + 1
                    holes += p not in held
            assert kids == w.kids, (w.name, "kids")
            assert holes == w.holes, (w.name, holes, w.holes)
            holes_total += holes
        assert holes_total == self._holes_total
        assert self._entries == sum(w.entries for w in self._workers.values())

    def memory_estimate(self) -> int:
        """Container sizes plus one int object per distinct key; an estimate, not a census."""
        size = sys.getsizeof(self._masks) + sys.getsizeof(self._parent)
        size += sum(sys.getsizeof(t) for t in self._other.values())
        for w in self._workers.values():
            size += sys.getsizeof(w.eng) + sys.getsizeof(w.kids)
        return size + 32 * (len(self._parent) + self._entries)


def _hash_with_extras(
    tokens: Sequence[int], block_size: int, seed: int, extras: Iterable[str | None]
) -> list[RouterBlockHash]:
    """Like `hash_blocks`, folding each block's opaque extra identity into its seed."""
    view = memoryview(tokens_to_bytes(tokens))
    step = block_size * 4
    out: list[RouterBlockHash] = []
    h = seed
    for i, extra in enumerate(extras):
        if extra is not None:
            h = _xxh3(extra.encode("utf-8"), h)
        h = _xxh3(view[i * step : (i + 1) * step], h)
        out.append(RouterBlockHash(h))
    return out
