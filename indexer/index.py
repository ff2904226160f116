"""The prefix index: which workers hold which router block hashes, and in which tier.

`PrefixIndex` is the public face; the bookkeeping lives in a backend core with one contract:
`indexer._cindex.Core` (C, compact: ~60-90 bytes per entry) when the extension was built,
else `indexer.index_py.PyCore` (plain dicts, ~180 bytes per entry). Both keep, per worker,
block id -> router hash in first-store order, held-children counts and a hole count, so
`find_matches` can binary-search a request's chain while no worker has holes
(`indexer.index_py` explains the layout). The behavioural tests run against both.

Entries are worker x block pairs. At the `max_entries` bound the storing worker's oldest
stored block is dropped first (FIFO by store time) and `evicted_at_bound` counts it; a
worker given a cap (`set_worker_cap`, from its real KV capacity) drops its own oldest block
at that cap, counted by `evicted_at_cap(worker)`. Prefixes through a dropped block stop
matching until the worker stores it again; size the bound above the fleet's total KV blocks
so it only trips when events were lost.

A block stored again is another cached copy (vLLM recomputes a block-aligned prompt's last
block into a second physical block and evicts the copies one at a time), except in a chain
from the root (no parent). A request sent with `vllm_xargs: {"kv_cache_report_mode": "full"}`
makes vLLM publish BlockStored again, from the root, for the prefix it found cached, with no
new block behind it: counted as copies, such re-reports would keep blocks in the index after
the engine evicted them, for good. On the wire a re-report is a root chain like any other,
and vLLM also caches real second copies from the root (a request that skipped or could not
use the cache: prompt_logprobs, an async KV load, EAGLE's dropped last block), so a GPU root
chain's blocks held already count no copy. Such a real copy then leaves the index at its
first eviction: a hit missed at worst, never a block promised that the engine has not.

A block id (engine hash) stored again for a different block (vLLM's content hashes make that
a hash collision, or a mangled batch) first releases the block it named, as BlockRemoveds of
it in every tier would, copies and all, then names the new one: every entry stays reachable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import xxhash

from indexer.events import DEFAULT_TIER, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.hashing import (
    EngineBlockHash,
    Namespace,
    RouterBlockHash,
    hash_blocks,
    tokens_to_bytes,
)
from indexer.index_py import PyCore

_xxh3 = xxhash.xxh3_64_intdigest

DEFAULT_MAX_ENTRIES = 4_000_000
"""The default bound on worker x block entries (the router's `max_index_entries`)."""

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
    evicted_at_cap: int = 0
    rereported: int = 0  # blocks of root chains held already: no copies (report mode "full")


class Core(Protocol):
    """What a backend provides; workers are small ints (`wid`), block ids opaque ints."""

    backend: str
    max_entries: int
    entries: int
    holes_total: int
    evicted_at_bound: int

    def add_worker(self, wid: int, name: str) -> None: ...
    def remove_worker(self, wid: int) -> None: ...
    def set_cap(self, wid: int, cap: int | None) -> int: ...
    def clear(self, wid: int) -> int: ...
    def store(
        self,
        wid: int,
        tier: str,
        ids: Sequence[int],
        router_hashes: Sequence[int],
        parent: int | None,
        count_copies: bool,
    ) -> tuple[int, int, int]: ...
    def remove(self, wid: int, tier: str, ids: Sequence[int]) -> tuple[int, int]: ...
    def find_matches(self, router_hashes: Sequence[int]) -> dict[str, Overlap]: ...
    def resolve(self, wid: int, block_id: int) -> int | None: ...
    def entries_of(self, wid: int) -> int: ...
    def evicted_at_cap(self, wid: int) -> int: ...
    def blocks(self) -> int: ...
    def holds(self, wid: int) -> set[int]: ...
    def held_any(self, rh: int, wid: int) -> bool: ...
    def parent(self, rh: int) -> int | None: ...
    def dump(self, wid: int) -> tuple[list[tuple[int, int]], dict[int, int], int, int]: ...
    def memory_bytes(self) -> int: ...


def available_backends() -> list[str]:
    """Backends this install can run, preferred first."""
    try:
        import indexer._cindex  # noqa: F401
    except ImportError:
        return ["python"]
    return ["c", "python"]


def _make_core(backend: str | None, max_entries: int) -> Core:
    name = backend or os.environ.get("KVROUTE_INDEX_BACKEND") or available_backends()[0]
    if name == "python":
        return PyCore(max_entries, Overlap, tier_rank)
    if name == "c":
        from indexer._cindex import Core as CCore

        return CCore(max_entries, Overlap, tier_rank, DEFAULT_TIER)
    raise ValueError(f"unknown index backend {name!r} (expected 'c' or 'python')")


class PrefixIndex:
    """Router block hash -> workers (and tiers) holding it. Pure: no IO, no clock.

    `backend`: "c" or "python"; default: $KVROUTE_INDEX_BACKEND, else C when built."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, backend: str | None = None) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._core = _make_core(backend, max_entries)
        self.backend = self._core.backend
        self._wids: dict[str, int] = {}
        self._models: dict[str, str] = {}
        self._free_wids: list[int] = []

    @property
    def max_entries(self) -> int:
        return self._core.max_entries

    @property
    def evicted_at_bound(self) -> int:
        return self._core.evicted_at_bound

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, name: str, model: str = "") -> None:
        """Register a worker; `model` seeds its chains (see `indexer.hashing.Namespace`)."""
        self._models[name] = model
        if name in self._wids:
            return
        # the lowest free id keeps the C core's worker masks one word wide up to 64 workers
        wid = min(self._free_wids) if self._free_wids else len(self._wids)
        if self._free_wids:
            self._free_wids.remove(wid)
        self._core.add_worker(wid, name)
        self._wids[name] = wid

    def workers(self) -> list[str]:
        return list(self._wids)

    def _wid(self, name: str) -> int:
        try:
            return self._wids[name]
        except KeyError:
            raise UnknownWorker(name) from None

    def clear_worker(self, name: str) -> int:
        """Forget everything a worker holds; returns how many entries went."""
        return self._core.clear(self._wid(name))

    def remove_worker(self, name: str) -> None:
        wid = self._wid(name)
        self._core.remove_worker(wid)
        del self._wids[name], self._models[name]
        self._free_wids.append(wid)

    def set_worker_cap(self, worker: str, max_entries: int | None) -> None:
        """Bound one worker's entries (e.g. from its KV capacity); None lifts the bound. At
        the cap its oldest stored block goes first, counted by `evicted_at_cap`; a worker
        already above a new cap is trimmed at once."""
        if max_entries is not None and max_entries <= 0:
            raise ValueError("a worker cap must be positive (or None for no cap)")
        self._core.set_cap(self._wid(worker), max_entries)

    def evicted_at_cap(self, worker: str) -> int:
        """Blocks dropped because this worker reached its cap (0 for an unknown worker)."""
        wid = self._wids.get(worker)
        return 0 if wid is None else self._core.evicted_at_cap(wid)

    # ---- events --------------------------------------------------------------------------

    def apply(self, name: str, batch: EventBatch) -> ApplyResult:
        """Apply one decoded batch for a worker, in order."""
        wid = self._wid(name)
        res = ApplyResult()
        for event in batch.events:
            if type(event) is BlockStored:
                self._apply_stored(name, wid, event, res)
            elif type(event) is BlockRemoved:
                self._remove(wid, event.engine_hashes, event.tier, res)
            elif type(event) is AllBlocksCleared:
                self._core.clear(wid)
                res.cleared += 1
        return res

    def _apply_stored(self, name: str, wid: int, e: BlockStored, res: ApplyResult) -> None:
        if e.parent is None:
            parent: int | None = None
            seed = Namespace(self._models[name], e.lora_name, e.cache_salt).seed(e.block_size)
        else:
            parent = self._core.resolve(wid, e.parent)
            if parent is None:  # its parent's event was missed: never guess a chain
                res.unknown_parent += 1
                return
            seed = parent
        if e.block_extras is None:
            rhs = hash_blocks(e.token_ids, e.block_size, seed)
        else:
            rhs = _hash_with_extras(e.token_ids, e.block_size, seed, e.block_extras)
        # a GPU root chain: its blocks held already are a re-report, no copies (see above)
        root = parent is None and e.tier == DEFAULT_TIER
        before = res.stored
        self._store(wid, e.engine_hashes, rhs, parent, e.tier, res, not root)
        if root:
            res.rereported += len(rhs) - (res.stored - before)

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
        (callers that only refresh)."""
        res = res if res is not None else ApplyResult()
        self._store(self._wid(name), engine_hashes, router_hashes, parent, tier, res, count_copies)

    def _store(
        self,
        wid: int,
        ids: Sequence[int],
        rhs: Sequence[int],
        parent: int | None,
        tier: str,
        res: ApplyResult,
        count_copies: bool,
    ) -> None:
        stored, at_bound, at_cap = self._core.store(wid, tier, ids, rhs, parent, count_copies)
        res.stored += stored
        res.evicted_at_bound += at_bound
        res.evicted_at_cap += at_cap

    def remove_hashes(
        self,
        name: str,
        engine_hashes: Sequence[EngineBlockHash],
        tier: str = DEFAULT_TIER,
        res: ApplyResult | None = None,
    ) -> ApplyResult:
        """Drop blocks by engine hash from one tier (a BlockRemoved without the event)."""
        res = res if res is not None else ApplyResult()
        self._remove(self._wid(name), engine_hashes, tier, res)
        return res

    def _remove(self, wid: int, ids: Sequence[int], tier: str, res: ApplyResult) -> None:
        removed, unknown = self._core.remove(wid, tier, ids)
        res.removed += removed
        res.unknown_removed += unknown

    def router_hash_of(self, name: str, engine_hash: EngineBlockHash) -> RouterBlockHash | None:
        """The router hash a worker's engine hash stands for, if the worker holds it (a
        BlockStored's parent, resolved as `apply` does)."""
        rh = self._core.resolve(self._wid(name), engine_hash)
        return None if rh is None else RouterBlockHash(rh)

    # ---- lookup --------------------------------------------------------------------------

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        """Per worker, the leading blocks of `router_hashes` it holds contiguously, by tier.
        Workers with no overlap are absent."""
        return self._core.find_matches(router_hashes)

    # ---- introspection -------------------------------------------------------------------

    def entries_of(self, name: str) -> int:
        """How many blocks a worker holds (any tier)."""
        wid = self._wids.get(name)
        return 0 if wid is None else self._core.entries_of(wid)

    def holds(self, name: str) -> set[RouterBlockHash]:
        """Every router hash a worker holds in any tier (tests, `kvroute events replay`)."""
        return {RouterBlockHash(rh) for rh in self._core.holds(self._wid(name))}

    def stats(self) -> dict[str, object]:
        core = self._core
        return {
            "backend": self.backend,
            "workers": len(self._wids),
            "blocks": core.blocks(),
            "entries": core.entries,
            "max_entries": core.max_entries,
            "evicted_at_bound": core.evicted_at_bound,
            "per_worker": {n: core.entries_of(wid) for n, wid in self._wids.items()},
            "evicted_at_cap": {n: core.evicted_at_cap(wid) for n, wid in self._wids.items()},
            "memory_bytes_estimate": self.memory_estimate(),
        }

    def memory_estimate(self) -> int:
        """Bytes the index holds: exact for the C core, an estimate for the Python one."""
        return self._core.memory_bytes()

    def verify(self) -> None:
        """Recompute the bookkeeping from scratch and compare (tests and debugging)."""
        core = self._core
        holes_total = entries = 0
        for name, wid in self._wids.items():
            ids, kids_now, holes_now, entries_now = core.dump(wid)
            held = {rh for _, rh in ids if core.held_any(rh, wid)}
            assert len(held) == entries_now, (name, len(held), entries_now)
            kids: dict[int, int] = {}
            holes = 0
            for rh in held:
                p = core.parent(rh)
                if p is not None:
                    kids[p] = kids.get(p, 0) + 1
                    holes += p not in held
            assert kids == kids_now, (name, "kids")
            assert holes == holes_now, (name, holes, holes_now)
            holes_total += holes
            entries += entries_now
        assert holes_total == core.holes_total
        assert entries == core.entries


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
