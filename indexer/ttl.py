"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.

Expiry runs in time order. With one TTL per index and a monotonic clock, records expire in the
order they were made, so a FIFO of records is already sorted by expiry; a block refreshed by a
later record keeps living until that record's time (its newest expiry is kept per block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from indexer.clock import Clock
from indexer.hashing import RouterBlockHash
from indexer.index import Overlap, PrefixIndex

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0
REFRESH_SLACK = 0.01  # a chain re-recorded within 1% of the TTL keeps its expiry


class TtlIndex:
    """A prefix index whose entries expire, oldest first, on an injected clock."""

    def __init__(self, clock: Clock, ttl_s: float, max_entries: int = 2_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._clock = clock
        self.ttl_s = ttl_s
        self._index = PrefixIndex(max_entries=max_entries)
        self._expiry: dict[tuple[str, int], float] = {}
        self._records: deque[tuple[float, str, Sequence[RouterBlockHash]]] = deque()
        # (worker, chain's last hash) -> when its newest record expires
        self._chains: dict[tuple[str, int], float] = {}

    def record(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> None:
        """Remember that `worker` holds this chain until now + ttl (refreshing older ones)."""
        if not router_hashes:
            return
        self.expire()
        now = self._clock.now()
        until = now + self.ttl_s
        chain = (worker, router_hashes[-1])
        last = self._chains.get(chain)
        if last is not None and until - last < self.ttl_s * REFRESH_SLACK:
            return  # refreshed a moment ago: a burst of the same prompt costs one record
        self._chains[chain] = until
        if worker not in self._index.workers():
            self._index.add_worker(worker)
        expiry = self._expiry
        for rh in router_hashes:
            expiry[(worker, rh)] = until
        self._records.append((until, worker, router_hashes))
        self._index.store_chain(worker, router_hashes)

    def expire(self) -> int:
        """Drop every entry whose time has come; returns how many."""
        now = self._clock.now()
        records = self._records
        n = 0
        while records and records[0][0] <= now:
            until, worker, hashes = records.popleft()
            chain = (worker, hashes[-1])
            if self._chains.get(chain) == until:
                del self._chains[chain]
            gone: list[RouterBlockHash] = []
            for rh in hashes:
                key = (worker, rh)
                if self._expiry.get(key) == until:  # not refreshed by a later record
                    del self._expiry[key]
                    gone.append(rh)
            if gone:
                self._index.forget_chain(worker, gone)
                n += len(gone)
        return n

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        self.expire()
        return self._index.find_matches(router_hashes)

    def forget_worker(self, worker: str) -> None:
        if worker not in self._index.workers():
            return
        self._records = deque(r for r in self._records if r[1] != worker)
        self._chains = {k: v for k, v in self._chains.items() if k[0] != worker}
        for key in [k for k in self._expiry if k[0] == worker]:
            del self._expiry[key]
        self._index.remove_worker(worker)

    def entries_of(self, worker: str) -> int:
        return self._index.entries_of(worker)

    def __len__(self) -> int:
        return len(self._expiry)
