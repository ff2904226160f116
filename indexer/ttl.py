"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.

Expiry runs in time order. With one TTL per index and a monotonic clock, records expire in the
order they were made, so a FIFO of records is already sorted by expiry; a block refreshed by a
later record keeps living until that record's time (its newest expiry is kept per block).

Every routed request is a record of its whole chain (a 2k-token prompt is 128 blocks), so the
bookkeeping is bulk work in C-speed builtins: per worker one dict block -> expiry, filled by
`dict.update(dict.fromkeys(...))`, and the records' chains kept as `array('Q')` (one object,
never walked by the garbage collector: at 120 s x hundreds of requests/s, lists of ints made
every full collection a pause).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from indexer.clock import Clock
from indexer.hashing import RouterBlockHash
from indexer.index import Overlap, PrefixIndex

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0
REFRESH_SLACK = 0.01  # a chain re-recorded within 1% of the TTL keeps its expiry


class TtlIndex:
    """A prefix index whose entries expire, oldest first, on an injected clock. At
    `max_entries` (worker x block pairs) the oldest records expire early, so memory stays
    bounded under any request rate (a bound the index inside never has to enforce itself)."""

    def __init__(self, clock: Clock, ttl_s: float, max_entries: int = 2_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries = 0  # worker x block pairs with an expiry
        self._index = PrefixIndex(max_entries=max_entries + (1 << 16))
        self._expiry: dict[str, dict[int, float]] = {}  # worker -> block -> newest expiry
        self._records: deque[tuple[float, str, array[int]]] = deque()
        # (worker, chain's last hash) -> when its newest record expires
        self._chains: dict[tuple[str, int], float] = {}

    def record(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> None:
        """Remember that `worker` holds this chain until now + ttl (refreshing older ones)."""
        if not router_hashes:
            return
        self.expire()
        until = self._clock.now() + self.ttl_s
        chain = (worker, router_hashes[-1])
        last = self._chains.get(chain)
        if last is not None and until - last < self.ttl_s * REFRESH_SLACK:
            return  # refreshed a moment ago: a burst of the same prompt costs one record
        self._chains[chain] = until
        expiry = self._expiry.get(worker)
        if expiry is None:
            expiry = self._expiry[worker] = {}
            self._index.add_worker(worker)
        before = len(expiry)
        expiry.update(dict.fromkeys(router_hashes, until))
        self._entries += len(expiry) - before
        self._records.append((until, worker, array("Q", router_hashes)))
        self._index.store_chain(worker, router_hashes)
        while self._entries > self.max_entries and len(self._records) > 1:
            self._drop(*self._records.popleft())  # at the bound, the oldest records go early

    def expire(self) -> int:
        """Drop every entry whose time has come; returns how many."""
        now = self._clock.now()
        records = self._records
        n = 0
        while records and records[0][0] <= now:
            n += self._drop(*records.popleft())
        return n

    def _drop(self, until: float, worker: str, hashes: array[int]) -> int:
        """Forget one record's blocks that no later record refreshed."""
        chain = (worker, hashes[-1])
        if self._chains.get(chain) == until:
            del self._chains[chain]
        expiry = self._expiry[worker]
        gone = [rh for rh in hashes if expiry.get(rh) == until]
        for rh in gone:
            del expiry[rh]
        if gone:
            self._index.forget_chain(worker, gone)  # type: ignore[arg-type]
            self._entries -= len(gone)
        return len(gone)

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        self.expire()
        return self._index.find_matches(router_hashes)

    def forget_worker(self, worker: str) -> None:
        expiry = self._expiry.pop(worker, None)
        if expiry is None:
            return
        self._entries -= len(expiry)
        self._records = deque(r for r in self._records if r[1] != worker)
        self._chains = {k: v for k, v in self._chains.items() if k[0] != worker}
        self._index.remove_worker(worker)

    def entries_of(self, worker: str) -> int:
        return self._index.entries_of(worker)

    def __len__(self) -> int:
        return self._entries
