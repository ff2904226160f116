from __future__ import annotations

import pytest

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, hash_request
from indexer.index import Overlap, PrefixIndex, UnknownWorker, available_backends

BS = 4
A = list(range(16))  # four blocks
B = [*A[:8], 90, 91, 92, 93]  # shares two blocks with A

NOT_BUILT = "C index core not built: pip install -e . needs gcc and the Python headers"
BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(b not in available_backends(), reason=NOT_BUILT))
    for b in ("c", "python")
]


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs against every index backend (PrefixIndex() reads the variable)."""
    monkeypatch.setenv("KVROUTE_INDEX_BACKEND", request.param)
    return str(request.param)


def eh(*ids: int) -> list[EngineBlockHash]:
    return [EngineBlockHash(i) for i in ids]


def stored(
    hashes: list[EngineBlockHash], tokens: list[int], parent: int | None = None, tier: str = "GPU"
) -> EventBatch:
    p = None if parent is None else EngineBlockHash(parent)
    return EventBatch(0.0, [BlockStored(hashes, p, tokens, BS, tier)])


def q(tokens: list[int]) -> list[int]:
    return list(hash_request(tokens, BS, Namespace()))


@pytest.fixture
def index() -> PrefixIndex:
    ix = PrefixIndex()
    for w in ("a", "b"):
        ix.add_worker(w)
    return ix


def test_leading_contiguous_per_worker(index: PrefixIndex) -> None:
    index.apply("a", stored(eh(1, 2, 3, 4), A))
    index.apply("b", stored(eh(1, 2), A[:8]))
    index.apply("b", stored(eh(5, 6), [*B[8:], 94, 95, 96, 97], parent=2))
    assert index.find_matches(q(A)) == {"a": Overlap(4, {"GPU": 4}), "b": Overlap(2, {"GPU": 2})}
    assert index.find_matches(q(B)) == {"a": Overlap(2, {"GPU": 2}), "b": Overlap(3, {"GPU": 3})}
    assert index.find_matches(q([7] * 16)) == {}
    assert index.find_matches([]) == {}


def test_removed_middle_block_cuts_the_run(index: PrefixIndex) -> None:
    index.apply("a", stored(eh(1, 2, 3, 4), A))
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(2))]))
    assert index.find_matches(q(A)) == {"a": Overlap(1, {"GPU": 1})}
    index.verify()


def test_tiers_split_and_gpu_wins(index: PrefixIndex) -> None:
    index.apply("a", stored(eh(1, 2), A[:8]))
    index.apply("a", stored(eh(1, 2, 3, 4), A, tier="CPU"))
    assert index.find_matches(q(A)) == {"a": Overlap(4, {"GPU": 2, "CPU": 2})}
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1), "GPU")]))
    assert index.find_matches(q(A)) == {"a": Overlap(4, {"CPU": 3, "GPU": 1})}
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1), "CPU")]))
    assert index.find_matches(q(A)) == {}
    index.verify()


def test_unknown_parent_is_counted_not_guessed(index: PrefixIndex) -> None:
    res = index.apply("a", stored(eh(3, 4), A[8:], parent=99))
    assert res.unknown_parent == 1 and res.stored == 0
    assert index.find_matches(q(A)) == {}


def test_clear_and_remove_worker(index: PrefixIndex) -> None:
    index.apply("a", stored(eh(1, 2, 3, 4), A))
    index.apply("b", stored(eh(1, 2, 3, 4), A))
    res = index.apply("a", EventBatch(0.0, [AllBlocksCleared()]))
    assert res.cleared == 1
    assert set(index.find_matches(q(A))) == {"b"}
    index.remove_worker("b")
    assert index.find_matches(q(A)) == {}
    assert index.stats()["blocks"] == 0
    index.add_worker("c")  # reuses b's bit, which must be clean
    assert index.find_matches(q(A)) == {}


def test_unknown_worker_is_named(index: PrefixIndex) -> None:
    with pytest.raises(UnknownWorker, match="'ghost'"):
        index.apply("ghost", stored(eh(1), A[:4]))


def test_bound_drops_the_storing_workers_oldest_block() -> None:
    index = PrefixIndex(max_entries=4)
    index.add_worker("a")
    index.add_worker("b")
    index.apply("a", stored(eh(1, 2, 3), A[:12]))
    index.apply("b", stored(eh(1), A[:4]))
    res = index.apply("a", stored(eh(4), A[12:], parent=3))
    assert res.evicted_at_bound == 1 and index.evicted_at_bound == 1
    stats = index.stats()
    assert stats["entries"] == 4 and stats["per_worker"] == {"a": 3, "b": 1}
    # a's first block went, so its chain no longer matches from the start
    assert index.find_matches(q(A)) == {"b": Overlap(1, {"GPU": 1})}
    index.verify()


def test_duplicate_store_is_idempotent(index: PrefixIndex) -> None:
    index.apply("a", stored(eh(1, 2), A[:8]))
    index.apply("a", stored(eh(1, 2), A[:8]))
    assert index.stats()["entries"] == 2
    index.verify()


def test_namespaced_chains_match_only_their_namespace(index: PrefixIndex) -> None:
    batch = EventBatch(0.0, [BlockStored(eh(1, 2), None, A[:8], BS, lora_name="ad")])
    index.apply("a", batch)
    assert index.find_matches(q(A)) == {}
    lora = hash_request(A, BS, Namespace(lora_name="ad"))
    assert index.find_matches(lora) == {"a": Overlap(2, {"GPU": 2})}


def test_a_second_cached_copy_survives_one_removal(index: PrefixIndex) -> None:
    """vLLM caches a duplicate block (same hash) as another copy and removes copies one by one."""
    index.apply("a", stored(eh(1, 2), A[:8]))
    index.apply("a", stored(eh(2), A[4:8], parent=1))  # a second copy of block 2
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(2))]))
    assert index.find_matches(q(A)) == {"a": Overlap(2, {"GPU": 2})}
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(2))]))
    assert index.find_matches(q(A)) == {"a": Overlap(1, {"GPU": 1})}
    index.verify()


def test_a_rereported_prefix_is_no_second_copy(index: PrefixIndex) -> None:
    """With `kv_cache_report_mode: full` vLLM publishes BlockStored again, from the root, for
    a prefix it served from cache: no new block. One BlockRemoved per block then evicts it,
    as on the engine. No held block of a GPU root chain counts as a copy, one block or many,
    and a re-report longer than what the index holds (it missed some: a router restarted
    after the engine's replay buffer wrapped) stores the rest new."""
    index.apply("a", stored(eh(1), A[:4]))
    assert index.apply("a", stored(eh(1), A[:4])).rereported == 1
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1))]))
    assert index.find_matches(q(A)) == {}
    index.apply("a", stored(eh(1, 2, 3), A[:12]))
    res = index.apply("a", stored(eh(1, 2, 3), A[:12]))  # the re-report
    assert res.rereported == 3 and res.stored == 0
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(3))]))
    assert index.find_matches(q(A)) == {"a": Overlap(2, {"GPU": 2})}
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1, 2))]))
    assert index.find_matches(q(A)) == {}
    index.apply("a", stored(eh(1, 2), A[:8]))
    res = index.apply("a", stored(eh(1, 2, 3, 4), A))
    assert (res.rereported, res.stored) == (2, 2)
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(1, 2, 3, 4))]))
    assert index.find_matches(q(A)) == {}
    # a copy chained to a parent still counts (vLLM's recomputed last block)
    index.apply("a", stored(eh(1, 2), A[:8]))
    assert index.apply("a", stored(eh(2), A[4:8], parent=1)).rereported == 0
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(2))]))
    assert index.find_matches(q(A)) == {"a": Overlap(2, {"GPU": 2})}
    index.verify()


def test_an_id_stored_for_other_tokens_first_drops_its_block_everywhere(index: PrefixIndex) -> None:
    """Engine id 2 named A's second block (cached twice in GPU, once in CPU); stored again
    for other tokens, the old block goes from every tier, copies and all: nothing is left
    that no BlockRemoved could reach, and one removal of id 2 now drops the new block."""
    other = [*A[:4], 80, 81, 82, 83]
    index.apply("a", stored(eh(1, 2), A[:8]))
    index.apply("a", stored(eh(2), A[4:8], parent=1))  # a second copy
    index.apply("a", stored(eh(2), A[4:8], parent=1, tier="CPU"))
    index.apply("a", stored(eh(2), other[4:], parent=1))
    assert index.find_matches(q(A)) == {"a": Overlap(1, {"GPU": 1})}
    assert index.find_matches(q(other)) == {"a": Overlap(2, {"GPU": 2})}
    assert index.entries_of("a") == 2
    index.verify()
    index.apply("a", EventBatch(0.0, [BlockRemoved(eh(2))]))
    assert index.find_matches(q(other)) == {"a": Overlap(1, {"GPU": 1})}
    assert index.entries_of("a") == 1
    index.verify()
