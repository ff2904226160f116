"""Per-worker ordered ingest: sequence checks, replay decisions, decoding, index updates.

Pure: the ZMQ subscriber (`indexer.subscriber`) owns the sockets and asks this class what to
do. One instance per worker, driven by one task, so a worker's events apply in order.

    live batch -> classify seq -> apply | duplicate | gap -> replay (or resync) | restart
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from indexer.clock import Clock
from indexer.events import BlockStored, EventBatch
from indexer.health import HealthTracker
from indexer.index import ApplyResult, PrefixIndex
from indexer.sequencing import SeqTracker, Verdict

log = logging.getLogger("kvroute.ingest")

Decoder = Callable[[bytes], EventBatch]


class BlockSizeMismatch(ValueError):
    """A worker's events use a block size other than the one configured for it."""

    def __init__(self, worker: str, configured: int, published: int) -> None:
        super().__init__(
            f"worker {worker}: block size mismatch: configured block_size={configured} but its "
            f"KV events carry block_size={published}; set block_size: {published} for this "
            f"worker (or remove the setting to learn it from the events), or start vLLM with "
            f"--block-size {configured}"
        )
        self.worker = worker
        self.configured = configured
        self.published = published


@dataclass
class IngestCounters:
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    restarts: int = 0
    malformed: int = 0
    skipped_events: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    evicted_at_bound: int = 0


@dataclass(frozen=True)
class ReplayRequest:
    worker: str
    start_seq: int


class BurstLog:
    """Log the first of a burst of similar problems, then stay quiet until it calms down."""

    def __init__(self, clock: Clock, quiet_s: float = 30.0) -> None:
        self._clock = clock
        self._quiet_s = quiet_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        now = self._clock.now()
        last = self._last.get(key)
        self._last[key] = now
        if last is not None and now - last < self._quiet_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        more = self._suppressed.pop(key, 0)
        suffix = f" ({more} more like it since the last report)" if more else ""
        log.warning("%s%s", message, suffix)


class WorkerIngest:
    """Feeds one worker's event stream into the shared index, in order."""

    def __init__(
        self,
        worker: str,
        index: PrefixIndex,
        decode: Decoder,
        clock: Clock,
        *,
        health: HealthTracker | None = None,
        has_replay: bool = True,
        block_size: int | None = None,
    ) -> None:
        self.worker = worker
        self.index = index
        self._decode = decode
        self.health = health or HealthTracker(worker, clock)
        self.has_replay = has_replay
        self.configured_block_size = block_size
        self.learned_block_size: int | None = None
        self.counters = IngestCounters()
        self.tracker = SeqTracker()
        self._burst = BurstLog(clock)
        self._pending: tuple[int, bytes] | None = None

    @property
    def block_size(self) -> int | None:
        """What requests to this worker are hashed with: what its events say, else config."""
        return self.learned_block_size or self.configured_block_size

    def reconnected(self) -> None:
        self.tracker.reconnected()

    def on_live(self, seq: int, payload: bytes) -> ReplayRequest | None:
        """Handle one live batch. A returned request asks the caller to fetch a replay and
        hand it to `finish_replay`; the batch is held until then."""
        verdict = self.tracker.classify_live(seq)
        if verdict is Verdict.RESTART:
            self._restart(seq)
            verdict = self.tracker.classify_live(seq)
        if verdict is Verdict.APPLY:
            self._apply(seq, payload)
        elif verdict is Verdict.DUPLICATE:
            self.counters.duplicates += 1
        else:
            return self._gap(seq, payload)
        return None

    def finish_replay(self, frames: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply what the replay socket returned (None: it failed or timed out), then the
        held live batch."""
        pending, self._pending = self._pending, None
        if frames is None:
            self.counters.replay_failures += 1
        for seq, payload in frames or ():
            self._ordered(seq, payload, "the replay buffer no longer holds the missed batches")
        if pending is not None:
            self._ordered(*pending, "the replay did not cover the gap")

    def _ordered(self, seq: int, payload: bytes, why_resync: str) -> None:
        verdict = self.tracker.classify(seq)
        if verdict is Verdict.DUPLICATE:
            self.counters.duplicates += 1
            return
        if verdict is Verdict.GAP:
            self._resync(seq, f"batches {self.tracker.expected}..{seq - 1} lost: {why_resync}")
        self._apply(seq, payload)

    def _gap(self, seq: int, payload: bytes) -> ReplayRequest | None:
        self.counters.gaps += 1
        start = self.tracker.expected
        if not self.has_replay:
            self._resync(seq, f"batches {start}..{seq - 1} lost and no replay endpoint")
            self._apply(seq, payload)
            return None
        self.counters.replays += 1
        self._pending = (seq, payload)
        return ReplayRequest(self.worker, start)

    def _restart(self, seq: int) -> None:
        self.counters.restarts += 1
        self.index.clear_worker(self.worker)
        self.tracker.restart()
        self.learned_block_size = None
        log.warning(
            "worker %s: KV event sequence went back to %d: engine restarted, its index was cleared",
            self.worker,
            seq,
        )

    def _resync(self, seq: int, reason: str) -> None:
        self.counters.resyncs += 1
        self.index.clear_worker(self.worker)
        self.tracker.skip_to(seq)
        self.health.note_resync(reason)
        log.warning("worker %s: index cleared and resyncing: %s", self.worker, reason)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.tracker.applied(seq)
        self.counters.batches += 1
        try:
            batch = self._decode(payload)
        except ValueError as exc:
            self.counters.malformed += 1
            self._burst.warn("malformed", f"worker {self.worker}: dropped batch {seq}: {exc}")
            return
        self.apply_batch(batch)

    def apply_batch(self, batch: EventBatch) -> ApplyResult:
        """Apply a decoded batch (also used by `kvroute events replay` on captures)."""
        stored_seen = False
        for event in batch.events:
            name = type(event).__name__
            self.counters.events[name] = self.counters.events.get(name, 0) + 1
            if type(event) is BlockStored:
                stored_seen = True
                self._check_block_size(event.block_size)
        res = self.index.apply(self.worker, batch)
        c = self.counters
        c.skipped_events += batch.skipped
        c.blocks_stored += res.stored
        c.blocks_removed += res.removed
        c.unknown_parent += res.unknown_parent
        c.unknown_removed += res.unknown_removed
        c.evicted_at_bound += res.evicted_at_bound
        if res.unknown_parent:
            self._burst.warn(
                "parent",
                f"worker {self.worker}: {res.unknown_parent} BlockStored events name a parent "
                "block this router never saw stored (missed events); they were not indexed",
            )
        if stored_seen:
            self.health.note_stored()
        return res

    def _check_block_size(self, published: int) -> None:
        if self.learned_block_size is None:
            self.learned_block_size = published
        elif published != self.learned_block_size:
            self._burst.warn(
                "bs", f"worker {self.worker}: events switched block_size to {published}"
            )
            self.learned_block_size = published
        configured = self.configured_block_size
        if configured is not None and configured != published:
            err = BlockSizeMismatch(self.worker, configured, published)
            self.health.set_error("block_size", str(err))
        else:
            self.health.set_error("block_size", None)
