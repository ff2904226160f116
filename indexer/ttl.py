"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.

Expiry runs in time order. With one TTL per index and a monotonic clock, a worker's records
expire in the order they were made, so a FIFO of records per worker is already sorted by
expiry; a block refreshed by a later record keeps living until that record's time (its newest
expiry is kept per block).

Bounded per worker: a worker whose entries pass its cap (its KV capacity when known, like the
exact index's; `DEFAULT_WORKER_CAP` blocks until then) forgets its oldest records first, as
its engine would evict them. Besides being what the worker can really hold, this keeps every
table small: at a thousand 2k-token requests a second, 120 s of records is ~15M entries, and
the tables growing towards that (a Python dict doubling, the compiled index rebuilding) held
the event loop for 10-85 ms at a time.

Every routed request is a record of its whole chain (a 2k-token prompt is 128 blocks), so the
bookkeeping is bulk work in C-speed builtins: per worker one dict block -> expiry, filled by
`dict.update(dict.fromkeys(...))`, and the records' chains kept as `array('Q')` (one object,
never walked by the garbage collector).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from indexer.clock import Clock
from indexer.hashing import RouterBlockHash
from indexer.index import Overlap, PrefixIndex

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0
REFRESH_SLACK = 0.01  # a chain re-recorded within 1% of the TTL keeps its expiry
DEFAULT_WORKER_CAP = 1 << 16  # blocks, until the worker's KV capacity is known


@dataclass
class _Worker:
    """One worker's records (oldest first) and the newest expiry of each block."""

    cap: int
    records: deque[tuple[float, array[int]]] = field(default_factory=deque)
    expiry: dict[int, float] = field(default_factory=dict)
    chains: dict[int, float] = field(default_factory=dict)  # chain's last hash -> expiry


class TtlIndex:
    """A prefix index whose entries expire, oldest first, on an injected clock, within a
    cap per worker and `max_entries` in all (past either, the oldest records go early)."""

    def __init__(
        self,
        clock: Clock,
        ttl_s: float,
        max_entries: int = 1_000_000,
        worker_cap: int = DEFAULT_WORKER_CAP,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.worker_cap = worker_cap
        self._entries = 0  # worker x block pairs with an expiry
        self._index = PrefixIndex(max_entries=max_entries + (1 << 16))
        self._workers: dict[str, _Worker] = {}
        self._caps: dict[str, int] = {}  # kept across forget_worker (an engine restart)
        self._next = float("inf")  # the earliest expiry of any worker's oldest record

    def set_worker_cap(self, worker: str, cap: int | None) -> None:
        """Bound a worker's entries (its KV capacity in blocks); None: the default."""
        self._caps[worker] = cap or self.worker_cap
        w = self._workers.get(worker)
        if w is not None:
            w.cap = self._caps[worker]
            self._trim(worker, w)

    def record(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> None:
        """Remember that `worker` holds this chain until now + ttl (refreshing older ones)."""
        if not router_hashes:
            return
        self.expire()
        until = self._clock.now() + self.ttl_s
        w = self._worker(worker)
        last = w.chains.get(router_hashes[-1])
        if last is not None and until - last < self.ttl_s * REFRESH_SLACK:
            return  # refreshed a moment ago: a burst of the same prompt costs one record
        w.chains[router_hashes[-1]] = until
        before = len(w.expiry)
        w.expiry.update(dict.fromkeys(router_hashes, until))
        self._entries += len(w.expiry) - before
        w.records.append((until, array("Q", router_hashes)))
        self._next = min(self._next, w.records[0][0])
        self._index.store_chain(worker, router_hashes)
        self._trim(worker, w)

    def _worker(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker(self._caps.get(worker, self.worker_cap))
            self._index.add_worker(worker)
        return w

    def _trim(self, worker: str, w: _Worker) -> None:
        """Past the worker's cap or the global bound, its oldest records go early."""
        while len(w.records) > 1 and (len(w.expiry) > w.cap or self._entries > self.max_entries):
            self._drop(worker, w)

    def expire(self) -> int:
        """Drop every entry whose time has come; returns how many."""
        now = self._clock.now()
        if now < self._next:
            return 0
        n = 0
        for worker, w in self._workers.items():
            while w.records and w.records[0][0] <= now:
                n += self._drop(worker, w)
        heads = [w.records[0][0] for w in self._workers.values() if w.records]
        self._next = min(heads, default=float("inf"))
        return n

    def _drop(self, worker: str, w: _Worker) -> int:
        """Forget the worker's oldest record: its blocks no later record refreshed."""
        until, hashes = w.records.popleft()
        if w.chains.get(hashes[-1]) == until:
            del w.chains[hashes[-1]]
        expiry = w.expiry
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
        w = self._workers.pop(worker, None)
        if w is None:
            return
        self._entries -= len(w.expiry)
        self._index.remove_worker(worker)

    def entries_of(self, worker: str) -> int:
        return self._index.entries_of(worker)

    def __len__(self) -> int:
        return self._entries
