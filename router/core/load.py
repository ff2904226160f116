"""In-flight load per worker: what this router sent (counted at the pick, so a burst cannot
all land on one worker before the first completes), what the other router replicas say they
sent (the placement link, within a millisecond), and what the workers' /metrics say beyond
both (traffic from anywhere else; a scrape is up to a second old)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from indexer.clock import Clock, MonotonicClock

# How far back the time-averaged in-flight count looks (seconds, exponential). A chat
# session's next turn reaches its worker milliseconds after the last one finished, so an
# instant count calls a worker serving two busy sessions idle between their turns; over a
# second, it is ~2 busy.
BUSY_TAU_S = 1.0


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class LoadView:
    requests: int  # in flight, best of local and scraped (running + waiting)
    prefill_tokens: int  # uncached prompt tokens of local requests before their first token
    decode_blocks: float  # KV blocks of requests in decode, local or scraped
    kv_usage: float | None = None  # the engine's own gauge, 0..1, if scraped
    # in flight on the worker (this router's and its peers'), time-averaged over ~BUSY_TAU_S
    busy: float = 0.0
    # requests there before their first token whose cached part another request is still
    # prefilling (`Ticket.rides`), this router's and its peers': the engine runs them in
    # its next step
    riders: int = 0


@dataclass
class _Local:
    requests: int = 0
    prefill_tokens: int = 0
    decode_blocks: int = 0
    riders: int = 0


@dataclass
class Ticket:
    worker: str
    prefill_tokens: int
    blocks: int
    first_token_seen: bool = False
    done: bool = False
    expects_events: bool = False  # the engine should publish new blocks for this request
    rides: bool = False  # part of its cached prefix was only predicted at the pick
    # the counters it was counted in: a worker removed (and maybe added again) while the
    # request runs must neither fail its end nor count it off the new worker's counters
    counted: _Local = field(default_factory=_Local, repr=False)


@dataclass
class _Busy:
    """The known in-flight count (this router's and its peers'), time-averaged. Replicas
    see each other's requests milliseconds late, which moves the moment's count but barely
    its one-second average: so two replicas weighing a worker by it agree."""

    requests: int = 0  # the known count since `stamp`
    busy: float = 0.0  # time-averaged count up to `stamp`
    stamp: float = 0.0

    def set(self, requests: int, now: float) -> None:
        """Fold the time since the last change into `busy`, then take the new count."""
        self.busy = self.busy_at(now)
        self.stamp = now
        self.requests = requests

    def busy_at(self, now: float) -> float:
        keep = math.exp((self.stamp - now) / BUSY_TAU_S)
        return self.busy * keep + self.requests * (1.0 - keep)


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class PeerLoad:
    """One other replica's own in-flight requests on one worker, as it last published them."""

    requests: int
    prefill_tokens: int
    decode_blocks: int
    # of `requests`, those riding a prefill still in progress there (`Ticket.rides`):
    # without them a replica saw only its own share of a hot prefix's riders and placed
    # cold prefixes on that worker, stalling the stream (hot-prefix, two replicas)
    riders: int = 0


@dataclass
class _Scraped:
    """What the engine reported beyond this router's and its known peers' requests at
    scrape time: traffic no replica told us about. (Comparing the raw gauges with live
    local counts would let a one-second-old scrape outweigh requests that already
    finished.)"""

    others_requests: float = 0.0
    others_blocks: float = 0.0
    kv_usage: float | None = None


