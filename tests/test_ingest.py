"""Sequence handling, replay decisions, malformed input and block-size checks."""

from __future__ import annotations

import pytest

from engines.vllm import events as wire
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.health import EventHealth
from indexer.index import PrefixIndex
from indexer.ingest import ReplayRequest, WorkerIngest

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


def test_sequence_going_back_means_restart(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    for seq in range(3):
        ingest.on_live(seq, block(seq + 1))
    assert ingest.on_live(0, block(9)) is None
    assert ingest.counters.restarts == 1
    assert not holds(index, 1) and holds(index, 9)


def test_restart_after_reconnect(setup: tuple[PrefixIndex, WorkerIngest, FakeClock]) -> None:
    index, ingest, _ = setup
    for seq in range(3):
        ingest.on_live(seq, block(seq + 1))
    ingest.reconnected()
    assert ingest.on_live(1, block(8)) == ReplayRequest("w", 0)
    assert ingest.counters.restarts == 1
    ingest.finish_replay([(0, block(7)), (1, block(8))])
    assert holds(index, 7) and holds(index, 8) and not holds(index, 1)


def test_malformed_payload_is_counted_and_dropped(
    setup: tuple[PrefixIndex, WorkerIngest, FakeClock],
) -> None:
    index, ingest, _ = setup
    ingest.on_live(0, block(1))
    assert ingest.on_live(1, b"\x00garbage") is None
    assert ingest.counters.malformed == 1
    assert holds(index, 1)
    assert ingest.on_live(2, block(2)) is None  # no gap: the bad batch consumed its seq
    assert ingest.counters.gaps == 0


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
