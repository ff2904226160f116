"""Time-limited entries: the approximate mode and short-lived predictions.

Approximate mode (a worker that publishes no events): every routing decision is remembered as
"this worker now holds this prefix" for a TTL (default 120 s). In events mode the same
structure holds predictions for a few seconds (default 5 s), so a burst of siblings sees the
prefix before the worker's first BlockStored arrives.

Expiry runs in time order. With one TTL per index and a monotonic clock, a worker's records
expire in the order they were made, so a FIFO of records per worker is already sorted by
expiry; a block refreshed by a later record keeps living until that record's time (its newest
expiry is kept per block).

A record refreshes its whole chain, prefix and all, unless the chain's last block already
lives within `REFRESH_SLACK` of the TTL (a burst of one prompt costs one record). So along any
chain a block never outlives its prefix, and the live blocks of a chain are a leading run:
`find_matches` bisects each worker's run with a few dict lookups per worker instead of asking
a second, compiled index (whose store and removal cost ~0.13 ms per 2k-token prompt at the
cap).

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

A record keeps only the blocks it still owns (whose newest expiry is its own). Refreshing a
chain takes its blocks from the records that held them, and those records are cut down to
what they still own: dropping a record only ever removed its owned blocks, so nothing
changes but memory. Without this, traffic sharing a long prefix kept every request's copy
of the prefix: with distinct ~30-token tails on a 2k-token prefix at ~2,700 requests a
second, approximate mode (120 s) grew ~180 MB every 10 s while the entries stayed under the
cap. Now what the records hold is about the entries, which the caps bound.

A request picked for one worker but served by another (a gateway's fallback) is taken back
from the first (`withdraw`): the blocks its record added go, unless a later request (or one
of the burst that re-used the record) is believed to hold them there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from indexer.clock import Clock
from indexer.events import DEFAULT_TIER
from indexer.hashing import RouterBlockHash
from indexer.index import Overlap

APPROX_TTL_S = 120.0
PREDICTION_TTL_S = 5.0
REFRESH_SLACK = 0.01  # a chain re-recorded within 1% of the TTL keeps its expiry
DEFAULT_WORKER_CAP = 1 << 16  # blocks, until the worker's KV capacity is known


# [until, tuple of the block hashes it owns, how many of the chain's last blocks it added
# (the worker held none of them before), requests of a burst that re-used all of it, how
# many of its last blocks no such request re-used]: mutable, cut down (from the front) as
# it loses blocks. The last three serve `withdraw` only.
_Record = list[Any]


@dataclass
class _Worker:
    """One worker's records (oldest first), the newest expiry of each block, and the
    records by their expiry (a block's expiry names the records that may own it)."""

    cap: int
    records: deque[_Record] = field(default_factory=deque)
    expiry: dict[int, float] = field(default_factory=dict)
    by_until: dict[float, list[_Record]] = field(default_factory=dict)


RUNS_BISECTED = 8  # past this many distinct expiries along a chain, one plain pass


def _expiries_along(get: Callable[[int], float | None], chain: tuple[int, ...]) -> set[Any]:
    """The expiries the chain's blocks have now (None: not held). Along a chain they never
    increase (a block is refreshed only with its whole prefix), so each value is one run
    and a bisect finds where it ends: a shared 2k-token prefix and a new tail are two runs,
    ~15 lookups instead of 128. A value missed (were the order ever broken) only leaves a
    record holding blocks it no longer owns until its turn, which drops what it owns."""
    found: set[Any] = set()
    i, n = 0, len(chain)
    while i < n:
        if len(found) >= RUNS_BISECTED:
            found.update(map(get, chain[i:]))
            break
        value = get(chain[i])
        found.add(value)
        if value is None:
            break  # nothing after an unheld block is held
        lo, hi = i + 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if get(chain[mid]) == value:
                lo = mid + 1
            else:
                hi = mid
        i = lo
    return found


def _index_by_until(w: _Worker, until: float, recs: list[_Record]) -> None:
    """The records that may own blocks expiring at `until` are now `recs` (none: gone)."""
    if recs:
        w.by_until[until] = recs
    else:
        w.by_until.pop(until, None)


def _record_of(w: _Worker, chain: Sequence[int]) -> _Record | None:
    """The record made for this chain, while it still owns the chain's last block."""
    until = w.expiry.get(chain[-1])
    for rec in w.by_until.get(until, ()) if until is not None else ():
        if rec[1] and rec[1][-1] == chain[-1]:
            return rec
    return None


def _claim(w: _Worker, chain: Sequence[int]) -> None:
    """A request of a burst re-uses the record holding its chain (see `record`): taking
    that record's own request back (`withdraw`) must leave it what it holds."""
    last = chain[-1]
    for rec in w.by_until.get(w.expiry.get(last, -1.0), ()):
        owned = rec[1]
        if owned and owned[-1] == last:
            rec[3] += 1
            return
        if last in owned:  # a prefix of its chain: its blocks past this one stay unclaimed
            rec[4] = min(rec[4], len(owned) - 1 - owned.index(last))
            return


def _give_up(same_tick: list[_Record], chain: tuple[int, ...]) -> list[_Record]:
    """Records made in the same clock tick as a new one share its expiry, so `_cut` cannot
    tell which of their blocks it took: they give them up here, and those left with blocks
    are returned. Otherwise the older record, dropped at the cap, takes the blocks with it
    and leaves the chain's tail held without its prefix, which `find_matches` bisects past
    (found by the model test: a chain recorded, extended and recorded again in one tick, at
    the cap). The blocks taken are a leading run of each record's, as in `_cut`."""
    taken = set(chain)
    for rec in same_tick:
        owned = rec[1]
        k = 0
        while k < len(owned) and owned[k] in taken:
            k += 1
        rec[1] = owned[k:]
    return [rec for rec in same_tick if rec[1]]


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
        if w.expiry.get(router_hashes[-1], 0.0) >= until - self.ttl_s * REFRESH_SLACK:
            # refreshed a moment ago (and so its prefix): a burst costs one record
            _claim(w, router_hashes)
            return
        # The whole chain is refreshed, prefix and all, into the newest record: at the cap
        # the oldest records go first, so a prefix in use must not stay in an old one
        # (measured: tails joining their prefix's older record let the cap drop a long
        # document's prediction while in use, and long-short-mix's TTFT p90 went 110-147
        # -> 277-312 ms as a second long document was placed on its worker).
        chain = tuple(router_hashes)  # one int object per hash, the dict's and the record's
        before = len(w.expiry)
        losers = _expiries_along(w.expiry.get, chain)  # of the records losing blocks
        w.expiry.update(zip(chain, repeat(until)))
        added = len(w.expiry) - before  # the chain's last blocks (held ones lead a chain)
        self._entries += added
        record: _Record = [until, chain, added, 0, len(chain)]
        w.records.append(record)
        same_tick = w.by_until.get(until)
        if same_tick is None:
            w.by_until[until] = [record]
        else:
            w.by_until[until] = [*_give_up(same_tick, chain), record]
        losers.discard(None)
        losers.discard(until)
        for old in losers:
            self._cut(w, old)
        self._next = min(self._next, w.records[0][0])
        self._trim(w)

    @staticmethod
    def _cut(w: _Worker, until: float) -> None:
        """The records expiring at `until` keep only the blocks they still own. A record's
        blocks are one chain in order, and a block is refreshed only with its whole prefix,
        so the blocks a newer record took are a leading run and the owned ones the rest: a
        bisect finds where (two records alternating on one 2k-token prefix, as two processes
        do, otherwise filtered 128 blocks a record)."""
        recs = w.by_until.get(until)
        if recs is None:
            return
        get = w.expiry.get
        for rec in recs:
            chain = rec[1]
            lo, hi = 0, len(chain)
            while lo < hi:
                mid = (lo + hi) // 2
                if get(chain[mid]) == until:
                    hi = mid
                else:
                    lo = mid + 1
            rec[1] = chain[lo:]
        # records cut empty leave this table but stay queued (tiny) until their turn
        _index_by_until(w, until, [rec for rec in recs if rec[1]])

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
        record = w.records.popleft()
        until, hashes = record[0], record[1]
        recs = w.by_until.get(until)
        if recs is not None:  # others may share its expiry (made in the same clock tick)
            _index_by_until(w, until, [rec for rec in recs if rec is not record])
        get, pop = w.expiry.get, w.expiry.pop
        gone = [rh for rh in hashes if get(rh) == until]
        for rh in gone:
            pop(rh)
        self._entries -= len(gone)
        return len(gone)

    def find_matches(self, router_hashes: Sequence[RouterBlockHash]) -> dict[str, Overlap]:
        """Per worker, the leading blocks of the chain it holds: along a chain the live
        blocks are a leading run (see the module's doc), so each worker's is bisected."""
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

    def withdraw(self, worker: str, router_hashes: Sequence[RouterBlockHash]) -> int:
        """Take back the `record` of this chain on `worker`: the request was served elsewhere
        (a gateway's fallback). The blocks it added, unless a later record refreshed them,
        are forgotten; those it only refreshed were believed held before it and stay. A
        record a burst re-used stays until each of its requests was taken back, and what a
        burst request on a prefix of it re-used stays. Returns the entries forgotten."""
        w = self._workers.get(worker) if router_hashes else None
        if w is None:
            return 0
        self.expire()
        rec = _record_of(w, router_hashes)
        if rec is None:
            return 0
        if rec[3]:
            rec[3] -= 1
            return 0
        owned: tuple[int, ...] = rec[1]
        gone: int = min(rec[2], rec[4], len(owned))
        keep = len(owned) - gone
        pop = w.expiry.pop
        for rh in owned[keep:]:
            pop(rh)
        self._entries -= gone
        rec[1], rec[2] = owned[:keep], 0
        if not keep:  # stays queued (tiny) until its turn, like a record cut empty
            _index_by_until(w, rec[0], [r for r in w.by_until[rec[0]] if r[1]])
        return gone

    def remove_worker(self, worker: str) -> None:
        """The worker left the fleet: its entries and its cap (kept across forget_worker)."""
        self.forget_worker(worker)
        self._caps.pop(worker, None)

    def forget_worker(self, worker: str) -> None:
        w = self._workers.pop(worker, None)
        if w is None:
            return
        self._entries -= len(w.expiry)

    def held_hashes(self) -> int:
        """Block hashes the records hold in all (about `len(self)`: each record keeps only
        what it owns)."""
        return sum(len(rec[1]) for w in self._workers.values() for rec in w.records)

    def entries_of(self, worker: str) -> int:
        w = self._workers.get(worker)
        return len(w.expiry) if w is not None else 0

    def __len__(self) -> int:
        return self._entries