@dataclass
class LoadTracker:
    _local: dict[str, _Local] = field(default_factory=dict)
    _scraped: dict[str, _Scraped] = field(default_factory=dict)
    _peers: dict[str, dict[str, PeerLoad]] = field(default_factory=dict)  # worker -> replica
    _busy: dict[str, _Busy] = field(default_factory=dict)
    # told the worker whose local load changed (the placement link publishes it)
    on_change: Callable[[str], None] | None = None
    # told too, and of a worker forgotten (its local load is gone): under --processes each
    # process's own in-flight prefill tokens go to its metrics file
    watchers: list[Callable[[str], None]] = field(default_factory=list)
    clock: Clock = field(default_factory=MonotonicClock)

    def start(self, worker: str, uncached_tokens: int, blocks: int, rides: bool = False) -> Ticket:
        """Count a request at the moment it is routed. `rides`: part of its cached prefix is
        only predicted, from a request that may still be prefilling it."""
        local = self._local.setdefault(worker, _Local())
        local.requests += 1
        local.prefill_tokens += uncached_tokens
        local.riders += rides
        self._counted(worker)
        self._changed(worker)
        return Ticket(worker, uncached_tokens, blocks, rides=rides, counted=local)

    def first_token(self, t: Ticket) -> None:
        if t.first_token_seen or t.done:
            return
        t.first_token_seen = True
        local = t.counted
        local.prefill_tokens -= t.prefill_tokens
        local.riders -= t.rides
        local.decode_blocks += t.blocks
        if self._local.get(t.worker) is local:
            self._changed(t.worker)

    def finish(self, t: Ticket) -> None:
        if t.done:
            return
        local = t.counted
        if t.first_token_seen:
            local.decode_blocks -= t.blocks
        else:
            local.prefill_tokens -= t.prefill_tokens
            local.riders -= t.rides
        local.requests -= 1
        t.done = True
        if self._local.get(t.worker) is not local:
            return  # the worker was forgotten since: its counters are gone with it
        self._counted(t.worker)
        self._changed(t.worker)

    def _changed(self, worker: str) -> None:
        if self.on_change is not None:
            self.on_change(worker)
        for watcher in self.watchers:
            watcher(worker)

    def local(self, worker: str) -> PeerLoad:
        """This replica's own in-flight load on `worker`: what it tells its peers."""
        local = self._local.get(worker, _Local())
        return PeerLoad(local.requests, local.prefill_tokens, local.decode_blocks, local.riders)

    def known(self, worker: str) -> PeerLoad:
        """This replica's and its peers' in-flight load on `worker` (no scraped part)."""
        local = self._local.get(worker, _Local())
        requests, prefill, blocks = local.requests, local.prefill_tokens, local.decode_blocks
        riders = local.riders
        for p in self._peers.get(worker, {}).values():
            requests += p.requests
            prefill += p.prefill_tokens
            blocks += p.decode_blocks
            riders += p.riders
        return PeerLoad(requests, prefill, blocks, riders)

    def peer(self, replica: str, worker: str, load: PeerLoad) -> None:
        """Another replica's own load on `worker` (its latest word replaces the last)."""
        by_replica = self._peers.setdefault(worker, {})
        if load.requests or load.prefill_tokens or load.decode_blocks or load.riders:
            by_replica[replica] = load
        else:
            by_replica.pop(replica, None)
        self._counted(worker)

    def forget_peer(self, replica: str) -> None:
        """A replica went silent (stopped, or the link broke): its load no longer counts."""
        for worker, by_replica in self._peers.items():
            if by_replica.pop(replica, None) is not None:
                self._counted(worker)

    def _counted(self, worker: str) -> None:
        """The known count on `worker` changed: average the one it replaces."""
        requests = self.known(worker).requests
        busy = self._busy.get(worker)
        if busy is None:
            busy = self._busy[worker] = _Busy(stamp=self.clock.now())
        if busy.requests != requests:
            busy.set(requests, self.clock.now())

    def scraped(
        self,
        worker: str,
        running: float,
        waiting: float,
        kv_usage: float | None,
        capacity_blocks: int | None,
    ) -> None:
        engine_requests = running + waiting
        others = max(0.0, engine_requests - self.known(worker).requests)
        engine_blocks = (kv_usage or 0.0) * (capacity_blocks or 0)
        share = others / engine_requests if engine_requests else 0.0
        self._scraped[worker] = _Scraped(others, engine_blocks * share, kv_usage)

    def view(self, worker: str) -> LoadView:
        known = self.known(worker)
        b = self._busy.get(worker)
        busy = b.busy_at(self.clock.now()) if b is not None else 0.0
        s = self._scraped.get(worker)
        if s is None:
            return LoadView(
                known.requests, known.prefill_tokens, known.decode_blocks, None, busy, known.riders
            )
        return LoadView(
            known.requests + round(s.others_requests),
            known.prefill_tokens,
            known.decode_blocks + s.others_blocks,
            s.kv_usage,
            busy,
            known.riders,
        )

    def forget(self, worker: str) -> None:
        self._local.pop(worker, None)
        self._scraped.pop(worker, None)
        self._peers.pop(worker, None)
        self._busy.pop(worker, None)
        for watcher in self.watchers:
            watcher(worker)
