"""Per-worker ordered ingest: sequence checks, replay decisions, decoding, index updates.

Pure: the ZMQ subscriber (`indexer.subscriber`) owns the sockets and asks this class what to
do. One instance per worker, driven by one task, so a worker's events apply in order.

    live batch -> classify seq -> apply | duplicate | stale | hold | gap/catch-up -> replay
                                                                    (or resync) | restart

Nothing a batch carries can stop the stream: a batch that fails to decode or to apply is
counted under a reason (`IngestCounters.malformed_by_reason`), logged once per burst, and
the next batch is handled as usual. See `indexer.sequencing` for what counts as a restart.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from indexer.clock import Clock
from indexer.demand import DecayingCount, EvictedBlocks
from indexer.events import DEFAULT_TIER, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.health import HealthTracker
from indexer.index import ApplyResult, PrefixIndex
from indexer.sequencing import SeqTracker, Verdict

log = logging.getLogger("kvroute.ingest")

Decoder = Callable[[bytes], EventBatch]
DETAIL_CHARS = 200  # of an error's text in a log line: junk must not flood the log
# a connect replay's last batches remembered by their bytes: the live copies queued while it
# was fetched and applied are among them (a few seconds of an engine's batches)
REPLAY_COPIES = 4096


class MalformedBatch(ValueError):
    """A payload a decoder refuses. Engine adapters raise it (or a subclass) with a short
    `reason` that labels the malformed-batch counter (e.g. `decode`, `too_deep`)."""

    def __init__(self, message: str, reason: str = "decode") -> None:
        super().__init__(message)
        self.reason = reason


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
    """Per-worker event-stream counters (what `/metrics` and `/health` show).

    `malformed` is the total of `malformed_by_reason`, whose keys are the decoder's reasons
    (see the engine adapter, e.g. `too_deep`, `bad_type`) plus `decode` (any other decoder
    failure), `apply` (the index refused a decoded batch: the worker's index is cleared)
    and `frame` (the transport's message was not topic/seq/payload). `duplicates` are live
    copies of batches a replay already applied (expected after every replay);
    `out_of_order` are live batches numbered below the next expected one that were not a
    restart: dropped. `catchups` are streams whose first batch started past 0 (replayed
    from 0, not a gap)."""

    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    gaps: int = 0
    catchups: int = 0
    replays: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    restarts: int = 0
    malformed: int = 0
    malformed_by_reason: dict[str, int] = field(default_factory=dict)
    skipped_events: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    evicted_at_bound: int = 0
    refetched_blocks: int = 0  # GPU blocks stored again soon after the worker evicted them
    # root-chain blocks stored again while held: re-reports (kv_cache_report_mode "full")
    rereported_blocks: int = 0


@dataclass(frozen=True)
class ReplayRequest:
    worker: str
    start_seq: int


class BurstLog:
    """One line per kind of problem per quiet period: the first occurrence is logged at
    once, repeats within `quiet_s` are counted and reported with the next line."""

    def __init__(self, clock: Clock, quiet_s: float = 30.0) -> None:
        self._clock = clock
        self._quiet_s = quiet_s
        self._logged_at: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        now = self._clock.now()
        last = self._logged_at.get(key)
        if last is not None and now - last < self._quiet_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._logged_at[key] = now
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
        demand: DecayingCount | None = None,
        refetched: DecayingCount | None = None,
    ) -> None:
        self.worker = worker
        self.demand = demand  # blocks this worker stored lately (the placement scorer)
        # blocks it stored again soon after evicting them (the placement scorer's churn)
        self.refetched = refetched
        self._evicted = EvictedBlocks()
        self.index = index
        self._decode = decode
        self.health = health or HealthTracker(worker, clock)
        self.has_replay = has_replay
        self.configured_block_size = block_size
        self.learned_block_size: int | None = None
        self.counters = IngestCounters()
        self.tracker = SeqTracker()
        self._burst = BurstLog(clock)
        self._pending: list[tuple[int, bytes]] = []  # live batches waiting for a replay
        self._held: tuple[int, bytes] | None = None  # maybe a restart: the next batch says
        # seq -> hash of the bytes the connect replay returned, its last REPLAY_COPIES
        # batches: a live batch with the same bytes is a copy queued during the replay
        self._replayed: dict[int, int] = {}

    @property
    def block_size(self) -> int | None:
        """What requests to this worker are hashed with: what its events say, else config."""
        return self.learned_block_size or self.configured_block_size

    def reconnected(self) -> None:
        """The subscription (re)connected (see `SeqTracker.reconnected`)."""
        self.tracker.reconnected()
        self._replayed = {}

    def resubscribed(self) -> None:
        """A new subscription replaces one whose task ended: batches it held are dropped
        (the next batch's gap check fetches them again by replay)."""
        self._pending = []
        self._held = None
        self.tracker.reconnected()
        self._replayed = {}

    def on_connected(self) -> ReplayRequest | None:
        """The subscription connected: fetch what the engine's replay buffer holds past
        what is applied (from 0 on a first connect). A restarted router, or one back from
        a blip, would otherwise wait for the engine's next live batch to notice what it
        missed, and an engine serving only cached prompts publishes none: its index would
        stay empty (or stale) and its health read "no events"."""
        if not self.has_replay or self._pending or self._held is not None:
            return None
        self.counters.replays += 1
        return ReplayRequest(self.worker, self.tracker.expected)

    def finish_connect_replay(self, frames: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply the replay `on_connected` asked for (None: it failed or timed out)."""
        if frames is None:
            self.counters.replay_failures += 1
            return
        self.apply_replayed(frames)
        if frames and self.tracker.last_applied is not None:
            self.tracker.replayed_on_connect(self.tracker.last_applied)
            self._replayed = {seq: hash(payload) for seq, payload in frames[-REPLAY_COPIES:]}

    def apply_replayed(self, frames: Sequence[tuple[int, bytes]]) -> None:
        """Apply part of a replay ahead of its `finish_*` call: a long one is applied in
        parts, so that routing is not held up while 10,000 batches go in."""
        for seq, payload in frames:
            self._ordered(
                seq, payload, "the replay did not return them (out of the engine's buffer, or lost)"
            )

    def malformed_frame(self, detail: str) -> None:
        """The transport received a message that is not (topic, seq, payload)."""
        self._malformed(None, "frame", detail)

    def on_live(self, seq: int, payload: bytes) -> ReplayRequest | None:
        """Handle one live batch. A returned request asks the caller to fetch a replay and
        hand it to `finish_replay`; the batch is held until then."""
        held, self._held = self._held, None
        if held is not None:
            if self.tracker.confirms_restart(held[0], seq):
                return self._restarted(held, (seq, payload))
            self._out_of_order(held[0])
        copy = bool(self._replayed) and self._replayed.get(seq) == hash(payload)
        verdict = self.tracker.classify_live(seq, replayed_copy=copy)
        if verdict in (Verdict.APPLY, Verdict.GAP):
            self._replayed = {}  # the live stream passed what the replay applied
        if verdict is Verdict.RESTART:
            self._restart(seq)
            return self.on_live(seq, payload)
        if verdict in (Verdict.GAP, Verdict.CATCH_UP):
            return self._missed(verdict, seq, payload)
        self._act(verdict, seq, payload)
        return None

    def _act(self, verdict: Verdict, seq: int, payload: bytes) -> None:
        if verdict is Verdict.APPLY:
            self._apply(seq, payload)
        elif verdict is Verdict.DUPLICATE:
            self.counters.duplicates += 1
        elif verdict is Verdict.STALE:
            self._out_of_order(seq)
        else:  # HOLD
            self._held = (seq, payload)

    def finish_replay(self, frames: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply what the replay socket returned (None: it failed or timed out), then the
        held live batches."""
        pending, self._pending = self._pending, []
        if frames is None:
            self.counters.replay_failures += 1
        self.apply_replayed(frames or ())
        for seq, payload in pending:
            self._ordered(seq, payload, "the replay did not cover the gap")

    def _ordered(self, seq: int, payload: bytes, why_resync: str) -> None:
        verdict = self.tracker.classify(seq)
        if verdict is Verdict.DUPLICATE:
            self.counters.duplicates += 1
            return
        if verdict is Verdict.GAP:
            if self.tracker.last_applied is None:  # a new stream starts where its buffer does
                self.tracker.skip_to(seq)
            else:
                self._resync(seq, f"batches {self.tracker.expected}..{seq - 1} lost: {why_resync}")
        self._apply(seq, payload)

    def _missed(self, verdict: Verdict, seq: int, payload: bytes) -> ReplayRequest | None:
        """Batches before `seq` did not arrive: lost after the last applied one (a gap), or
        published before this stream's subscription took hold (a catch-up)."""
        start = self.tracker.expected
        if verdict is Verdict.GAP:
            self.counters.gaps += 1
        else:
            self.counters.catchups += 1
        if not self.has_replay:
            if verdict is Verdict.GAP:
                self._resync(seq, f"batches {start}..{seq - 1} lost and no replay endpoint")
            else:
                self.tracker.skip_to(seq)
            self._apply(seq, payload)
            return None
        self.counters.replays += 1
        self._pending = [(seq, payload)]
        return ReplayRequest(self.worker, start)

    def _restarted(
        self, held: tuple[int, bytes], current: tuple[int, bytes]
    ) -> ReplayRequest | None:
        """The held batch began a new engine process's stream: start over from it."""
        self._restart(held[0])
        request = self.on_live(*held)
        if request is not None:
            self._pending.append(current)
            return request
        return self.on_live(*current)

    def _restart(self, seq: int) -> None:
        self.counters.restarts += 1
        self.index.clear_worker(self.worker)
        self.tracker.restart()
        self._replayed = {}
        self.learned_block_size = None
        log.warning(
            "worker %s: KV event sequence went back to %d: engine restarted, its index was cleared",
            self.worker,
            seq,
        )

    def _out_of_order(self, seq: int) -> None:
        self.counters.out_of_order += 1
        self._burst.warn(
            "out_of_order",
            f"worker {self.worker}: dropped KV event batch {seq}: a duplicate or out of order "
            f"(next expected: {self.tracker.expected})",
        )

    def _resync(self, seq: int, reason: str) -> None:
        self.counters.resyncs += 1
        self.index.clear_worker(self.worker)
        self.tracker.skip_to(seq)
        self.health.note_resync(reason)
        log.warning("worker %s: index cleared and resyncing: %s", self.worker, reason)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch; whatever it holds, the stream goes on."""
        self.tracker.applied(seq)
        self.counters.batches += 1
        try:
            batch = self._decode(payload)
        except MalformedBatch as exc:
            # dropped whole, the index as it was: junk must not cost what valid batches
            # taught (a removal inside it stays unseen until the block is stored again)
            self._malformed(seq, exc.reason, str(exc))
            return
        except Exception as exc:  # a decoder's bug must not end the stream either
            self._malformed(seq, "decode", f"{type(exc).__name__}: {exc}")
            return
        try:
            self.apply_batch(batch)
        except Exception as exc:
            self._malformed(seq, "apply", f"{type(exc).__name__}: {exc}")
            self._start_over(f"KV event batch {seq} could not be applied")

    def _start_over(self, reason: str) -> None:
        """A batch half applied: the index starts over rather than trust it (the next
        batches fill it)."""
        self.counters.resyncs += 1
        with contextlib.suppress(KeyError):  # the worker left the index meanwhile
            self.index.clear_worker(self.worker)
        self.health.note_resync(reason)

    def _malformed(self, seq: int | None, reason: str, detail: str) -> None:
        c = self.counters
        c.malformed += 1
        c.malformed_by_reason[reason] = c.malformed_by_reason.get(reason, 0) + 1
        which = "a message" if seq is None else f"batch {seq}"
        self._burst.warn(
            f"malformed:{reason}",
            f"worker {self.worker}: dropped KV event {which} ({reason}): {detail[:DETAIL_CHARS]}",
        )

    def _count_refetched(self, batch: EventBatch) -> None:
        for event in batch.events:  # GPU blocks only: one loaded back from CPU is no prefill
            if isinstance(event, BlockRemoved) and event.tier == DEFAULT_TIER:
                self._evicted.evicted(event.engine_hashes)
            elif isinstance(event, BlockStored) and event.tier == DEFAULT_TIER:
                hashes = event.engine_hashes
                if event.parent is None:  # a re-report names blocks still held: no prefill
                    hashes = [
                        h for h in hashes if self.index.router_hash_of(self.worker, h) is None
                    ]
                if n := self._evicted.stored(hashes):
                    self.counters.refetched_blocks += n
                    if self.refetched is not None:
                        self.refetched.add(n)
            elif isinstance(event, AllBlocksCleared):
                self._evicted.clear()  # a reset, not churn: what follows is cold

    def apply_batch(self, batch: EventBatch) -> ApplyResult:
        """Apply a decoded batch (also used by `kvroute events replay` on captures)."""
        stored_seen = False
        for event in batch.events:
            name = type(event).__name__
            self.counters.events[name] = self.counters.events.get(name, 0) + 1
            if type(event) is BlockStored:
                stored_seen = True
                self._check_block_size(event.block_size)
        self._count_refetched(batch)
        res = self.index.apply(self.worker, batch)
        c = self.counters
        c.skipped_events += batch.skipped
        c.blocks_stored += res.stored
        if self.demand is not None and res.stored:
            self.demand.add(res.stored)
        c.blocks_removed += res.removed
        c.unknown_parent += res.unknown_parent
        c.unknown_removed += res.unknown_removed
        c.rereported_blocks += res.rereported
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
        """The worker's block size is the largest its stores carry. vLLM also stores a
        prompt's tail inside a cache block, as one smaller block (`cache_partial_block`:
        hybrid models whose KV groups' block sizes differ, `--prefix-match-unit`, the CPU
        offloading connector's partial tails); learned from those, every request to the
        worker was hashed in the tail's size, and matched nothing, until its next full
        store. Within one engine process the size does not change (a restart forgets it)."""
        learned = self.learned_block_size
        if learned is None or published > learned:
            if learned is not None:
                self._burst.warn(
                    "bs", f"worker {self.worker}: events switched block_size to {published}"
                )
            self.learned_block_size = learned = published
        configured = self.configured_block_size
        if configured is not None and configured != learned:
            err = BlockSizeMismatch(self.worker, configured, learned)
            self.health.set_error("block_size", str(err))
        else:
            self.health.set_error("block_size", None)
