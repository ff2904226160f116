"""The pure-Python index backend: plain dicts, no compiler needed (the fallback when the C
extension `indexer._cindex` is not built). Same contract as `indexer._cindex.Core`, which the
behavioural tests hold both to.

Layout, chosen for lookup speed from Python:
- each worker id `wid` owns the bit `1 << wid`; `_masks[router_hash]` is the set of workers
  holding that block in the default tier (GPU), other tiers keep their own mask maps;
- per worker, `ids` maps block id (an engine hash, or a router hash for workers that publish
  no events) -> router hash, in first-store order (the eviction order), `kids` counts held
  children per parent, and `holes` counts held blocks whose parent this worker does not hold.

When no worker has holes (what vLLM's tail-first LRU eviction produces), the mask along a
request's chain can only shrink, so `find_matches` binary-searches for the points where it
shrinks instead of touching every block. With holes anywhere it scans linearly; both paths
give the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import repeat
from operator import or_
from typing import Any

from indexer.events import DEFAULT_TIER


@dataclass
class _Worker:
    name: str
    bit: int
    ids: dict[int, int] = field(default_factory=dict)  # block id -> router hash
    kids: dict[int, int] = field(default_factory=dict)
    holes: int = 0
    # vLLM can cache a second copy of a block (same hash) and then publishes BlockStored
    # again and one BlockRemoved per copy: (block id, tier) -> copies beyond the first.
    copies: dict[tuple[int, str], int] = field(default_factory=dict)
    entries: int = 0
    cap: int | None = None
    evicted_at_cap: int = 0


class PyCore:
    """Router block hash -> workers (by id) holding it, per tier. Pure: no IO, no clock."""

    backend = "python"

    def __init__(
        self,
        max_entries: int,
        overlap: Callable[[int, dict[str, int]], Any],
        tier_rank: Callable[[str], tuple[int, str]],
    ) -> None:
        self.max_entries = max_entries
        self._overlap = overlap
        self._tier_rank = tier_rank
        self._workers: dict[int, _Worker] = {}
        self._masks: dict[int, int] = {}
        self._other: dict[str, dict[int, int]] = {}
        self._parent: dict[int, int | None] = {}
        self.entries = 0
        self.holes_total = 0
        self.evicted_at_bound = 0

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, wid: int, name: str) -> None:
        self._workers[wid] = _Worker(name=name, bit=1 << wid)

    def remove_worker(self, wid: int) -> None:
        self.clear(wid)
        del self._workers[wid]

    def set_cap(self, wid: int, cap: int | None) -> int:
        """Set a worker's entry cap; trims its oldest blocks at once. Returns how many went."""
        w = self._workers[wid]
        w.cap = cap
        n = 0
        while cap is not None and w.entries > cap:
            n += self._evict_one(w)
        w.evicted_at_cap += n
        return n

    def clear(self, wid: int) -> int:
        w = self._workers[wid]
        dropped = w.entries
        for rh in set(w.ids.values()):
            self._drop_bits(w, rh)
        self._prune_tiers()
        self.holes_total -= w.holes
        self.entries -= w.entries
        w.ids.clear()
        w.copies.clear()
        w.kids.clear()
        w.holes = 0
        w.entries = 0
        return dropped

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

    # ---- stores --------------------------------------------------------------------------

    def store(
        self,
        wid: int,
        tier: str,
        ids: Sequence[int],
        router_hashes: Sequence[int],
        parent: int | None,
        count_copies: bool,
    ) -> tuple[int, int, int]:
        """Record a chain; returns (stored, evicted at the bound, evicted at the cap)."""
        if len(ids) != len(router_hashes):
            raise ValueError("ids and router hashes differ in length")
        w = self._workers[wid]
        fresh = self._store_fresh_chain(w, ids, router_hashes, parent, tier)
        if fresh is not None:
            return fresh, 0, 0
        counts = [0, 0, 0]
        # The first block's parent may be missing (a hole); every later block's parent is
        # the block stored just before it, held unless an eviction just dropped it.
        check_parent = True
        for bid, rh in zip(ids, router_hashes, strict=True):
            old = w.ids.get(bid)
            if old is not None and old != rh:
                self._release_id(w, bid, old)
                old, check_parent = None, True  # the release may have dropped the parent
            if not self._tier_masks(tier).get(rh, 0) & w.bit:
                self._store_one(w, rh, parent, tier, check_parent, counts)
                counts[0] += 1
            elif count_copies and old == rh:
                key = (bid, tier)
                w.copies[key] = w.copies.get(key, 0) + 1
            w.ids[bid] = rh
            parent = rh
            check_parent = False
        return counts[0], counts[1], counts[2]

    def _release_id(self, w: _Worker, bid: int, rh: int) -> None:
        """A block id stored again for another block (a hash collision, or a mangled batch):
        release the block it named as BlockRemoveds of it in every tier would, copies and
        all, so no removal can be left unable to reach it. Then the id is free."""
        del w.ids[bid]
        if w.copies:
            for key in [k for k in w.copies if k[0] == bid]:
                del w.copies[key]
        if self._held_any(rh, w.bit):
            self._unhold(w, rh)  # while its bits still say who held it
            self._drop_bits(w, rh)
            self._prune_tiers()

    def _store_one(
        self,
        w: _Worker,
        rh: int,
        parent: int | None,
        tier: str,
        check_parent: bool,
        counts: list[int],
    ) -> None:
        """Set the worker's bit on one block it does not hold in this tier. Room is made
        before the bit is set, so the eviction never sees the block half-stored."""
        new_entry = not (self._other and self._held_outside(rh, w.bit, tier))
        if new_entry and self._make_room(w, counts):
            check_parent = True  # the eviction may have dropped this block's parent
        masks = self._tier_masks(tier)
        masks[rh] = masks.get(rh, 0) | w.bit
        if not new_entry:
            return  # already held in another tier: no new entry
        w.entries += 1
        self.entries += 1
        self._parent.setdefault(rh, parent)
        kids = w.kids
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if check_parent and not self._held_any(parent, w.bit):
                w.holes += 1
                self.holes_total += 1
        if w.holes:
            k = kids.get(rh, 0)
            w.holes -= k
            self.holes_total -= k

    def _tier_masks(self, tier: str) -> dict[int, int]:
        return self._masks if tier == DEFAULT_TIER else self._other.setdefault(tier, {})

    def _make_room(self, w: _Worker, counts: list[int]) -> bool:
        """Before a new entry: the worker's cap first, then the global bound."""
        evicted = False
        if w.cap is not None and w.entries + 1 > w.cap:
            n = self._evict_one(w)
            w.evicted_at_cap += n
            counts[2] += n
            evicted = True
        if self.entries + 1 > self.max_entries:
            victim = w if w.entries else self._largest()
            n = self._evict_one(victim)
            self.evicted_at_bound += n
            counts[1] += n
            evicted = True
        return evicted

    def _largest(self) -> _Worker:
        """The worker with the most entries; a tie goes to the lowest worker id."""
        return max(self._workers.values(), key=lambda x: (x.entries, -x.bit))

    def _store_fresh_chain(
        self,
        w: _Worker,
        ids: Sequence[int],
        router_hashes: Sequence[int],
        parent: int | None,
        tier: str,
    ) -> int | None:
        """The common case, done with C-level dict updates: a chain none of whose blocks the
        worker holds yet, under ids it has not used, one tier, no holes, room under the bound
        and the cap. None: take the general path."""
        n = len(router_hashes)
        if (
            not n
            or tier != DEFAULT_TIER
            or self._other
            or w.holes
            or self.entries + n > self.max_entries
            or (w.cap is not None and w.entries + n > w.cap)
        ):
            return None
        masks, bit = self._masks, w.bit
        get = masks.get
        olds = [get(rh, 0) for rh in router_hashes]
        if reduce(or_, olds) & bit or not self._claim_ids(w, ids, router_hashes):
            return None
        masks.update(zip(router_hashes, [m | bit for m in olds], strict=True))
        chain = list(router_hashes)
        parents = self._parent
        for rh, p in zip(chain, [parent, *chain[:-1]], strict=True):
            parents.setdefault(rh, p)
        kids = w.kids
        # blocks the worker did not hold had no held kids
        kids.update(zip(chain[:-1], repeat(1, n - 1), strict=True))
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if not self._held_any(parent, bit):
                w.holes += 1
                self.holes_total += 1
        w.entries += n
        self.entries += n
        return n

    @staticmethod
    def _claim_ids(w: _Worker, ids: Sequence[int], router_hashes: Sequence[int]) -> bool:
        """Record ids -> router hashes if every id is new to the worker and to the chain;
        else change nothing and say no (the general path releases what a reused id named)."""
        known = w.ids
        if not known.keys().isdisjoint(ids):
            return False
        before = len(known)
        known.update(zip(ids, router_hashes, strict=True))
        if len(known) == before + len(ids):
            return True
        for bid in ids:  # an id twice in the chain: all were new, so popping undoes it
            known.pop(bid, None)
        return False

    # ---- removals ------------------------------------------------------------------------

    def remove(self, wid: int, tier: str, ids: Sequence[int]) -> tuple[int, int]:
        """Drop blocks by id from one tier; returns (removed, unknown)."""
        w = self._workers[wid]
        bit, known = w.bit, w.ids
        masks = self._masks if tier == DEFAULT_TIER else self._other.get(tier, {})
        removed = unknown = 0
        for bid in ids:
            rh = known.get(bid)
            if rh is None:
                unknown += 1
                continue
            m = masks.get(rh, 0)
            if not m & bit:
                unknown += 1
                if not self._held_any(rh, bit):
                    del known[bid]  # an alias of a block already gone
                continue
            removed += 1
            if w.copies and self._drop_copy(w, bid, tier):
                continue  # another copy of the block is still cached
            m &= ~bit
            if m:
                masks[rh] = m
            else:
                del masks[rh]
            if self._other and self._held_any(rh, bit):
                continue  # still held in another tier
            del known[bid]
            self._unhold(w, rh)
        self._prune_tiers()
        return removed, unknown

    @staticmethod
    def _drop_copy(w: _Worker, bid: int, tier: str) -> bool:
        key = (bid, tier)
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
        self.entries -= 1
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
                self.holes_total -= 1
        kids_held = w.kids.get(rh, 0)
        if kids_held:
            w.holes += kids_held
            self.holes_total += kids_held
        if not self._held_elsewhere(rh):
            self._parent.pop(rh, None)

    def _evict_one(self, victim: _Worker) -> int:
        """Drop the victim's oldest held block; ids of blocks it no longer holds (aliases
        of a block already gone) are dropped on the way. Returns 1, or 0 if it held none."""
        ids = victim.ids
        while ids:
            bid = next(iter(ids))
            rh = ids.pop(bid)
            if not self._held_any(rh, victim.bit):
                continue
            for tier in (DEFAULT_TIER, *self._other):
                victim.copies.pop((bid, tier), None)
            self._unhold(victim, rh)  # while its bits still say who held it
            self._drop_bits(victim, rh)
            self._prune_tiers()
            return 1
        return 0

    def _held_any(self, rh: int, bit: int) -> bool:
        if self._masks.get(rh, 0) & bit:
            return True
        return any(t.get(rh, 0) & bit for t in self._other.values())

    def _held_elsewhere(self, rh: int) -> bool:
        if rh in self._masks:
            return True
        return any(rh in t for t in self._other.values())

    def _held_outside(self, rh: int, bit: int, tier: str) -> bool:
        if tier != DEFAULT_TIER and self._masks.get(rh, 0) & bit:
            return True
        return any(t.get(rh, 0) & bit for name, t in self._other.items() if name != tier)

    def _prune_tiers(self) -> None:
        for name in [n for n, t in self._other.items() if not t]:
            del self._other[name]

    # ---- lookup --------------------------------------------------------------------------

    def find_matches(self, router_hashes: Sequence[int]) -> dict[str, Any]:
        if not router_hashes:
            return {}
        if self.holes_total == 0 and not self._other:
            ends = self._ends_bisect(router_hashes)
        else:
            ends = self._ends_linear(router_hashes)
        out: dict[str, Any] = {}
        by_bit = {w.bit: w for w in self._workers.values()}
        for bits, count in ends:
            while bits:
                low = bits & -bits
                bits ^= low
                w = by_bit[low]
                out[w.name] = self._overlap(count, self._split_tiers(router_hashes, count, low))
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
        others = sorted(self._other.items(), key=lambda kv: self._tier_rank(kv[0]))
        for h in hashes[:count]:  # a block held in several tiers counts in the fastest
            if self._masks.get(h, 0) & bit:
                tier = DEFAULT_TIER
            else:
                tier = next(n for n, t in others if t.get(h, 0) & bit)
            split[tier] = split.get(tier, 0) + 1
        return split

    # ---- introspection -------------------------------------------------------------------

    def resolve(self, wid: int, block_id: int) -> int | None:
        return self._workers[wid].ids.get(block_id)

    def entries_of(self, wid: int) -> int:
        return self._workers[wid].entries

    def evicted_at_cap(self, wid: int) -> int:
        return self._workers[wid].evicted_at_cap

    def blocks(self) -> int:
        return len(self._parent)

    def holds(self, wid: int) -> set[int]:
        w = self._workers[wid]
        return {rh for rh in w.ids.values() if self._held_any(rh, w.bit)}

    def held_any(self, rh: int, wid: int) -> bool:
        return self._held_any(rh, self._workers[wid].bit)

    def parent(self, rh: int) -> int | None:
        """The block's parent (None for a chain's first block); KeyError if nobody holds it."""
        return self._parent[rh]

    def dump(self, wid: int) -> tuple[list[tuple[int, int]], dict[int, int], int, int]:
        """(ids in eviction order, kids, holes, entries) of one worker, for `verify`."""
        w = self._workers[wid]
        return list(w.ids.items()), dict(w.kids), w.holes, w.entries

    def memory_bytes(self) -> int:
        """Container sizes plus one int object per distinct key; an estimate, not a census."""
        import sys

        size = sys.getsizeof(self._masks) + sys.getsizeof(self._parent)
        size += sum(sys.getsizeof(t) for t in self._other.values())
        for w in self._workers.values():
            size += sys.getsizeof(w.ids) + sys.getsizeof(w.kids)
        return size + 32 * (len(self._parent) + self.entries)
