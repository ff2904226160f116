"""Sequence handling, replay decisions, malformed input and block-size checks."""

from __future__ import annotations

import logging

import pytest

from engines.vllm import events as wire
from engines.vllm.fuzz import hostile_payloads
from indexer import events as ev
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.health import EventHealth
from indexer.index import PrefixIndex
from indexer.ingest import Decoder, ReplayRequest, WorkerIngest

BS = 4


def block(i: int, parent: int | None = None, bs: int = BS) -> bytes:
    """A batch storing one block whose tokens are all `i` (engine hash i)."""
    event = wire.BlockStored(
        block_hashes=[i],
        parent_block_hash=parent,
        token_ids=[i] * bs,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return wire.encode_batch(0.0, [event])


def holds(index: PrefixIndex, i: int) -> bool:
    hashes = hash_request([i] * BS, BS, Namespace())
    return "w" in index.find_matches(hashes)


@pytest.fixture
def setup() -> tuple[PrefixIndex, WorkerIngest, FakeClock]:
    clock = FakeClock()
    index = PrefixIndex()
    index.add_worker("w")
    return index, WorkerIngest("w", index, wire.decode_batch, clock), clock


def test_in_order_batches_apply(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    for seq in range(3):
        assert ingest.on_live(seq, block(seq + 1)) is None
    assert all(holds(index, i) for i in (1, 2, 3))
    assert ingest.counters.batches == 3 and ingest.counters.gaps == 0


def test_first_batch_after_connect_may_follow_a_gap(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    request = ingest.on_live(5, block(6))
    assert request == ReplayRequest("w", 0)
    assert not holds(index, 6)  # held until the replay answers
    ingest.finish_replay([(s, block(s + 1)) for s in range(6)])
    assert all(holds(index, i) for i in range(1, 7))
    assert ingest.counters.duplicates == 1  # the held live batch was in the replay too
    assert ingest.counters.resyncs == 0
    # the first connection's catch-up is not a lost-events gap
    assert (ingest.counters.gaps, ingest.counters.catchups) == (0, 1)


def test_first_stream_starts_where_the_replay_buffer_does(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    assert ingest.on_live(9, block(10)) == ReplayRequest("w", 0)
    ingest.finish_replay([(s, block(s + 1)) for s in range(7, 10)])  # 0..6 aged out
    assert all(holds(index, i) for i in (8, 9, 10))
    c = ingest.counters
    assert (c.gaps, c.resyncs, c.catchups) == (0, 0, 1)
    assert ingest.health.report().state is not EventHealth.RESYNCING


def test_gap_filled_by_replay(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    request = ingest.on_live(3, block(4))
    assert request == ReplayRequest("w", 1)
    ingest.finish_replay([(1, block(2)), (2, block(3)), (3, block(4))])
    assert all(holds(index, i) for i in (1, 2, 3, 4))
    # live copies of replayed batches are duplicates, not a restart
    assert ingest.on_live(4, block(5)) is None
    assert ingest.counters.restarts == 0


def test_gap_older_than_buffer_resyncs(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    ingest.on_live(5, block(6))
    ingest.finish_replay([(3, block(4)), (4, block(5)), (5, block(6))])
    assert not holds(index, 1)  # cleared: removals may have been missed
    assert holds(index, 4) and holds(index, 6)
    assert ingest.counters.resyncs == 1
    assert ingest.health.report().state is EventHealth.RESYNCING


def test_replay_failure_resyncs(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    ingest.on_live(2, block(3))
    ingest.finish_replay(None)
    assert not holds(index, 1) and holds(index, 3)
    assert ingest.counters.replay_failures == 1 and ingest.counters.resyncs == 1


def test_without_replay_endpoint_a_gap_resyncs_at_once(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    ingest.has_replay = False
    ingest.on_live(0, block(1))
    assert ingest.on_live(2, block(3)) is None
    assert not holds(index, 1) and holds(index, 3)


def test_a_seq_seen_twice_is_dropped_not_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    """Defect 2: a repeated sequence number used to wipe the worker's index."""
    index, ingest, _ = setup
    for seq in range(3):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(2, block(7)) is None  # the last one again
    assert ingest.on_live(1, block(8)) is None  # an older one: out of order
    assert ingest.on_live(3, block(4)) is None
    assert all(holds(index, i) for i in (1, 2, 3, 4))
    assert not holds(index, 7) and not holds(index, 8)
    c = ingest.counters
    assert (c.restarts, c.out_of_order, c.gaps, c.resyncs) == (0, 2, 0, 0)


def test_seq_zero_again_then_the_old_stream_goes_on_is_not_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    for seq in range(10):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(0, block(50)) is None  # held: maybe a restart
    assert holds(index, 10)  # nothing cleared while it is only held
    assert ingest.on_live(10, block(11)) is None  # the old stream goes on
    assert all(holds(index, i) for i in range(1, 12)) and not holds(index, 50)
    assert (ingest.counters.restarts, ingest.counters.out_of_order) == (0, 1)


def test_back_to_the_start_and_staying_there_is_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    for seq in range(3):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(0, block(9)) is None
    assert ingest.counters.restarts == 0
    assert ingest.on_live(1, block(10)) is None  # carries on from 0: a new process
    assert ingest.counters.restarts == 1
    assert not holds(index, 1) and holds(index, 9) and holds(index, 10)


def test_a_restart_seen_late_catches_up_from_zero(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    for seq in range(10):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(3, block(23)) is None  # the new process's first batches were lost
    assert ingest.on_live(4, block(24)) == ReplayRequest("w", 0)
    ingest.finish_replay([(s, block(20 + s)) for s in range(5)])
    assert all(holds(index, 20 + s) for s in range(5)) and not holds(index, 1)
    c = ingest.counters
    assert (c.restarts, c.catchups, c.gaps, c.out_of_order) == (1, 1, 0, 0)


def test_restart_after_reconnect(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    for seq in range(3):
        ingest.on_live(seq, block(seq + 1))
    ingest.reconnected()
    assert ingest.on_live(1, block(8)) == ReplayRequest("w", 0)
    assert ingest.counters.restarts == 1
    ingest.finish_replay([(0, block(7)), (1, block(8))])
    assert holds(index, 7) and holds(index, 8) and not holds(index, 1)


def test_a_connect_fetches_the_replay_buffer_and_live_copies_are_not_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    """A router started beside a warm engine: the connection fetches the buffer at once
    (an engine serving only cached prompts publishes nothing live to reveal a gap), and
    live batches queued meanwhile, numbered within it, are copies of what it applied."""
    index, ingest, _ = setup
    ingest.has_replay = True
    ingest.reconnected()
    assert ingest.on_connected() == ReplayRequest("w", 0)
    ingest.finish_connect_replay([(s, block(s + 1)) for s in range(3, 6)])  # buffer from 3
    assert all(holds(index, i) for i in (4, 5, 6))
    for seq in (4, 5):  # published as the subscription took hold: copies
        assert ingest.on_live(seq, block(seq + 1)) is None
    assert ingest.on_live(6, block(7)) is None and holds(index, 7)
    c = ingest.counters
    assert (c.restarts, c.duplicates, c.gaps, c.resyncs) == (0, 2, 0, 0)
    # the engine restarts: the next connection's replay finds nothing past 6, and its
    # first live batch, numbered from 0 again, is the new process's
    ingest.reconnected()
    assert ingest.on_connected() == ReplayRequest("w", 7)
    ingest.finish_connect_replay([])
    ingest.on_live(0, block(30))
    assert ingest.counters.restarts == 1 and holds(index, 30) and not holds(index, 4)


def test_a_restart_behind_a_relay_after_a_connect_replay_is_still_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    """A relay keeps the subscriber's connection while the engine behind it restarts: the
    new process's batches from 0 are no copies of what the connect replay applied."""
    index, ingest, _ = setup
    ingest.has_replay = True
    ingest.reconnected()
    assert ingest.on_connected() == ReplayRequest("w", 0)
    ingest.finish_connect_replay([(s, block(s + 1)) for s in range(8)])
    for seq in range(3):  # the new process, no reconnect seen
        ingest.on_live(seq, block(50 + seq))
    assert ingest.counters.restarts == 1
    assert not holds(index, 1) and all(holds(index, 50 + s) for s in range(3))


def test_a_connect_without_a_replay_endpoint_or_with_one_failing_fetches_nothing(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    _, ingest, _ = setup
    ingest.has_replay = False
    assert ingest.on_connected() is None
    ingest.has_replay = True
    assert ingest.on_connected() == ReplayRequest("w", 0)
    ingest.finish_connect_replay(None)
    assert ingest.counters.replay_failures == 1
    assert ingest.on_live(2, block(3)) == ReplayRequest("w", 0)  # the first live one asks


def test_a_reconnect_during_a_replay_is_not_a_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    """A network blip during a replay: the live copies of what the replay applied were
    queued before the reconnect and arrive after it, numbered below the expected one."""
    index, ingest, _ = setup
    for seq in range(20):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(21, block(22)) == ReplayRequest("w", 20)
    ingest.reconnected()
    ingest.finish_replay([(s, block(s + 1)) for s in range(20, 25)])
    for seq in range(22, 25):
        assert ingest.on_live(seq, block(seq + 1)) is None
    assert ingest.counters.restarts == 0
    assert all(holds(index, i) for i in range(1, 26))
    # a new process still numbers at or below the last live batch: a restart
    ingest.reconnected()
    ingest.on_live(3, block(40))
    assert ingest.counters.restarts == 1


def test_malformed_payload_is_counted_and_dropped(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    assert ingest.on_live(1, b"\x00garbage") is None
    assert ingest.counters.malformed == 1
    assert ingest.counters.malformed_by_reason == {"decode": 1}
    assert holds(index, 1) and ingest.counters.resyncs == 0
    assert ingest.on_live(2, block(2)) is None  # no gap: the bad batch consumed its seq
    assert ingest.counters.gaps == 0 and holds(index, 2)


def test_block_size_mismatch_names_both_values(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    _, ingest, _ = setup
    ingest.configured_block_size = 16
    ingest.on_live(0, block(1))
    report = ingest.health.report()
    assert not report.healthy
    assert "block_size=16" in report.errors[0] and "block_size=4" in report.errors[0]
    assert ingest.block_size == 4  # requests are hashed the way the worker publishes


def test_a_tail_stored_inside_a_block_does_not_change_the_block_size(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    """vLLM stores a prompt's tail inside a cache block as one smaller block, chained from
    the last full one (`BlockPool.cache_partial_block`, on hybrid models and with
    `--prefix-match-unit`). Requests to the worker are still hashed in its full blocks, and
    its configured size still agrees with its events."""
    _, ingest, _ = setup
    ingest.configured_block_size = BS
    full = wire.BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=list(range(2 * BS)),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    tail = wire.BlockStored(
        block_hashes=[3],
        parent_block_hash=2,
        token_ids=list(range(2 * BS, 2 * BS + BS // 2)),
        block_size=BS // 2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    ingest.on_live(0, wire.encode_batch(0.0, [full, tail]))
    ingest.on_live(1, wire.encode_batch(0.0, [tail]))  # a tail alone in a batch, too
    assert ingest.block_size == BS
    assert not ingest.health.report().errors
    ingest.configured_block_size = 2 * BS  # a size the worker's events do not carry
    ingest.on_live(2, block(9))
    assert any("block_size=8" in e for e in ingest.health.report().errors)


HOSTILE = hostile_payloads()


@pytest.mark.parametrize(
    ("payload", "reason"), [(p, r) for _, p, r in HOSTILE], ids=[n for n, _, _ in HOSTILE]
)
def test_a_malformed_batch_is_contained(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock], payload: bytes, reason: str
) -> None:
    """Defect 1: an event whose type is a list or a dict, 50,000-deep arrays or extra_keys
    shorter than the block list used to raise out of the ingest and end the subscriber."""
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    assert ingest.on_live(1, payload) is None
    assert ingest.on_live(2, block(2)) is None
    assert holds(index, 1) and holds(index, 2)
    c = ingest.counters
    assert (c.malformed, c.malformed_by_reason) == (1, {reason: 1})
    assert (c.gaps, c.resyncs, c.restarts) == (0, 0, 0)


def test_malformed_batches_are_logged_once_per_burst(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock], caplog: pytest.LogCaptureFixture
) -> None:
    _, ingest, clock = setup
    bad = dict((n, p) for n, p, _ in HOSTILE)["type-is-a-list"]
    with caplog.at_level(logging.WARNING, logger="kvroute.ingest"):
        for seq in range(50):
            ingest.on_live(seq, bad)
        assert len(caplog.records) == 1
        assert "worker w" in caplog.text and "(bad_type)" in caplog.text
        clock.advance(31)
        ingest.on_live(50, bad)
    assert len(caplog.records) == 2
    assert "49 more like it" in caplog.records[1].getMessage()
    assert ingest.counters.malformed_by_reason == {"bad_type": 51}


def ingest_with(decode: Decoder) -> tuple[PrefixIndex, WorkerIngest]:
    index = PrefixIndex()
    index.add_worker("w")
    return index, WorkerIngest("w", index, decode, FakeClock())


def test_a_batch_the_index_refuses_clears_the_worker_and_the_stream_goes_on() -> None:
    def decode(payload: bytes) -> ev.EventBatch:
        if payload == b"poison":  # decoders should refuse this; the index raises on it
            return ev.EventBatch(0.0, [ev.BlockStored([1], None, [-5] * BS, BS)])
        return wire.decode_batch(payload)

    index, ingest = ingest_with(decode)
    ingest.on_live(0, block(1))
    assert ingest.on_live(1, b"poison") is None
    assert not holds(index, 1)  # maybe half applied: start over
    assert ingest.on_live(2, block(2)) is None and holds(index, 2)
    c = ingest.counters
    assert (c.malformed_by_reason, c.resyncs) == ({"apply": 1}, 1)
    assert ingest.health.report().state is EventHealth.RESYNCING


def test_a_decoder_bug_is_contained() -> None:
    def decode(payload: bytes) -> ev.EventBatch:
        if payload == b"bug":
            raise KeyError("oops")
        return wire.decode_batch(payload)

    index, ingest = ingest_with(decode)
    assert ingest.on_live(0, b"bug") is None
    assert ingest.on_live(1, block(1)) is None and holds(index, 1)
    assert ingest.counters.malformed_by_reason == {"decode": 1}


def stored_chain(hashes: list[int], bs: int = BS) -> wire.BlockStored:
    """A root chain of blocks whose tokens are all their hash (as `block` makes them)."""
    return wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[t for h in hashes for t in [h] * bs],
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def removed(*hashes: int) -> bytes:
    return wire.encode_batch(0.0, [wire.BlockRemoved(block_hashes=list(hashes), medium="GPU")])


def test_blocks_stored_again_after_their_eviction_count_as_refetched() -> None:
    """A cache that evicts blocks it is later asked for again (a conversation's context)
    churns; one that evicts blocks nobody asks for again (a query's own tail) does not."""
    from indexer.demand import DecayingCount

    clock = FakeClock()
    index = PrefixIndex()
    index.add_worker("w")
    refetched = DecayingCount(clock)
    ingest = WorkerIngest("w", index, wire.decode_batch, clock, refetched=refetched)
    frames = [block(1), block(2), removed(1, 2), block(3), block(1), block(1)]
    for seq, frame in enumerate(frames):
        assert ingest.on_live(seq, frame) is None
    assert refetched.value() == 1.0  # block 1 once (its second store was no refetch); 3 never left
    assert ingest.counters.refetched_blocks == 1  # kvroute_kv_refetched_blocks
    clock.advance(60.0)
    assert refetched.value() == pytest.approx(0.5)  # decays like demand
    # one of block 5's two copies evicted, then its prefix re-reported from the root
    # (kv_cache_report_mode full): still held, nothing was prefilled again
    frames = [block(4), block(5, parent=4), block(5, parent=4), removed(5)]
    frames += [wire.encode_batch(0.0, [stored_chain([4, 5])])]
    for seq, frame in enumerate(frames, start=6):
        assert ingest.on_live(seq, frame) is None
    assert ingest.counters.refetched_blocks == 1 and index.router_hash_of("w", 5) is not None


def test_live_copies_of_a_young_engines_connect_replay_are_no_restart() -> None:
    """Router and engine start together: the connect replay holds the engine's whole short
    stream (0..7), and the live batches published meanwhile (2..7) arrive after it. They
    are copies, byte for byte, not a new engine numbering from the start."""
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, wire.decode_batch, FakeClock(), has_replay=True)
    stream = [block(s + 1) for s in range(8)]
    ingest.resubscribed()
    request = ingest.on_connected()
    assert request is not None and request.start_seq == 0
    ingest.finish_connect_replay(list(enumerate(stream)))
    for seq in range(2, 8):
        assert ingest.on_live(seq, stream[seq]) is None
    assert ingest.on_live(8, block(9)) is None
    c = ingest.counters
    assert (c.restarts, c.duplicates, c.resyncs) == (0, 6, 0)
    assert all(holds(index, i) for i in range(1, 10))


def test_a_new_engine_behind_the_same_numbers_is_still_a_restart() -> None:
    """The same numbers with other bytes, on a fresh connection: a new engine process."""
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, wire.decode_batch, FakeClock(), has_replay=True)
    ingest.resubscribed()
    ingest.on_connected()
    ingest.finish_connect_replay([(s, block(s + 1)) for s in range(8)])
    ingest.on_live(2, block(50))
    assert ingest.counters.restarts == 1
