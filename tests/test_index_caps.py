"""Per-worker caps, the global bound's corner cases, big fleets and wide engine ids, on
every index backend."""

from __future__ import annotations

import pytest

from indexer.events import BlockRemoved, BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, RouterBlockHash, hash_request
from indexer.index import (
    DEFAULT_MAX_ENTRIES,
    Overlap,
    PrefixIndex,
    UnknownWorker,
    available_backends,
)
from router.core.config import Config

BS = 4
A = list(range(16))  # four blocks
NOT_BUILT = "C index core not built: pip install -e . needs gcc and the Python headers"
BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(b not in available_backends(), reason=NOT_BUILT))
    for b in ("c", "python")
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def eh(*ids: int) -> list[EngineBlockHash]:
    return [EngineBlockHash(i) for i in ids]


def stored(
    hashes: list[EngineBlockHash], tokens: list[int], parent: int | None = None
) -> EventBatch:
    p = None if parent is None else EngineBlockHash(parent)
    return EventBatch(0.0, [BlockStored(hashes, p, tokens, BS)])


def q(tokens: list[int]) -> list[RouterBlockHash]:
    return hash_request(tokens, BS, Namespace())


def fleet(backend: str, *names: str, max_entries: int = 1000) -> PrefixIndex:
    ix = PrefixIndex(max_entries, backend=backend)
    for n in names:
        ix.add_worker(n)
    return ix


def test_cap_drops_the_workers_own_oldest_block(backend: str) -> None:
    index = fleet(backend, "a", "b")
    index.set_worker_cap("a", 3)
    index.apply("b", stored(eh(1), A[:4]))
    index.apply("a", stored(eh(1, 2, 3), A[:12]))
    res = index.apply("a", stored(eh(4), A[12:], parent=3))
    assert (res.evicted_at_cap, res.evicted_at_bound) == (1, 0)
    assert index.evicted_at_cap("a") == 1 and index.evicted_at_cap("b") == 0
    assert index.evicted_at_bound == 0
    assert index.stats()["per_worker"] == {"a": 3, "b": 1}
    # a's first block went, so its chain no longer matches from the start; b is untouched
    assert index.find_matches(q(A)) == {"b": Overlap(1, {"GPU": 1})}
    index.verify()


def test_a_new_cap_trims_at_once_and_none_lifts_it(backend: str) -> None:
    index = fleet(backend, "a")
    index.apply("a", stored(eh(1, 2, 3, 4), A))
    index.set_worker_cap("a", 2)
    assert index.entries_of("a") == 2 and index.evicted_at_cap("a") == 2
    index.set_worker_cap("a", None)
    index.apply("a", stored(eh(1, 2), A[:8]))
    assert index.entries_of("a") == 4 and index.evicted_at_cap("a") == 2
    assert index.find_matches(q(A)) == {"a": Overlap(4, {"GPU": 4})}
    index.verify()


def test_cap_and_bound_are_counted_apart(backend: str) -> None:
    index = fleet(backend, "a", "b", max_entries=4)
    index.set_worker_cap("a", 2)
    index.apply("b", stored(eh(1, 2), A[:8]))
    res = index.apply("a", stored(eh(1, 2, 3), A[:12]))  # a's cap trips, not the bound
    assert (res.evicted_at_cap, res.evicted_at_bound) == (1, 0)
    index.apply("a", stored(eh(9), [7] * 4))  # a again at its cap
    index.set_worker_cap("a", None)
    res = index.apply("a", stored(eh(8), [6] * 4))  # now the global bound
    assert (res.evicted_at_cap, res.evicted_at_bound) == (0, 1)
    assert index.evicted_at_cap("a") == 2 and index.evicted_at_bound == 1
    assert index.stats()["entries"] == 4
    index.verify()


def test_cap_is_checked(backend: str) -> None:
    index = fleet(backend, "a")
    with pytest.raises(ValueError, match="positive"):
        index.set_worker_cap("a", 0)
    with pytest.raises(UnknownWorker):
        index.set_worker_cap("ghost", 5)
    assert index.evicted_at_cap("ghost") == 0


def test_bound_takes_from_the_largest_worker_when_the_storer_holds_nothing(backend: str) -> None:
    index = fleet(backend, "a", "b", "c", max_entries=3)
    index.apply("a", stored(eh(1), A[:4]))
    index.apply("b", stored(eh(5, 6), [9] * 8))
    index.apply("c", stored(eh(7), [8] * 4))
    assert index.stats()["per_worker"] == {"a": 1, "b": 1, "c": 1}  # b's oldest went
    index.verify()


def test_eviction_skips_ids_of_blocks_already_gone(backend: str) -> None:
    """Two engine ids for one block (an alias); removing one leaves the other pointing at a
    block the worker no longer holds. Eviction must drop a held block, not the dangling id."""
    index = fleet(backend, "a")
    index.apply("a", stored(eh(1), A[:4]))
    index.apply("a", stored(eh(2), A[:4]))  # same block, second id
    index.apply("a", stored(eh(3, 4), [5] * 8))
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1))]))
    assert index.entries_of("a") == 2
    index.set_worker_cap("a", 1)
    assert index.entries_of("a") == 1 and index.evicted_at_cap("a") == 1
    assert index.holds("a") == {q([5] * 8)[1]}
    index.verify()


def test_more_workers_than_one_mask_word(backend: str) -> None:
    names = [f"w{i}" for i in range(130)]
    index = fleet(backend, *names)
    for i, name in enumerate(names):
        n = i % 4 + 1
        index.apply(name, stored(eh(*range(1, n + 1)), A[: n * BS]))
    found = index.find_matches(q(A))
    assert found == {name: Overlap(i % 4 + 1, {"GPU": i % 4 + 1}) for i, name in enumerate(names)}
    index.remove_worker("w77")
    index.add_worker("new")  # takes w77's place and must start empty
    assert "new" not in index.find_matches(q(A)) and len(index.find_matches(q(A))) == 129
    index.verify()


def test_wide_engine_ids(backend: str) -> None:
    """vLLM's 32-byte digests arrive as ints of up to 256 bits."""
    wide = [EngineBlockHash((1 << 255) + i) for i in range(4)]
    index = fleet(backend, "a")
    index.apply("a", stored(wide[:2], A[:8]))
    index.apply("a", stored(wide[2:], A[8:], parent=wide[1]))
    assert index.find_matches(q(A)) == {"a": Overlap(4, {"GPU": 4})}
    assert index.router_hash_of("a", wide[3]) == q(A)[3]
    index.apply("a", EventBatch(0.0, [BlockRemoved(wide[1:2])]))
    assert index.find_matches(q(A)) == {"a": Overlap(1, {"GPU": 1})}
    index.verify()


def test_default_bound_is_the_routers() -> None:
    assert PrefixIndex().max_entries == DEFAULT_MAX_ENTRIES == Config().max_index_entries


@pytest.mark.skipif("c" not in available_backends(), reason=NOT_BUILT)
def test_compiled_core_stays_under_100_bytes_per_entry() -> None:
    """8 workers x 100 chains x 128 blocks (the bench's memory figure, without its timing);
    the C core counts its own allocations exactly."""
    index = fleet("c", *[f"w{i}" for i in range(8)], max_entries=10**7)
    for w in range(8):
        for chain in range(100):
            base = (w * 100 + chain) * 1000 + 1
            ids = list(range(base, base + 128))
            index.store_hashes(f"w{w}", ids, [i * 0x9E3779B97F4A7C15 % 2**64 for i in ids], None)
    entries = index.stats()["entries"]
    assert entries == 102_400
    assert index.memory_estimate() / entries <= 100
