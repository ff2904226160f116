"""Recent demand on a worker's cache, from its KV events: a decayed count of stored blocks."""

from __future__ import annotations

import pytest
from test_ingest import block

from engines.vllm import events as wire
from indexer.clock import FakeClock
from indexer.demand import DecayingCount
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest


def test_a_count_halves_every_half_life() -> None:
    clock = FakeClock()
    d = DecayingCount(clock, half_life_s=10.0)
    d.add(80)
    assert d.value() == 80
    clock.advance(10)
    assert d.value() == pytest.approx(40)
    d.add(10)
    clock.advance(20)
    assert d.value() == pytest.approx(12.5)
    d.clear()
    assert d.value() == 0


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        DecayingCount(FakeClock(), half_life_s=0)


def test_ingest_counts_the_blocks_it_stores_not_the_ones_it_drops() -> None:
    clock = FakeClock()
    index = PrefixIndex()
    index.add_worker("w")
    demand = DecayingCount(clock)
    ingest = WorkerIngest("w", index, wire.decode_batch, clock, demand=demand)
    ingest.on_live(0, block(1))
    ingest.on_live(1, block(2))
    assert demand.value() == 2
    ingest.on_live(1, block(2))  # a duplicate sequence number: not applied again
    assert demand.value() == 2
