"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.

Expiry runs in time order. With one TTL per index and a monotonic clock, a worker's records
expire in the order they were made, so a FIFO of records per worker is already sorted by
expiry; a block refreshed by a later record keeps living until that record's time (its newest
expiry is kept per block).

A record refreshes only what is not already fresh (living within `REFRESH_SLACK` of the TTL):
a burst of one prompt costs one record, and a shared prefix with a new tail costs the tail,
which joins the record of its prefix and lives as long (a block is no use without its
prefix). So along any chain a block never outlives its prefix, and the live blocks of a chain
are a leading run: `record` bisects the fresh run and `find_matches` each worker's run, with
a few dict lookups per worker instead of a second, compiled index (whose store and removal
cost ~0.13 ms per 2k-token prompt at the cap).

Bounded per worker: a worker whose entries pass its cap (its KV capacity when known, like the
exact index's; `DEFAULT_WORKER_CAP` blocks until then) forgets its oldest records first, as
its engine would evict them. Besides being what the worker can really hold, this keeps every
table small: at a thousand 2k-token requests a second, 120 s of records is ~15M entries, and
the tables growing towards that (a Python dict doubling, the compiled index rebuilding) held
the event loop for 10-85 ms at a time.

Every routed request is a record of its whole chain (a 2k-token prompt is 128 blocks), so the
bookkeeping is bulk work in C-speed builtins: per worker one dict block -> expiry, filled by
`dict.update(dict.fromkeys(...))`, and the records' chains kept as tuples of the hashes (ints
only: the garbage collector stops tracking them).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

from indexer.clock import Clock
from indexer.events import DEFAULT_TIER
from indexer.hashing import RouterBlockHash
from indexer.index import Overlap

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0
REFRESH_SLACK = 0.01  # a chain re-recorded within 1% of the TTL keeps its expiry
DEFAULT_WORKER_CAP = 1 << 16  # blocks, until the worker's KV capacity is known


@dataclass
class _Worker:
    """One worker's records (oldest first) and the newest expiry of each block."""

    cap: int
    records: deque[tuple[float, list[tuple[int, ...]]]] = field(default_factory=deque)
    expiry: dict[int, float] = field(default_factory=dict)
    by_until: dict[float, list[tuple[int, ...]]] = field(default_factory=dict)  # records by time


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
        self._workers: dict[str, _Worker] = {}
        self._caps: dict[str, int] = {}  # kept across forget_worker (an engine restart)
        self._next = float("inf")  # the earliest expiry of any worker's oldest record

    def set_worker_cap(self, worker: str, cap: int | None) -> None:
        """Bound a worker's entries (its KV capacity in blocks); None: the default."""
        self._caps[worker] = cap or self.worker_cap
        w = self._workers.get(worker)
        if w is not None:
            w.cap = self._caps[worker]
            self._trim(w)

    def record(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> None:
        """Remember that `worker` holds this chain until now + ttl (refreshing older ones)."""
        if not router_hashes:
            return
        self.expire()
        until = self._clock.now() + self.ttl_s
        w = self._worker(worker)
        if w.records and until <= w.records[-1][0]:
            # one record per time, so a tail finds its prefix's record by its expiry
            until = math.nextafter(w.records[-1][0], math.inf)
        k = self._fresh_run(w, router_hashes, until - self.ttl_s * REFRESH_SLACK)
        if k == len(router_hashes):
            return  # refreshed a moment ago: a burst of the same prompt costs nothing
        if k:
            # The rest of the chain joins the record of its fresh prefix and lives as long
            # (a block is no use without its prefix): a shared prefix with a new tail costs
            # the tail, not the whole chain.
            parent = router_hashes[k - 1]
            self._add(w, w.expiry[parent], router_hashes[k:])
            if parent in w.expiry:
                return
            # that record was the oldest past the cap and went: record the chain afresh
        self._add(w, until, router_hashes)

    @staticmethod
    def _fresh_run(w: _Worker, hashes: Sequence[RouterBlockHash], fresh_from: float) -> int:
        """How many leading blocks already live past `fresh_from`. Along a chain a block
        never outlives its prefix (a record covers a chain from its first block; a tail
        joins its prefix's record), so the fresh blocks are a leading run: bisect it."""
        expiry = w.expiry
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if expiry.get(hashes[mid], 0.0) >= fresh_from:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _add(self, w: _Worker, until: float, hashes: Sequence[RouterBlockHash]) -> None:
        """Give `hashes` expiry `until`, in the record of that time (made when new)."""
        before = len(w.expiry)
        w.expiry.update(dict.fromkeys(hashes, until))
        self._entries += len(w.expiry) - before
        parts = w.by_until.get(until)
        if parts is None:
            parts = w.by_until[until] = []
            w.records.append((until, parts))
            self._next = min(self._next, w.records[0][0])
        parts.append(tuple(hashes))
        self._trim(w)

    def _worker(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker(self._caps.get(worker, self.worker_cap))
        return w

    def _trim(self, w: _Worker) -> None:
        """Past the worker's cap or the global bound, its oldest records go early."""
        while len(w.records) > 1 and (len(w.expiry) > w.cap or self._entries > self.max_entries):
            self._drop(w)

    def expire(self) -> int:
        """Drop every entry whose time has come; returns how many."""
        now = self._clock.now()
        if now < self._next:
            return 0
        n = 0
        for w in self._workers.values():
            while w.records and w.records[0][0] <= now:
                n += self._drop(w)
        heads = [w.records[0][0] for w in self._workers.values() if w.records]
        self._next = min(heads, default=float("inf"))
        return n

    def _drop(self, w: _Worker) -> int:
        """Forget the worker's oldest record: its blocks no later record refreshed."""
        until, parts = w.records.popleft()
        del w.by_until[until]
        get, pop = w.expiry.get, w.expiry.pop
        gone = [rh for rh in chain.from_iterable(parts) if get(rh) == until]
        for rh in gone:
            pop(rh)
        self._entries -= len(gone)
        return len(gone)

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        """Per worker, the leading blocks of the chain it holds: along a chain the live
        blocks are a leading run (see `_fresh_run`), so each worker's is bisected."""
        self.expire()
        out: dict[str, Overlap] = {}
        if not router_hashes:
            return out
        first = router_hashes[0]
        for worker, w in self._workers.items():
            expiry = w.expiry
            if first not in expiry:
                continue
            lo, hi = 1, len(router_hashes)
            while lo < hi:
                mid = (lo + hi) // 2
                if router_hashes[mid] in expiry:
                    lo = mid + 1
                else:
                    hi = mid
            out[worker] = Overlap(lo, {DEFAULT_TIER: lo})
        return out

    def forget_worker(self, worker: str) -> None:
        w = self._workers.pop(worker, None)
        if w is None:
            return
        self._entries -= len(w.expiry)

    def entries_of(self, worker: str) -> int:
        w = self._workers.get(worker)
        return len(w.expiry) if w is not None else 0

    def __len__(self) -> int:
        return self._entries
