"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from indexer.clock import Clock
from indexer.hashing import EngineBlockHash, RouterBlockHash
from indexer.index import Overlap, PrefixIndex

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0


class TtlIndex:
    """A prefix index whose entries expire, oldest first, on an injected clock."""

    def __init__(self, clock: Clock, ttl_s: float, max_entries: int = 2_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._clock = clock
        self.ttl_s = ttl_s
        self._index = PrefixIndex(max_entries=max_entries)
        self._expiry: dict[tuple[str, int], float] = {}
        self._order: SortedList = SortedList()  # (expiry, worker, router hash)

    def record(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> None:
        """Remember that `worker` holds this chain until now + ttl (refreshing older ones)."""
        if not router_hashes:
            return
        self.expire()
        if worker not in self._index.workers():
            self._index.add_worker(worker)
        until = self._clock.now() + self.ttl_s
        for rh in router_hashes:
            key = (worker, rh)
            old = self._expiry.get(key)
            if old is not None:
                self._order.remove((old, worker, rh))
            self._expiry[key] = until
            self._order.add((until, worker, rh))
        ids = [EngineBlockHash(h) for h in router_hashes]
        self._index.store_hashes(worker, ids, router_hashes, None)

    def expire(self) -> int:
        """Drop every entry whose time has come; returns how many."""
        now = self._clock.now()
        order = self._order
        n = 0
        while order and order[0][0] <= now:
            _, worker, rh = order.pop(0)
            del self._expiry[(worker, rh)]
            self._index.remove_hashes(worker, [EngineBlockHash(rh)])
            n += 1
        return n

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        self.expire()
        return self._index.find_matches(router_hashes)

    def forget_worker(self, worker: str) -> None:
        if worker not in self._index.workers():
            return
        for (w, rh), until in list(self._expiry.items()):
            if w == worker:
                del self._expiry[(w, rh)]
                self._order.remove((until, w, rh))
        self._index.remove_worker(worker)

    def entries_of(self, worker: str) -> int:
        return self._index.entries_of(worker)

    def __len__(self) -> int:
        return len(self._expiry)
