"""In-flight load per worker: what this router sent (counted at the pick, so a burst cannot
all land on one worker before the first completes), what the other router replicas say they
sent (the placement link, within a millisecond), and what the workers' /metrics say beyond
both (traffic from anywhere else; a scrape is up to a second old)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from indexer.clock import Clock, MonotonicClock

log = logging.getLogger("kvroute.load")

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
    # the requests the engine runs at once, learned from its scrapes (`_Batch`); None: unknown
    batch_limit: int | None = None


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


# Learning an engine's batch limit (vLLM's --max-num-seqs, which its /metrics do not
# export) from its scrapes. A worker whose batch is full queues every further request, so a
# hot prefix kept on it waits there while other workers idle (hot-prefix-full-batch: TTFT p90
# 571 ms against 194 ms with the limit given as --busy-max-requests). Engines also queue for
# other reasons, and a limit learned from those caps a worker below what it can run
# (measured with every queue a scrape showed taken as a full batch: vllm-prefix-repetition
# cached 0.618 against the ideal's 0.731, its engines queueing for KV blocks). So a scrape
# teaches the limit only when nothing but a full batch explains the queue:
# waiting requests, beyond this router's and its peers' riders there (`Ticket.rides`: they
# wait for a prefill of their prefix in progress, as the engine holds them, not for a slot);
# one is often a request that arrived since the engine's last step
LEARN_MIN_WAITING = 2
LEARN_KV_ROOM = 0.9  # KV use under this: the queue is not for blocks
# this router's and its peers' uncached prompt tokens before their first token there under
# this: the queue is not for the step's token budget, which only prefill beyond it fills
# (vLLM's --max-num-batched-tokens: its API server's defaults are 2,048 to 16,384 on GPUs,
# 2,048 per rank on CPUs). Queued requests count too, so only a queue of mostly cached
# prompts teaches, as a hot prefix's repeats are (at 1,024, twelve of them waiting held
# ~1,300 tokens and taught nothing: hot-prefix-full-batch)
LEARN_MAX_PREFILL_TOKENS = 2048
LEARN_CONFIRM_S = 0.25  # ... and a scrape at least this much later shows the same


@dataclass
class _Batch:
    """One worker's learned batch limit: the running count that two scrapes at least
    LEARN_CONFIRM_S apart showed while requests waited for nothing but a slot (LEARN_*), at
    the most this worker was ever seen running. A scrape that shows more running unlearns it
    (new engine flags)."""

    most: float = 0.0  # the most requests a scrape showed running
    pending: float | None = None  # the running count a scrape showed that could teach
    pending_at: float = 0.0
    limit: int | None = None

    def scraped(
        self,
        now: float,
        running: float,
        waiting: float,
        kv_usage: float | None,
        known: PeerLoad,
        deferred: float | None = 0.0,
    ) -> str | None:
        """Take one scrape; "learned" or "dropped" when it changed the limit. `deferred`:
        of `waiting`, those held for something other than a slot (`EngineMetrics.deferred`);
        None where the engine also queues for another reason that the scrape does not tell
        apart (a worker serving LoRA adapters holds requests for an adapter not loaded yet):
        then nothing is learned."""
        self.most = max(self.most, running)
        if self.limit is not None and running > self.limit:
            self.limit = None
            return "dropped"
        full = (
            deferred is not None
            and self.limit is None
            and waiting - deferred - known.riders >= LEARN_MIN_WAITING
            and running >= max(1.0, self.most)  # the most it ever ran, this scrape's included
            and (kv_usage is None or kv_usage < LEARN_KV_ROOM)
            and known.prefill_tokens < LEARN_MAX_PREFILL_TOKENS
        )
        if not full:
            self.pending = None
        elif self.pending != running:
            self.pending, self.pending_at = running, now
        elif now - self.pending_at >= LEARN_CONFIRM_S:  # two scrapes close together: one moment
            self.limit = int(running)
            self.pending = None
            return "learned"
        return None


@dataclass
class LoadTracker:
    _local: dict[str, _Local] = field(default_factory=dict)
    _scraped: dict[str, _Scraped] = field(default_factory=dict)
    _peers: dict[str, dict[str, PeerLoad]] = field(default_factory=dict)  # worker -> replica
    _busy: dict[str, _Busy] = field(default_factory=dict)
    _batch: dict[str, _Batch] = field(default_factory=dict)
    _most_running: float = 0.0  # the most any worker's scrapes showed running
    # told a worker sent more requests than a scrape ever showed it running while its batch
    # limit is unknown: a scrape now learns a full batch within a fraction of a second, where
    # the next periodic one (a second) leaves a hot prefix's requests queued there till then
    on_crowded: Callable[[str], None] | None = None
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
        if self.on_crowded is not None and self._crowded(worker):
            self.on_crowded(worker)
        return Ticket(worker, uncached_tokens, blocks, rides=rides, counted=local)

    def _crowded(self, worker: str) -> bool:
        """More requests on `worker` than a scrape ever showed it running, its batch limit
        unknown (none before its first scrape: nothing to compare with)."""
        b = self._batch.get(worker)
        return b is not None and b.limit is None and self.known(worker).requests > b.most

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
        deferred: float | None = 0.0,
    ) -> None:
        """Take one scrape of `worker`'s engine (`_Batch.scraped` for `deferred`)."""
        known = self.known(worker)
        engine_requests = running + waiting
        others = max(0.0, engine_requests - known.requests)
        engine_blocks = (kv_usage or 0.0) * (capacity_blocks or 0)
        share = others / engine_requests if engine_requests else 0.0
        self._scraped[worker] = _Scraped(others, engine_blocks * share, kv_usage)
        batch = self._batch.setdefault(worker, _Batch())
        self._most_running = max(self._most_running, running)
        change = batch.scraped(self.clock.now(), running, waiting, kv_usage, known, deferred)
        if change == "learned":
            log.info(
                "worker %s queues requests at %d running with KV room and little prefill "
                "ahead: it is busy at %d, taken as its batch limit (vLLM's --max-num-seqs; "
                "--busy-max-requests sets a lower bound, --no-busy-learn-batch turns this off)",
                worker,
                batch.limit,
                self.batch_limit(worker),
            )
        elif change == "dropped":
            log.info(
                "worker %s runs %d requests, more than its learned batch limit: dropped",
                worker,
                running,
            )

    def confirming(self, worker: str) -> bool:
        """The last scrape could teach `worker`'s batch limit: scrape it again soon."""
        b = self._batch.get(worker)
        return b is not None and b.pending is not None

    def forget_batch(self, worker: str) -> None:
        """Forget what `worker`'s scrapes taught of its batch (removed, or a new engine
        process whose batch limit may differ)."""
        if self._batch.pop(worker, None) is not None:
            self._most_running = max((b.most for b in self._batch.values()), default=0.0)

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
            self.batch_limit(worker),
        )

    def batch_limit(self, worker: str) -> int | None:
        """`worker`'s learned batch limit, raised to the most any worker was seen running:
        a limit learned from a queue that was not for slots after all (an engine's step
        can stall for reasons no scrape shows) would otherwise hold itself in place, as
        the worker never gets more requests to show it wrong. The floor spans the fleet,
        every pool and role: a fleet mixing batch sizes is protected up to its largest."""
        b = self._batch.get(worker)
        if b is None or b.limit is None:
            return None
        return max(b.limit, int(self._most_running))

    def forget(self, worker: str) -> None:
        self._local.pop(worker, None)
        self._scraped.pop(worker, None)
        self._peers.pop(worker, None)
        self._busy.pop(worker, None)
        self.forget_batch(worker)
        for watcher in self.watchers:
            watcher(worker)
