"""The simulator's block pool: vLLM's hashes, and its cache behaviour against a plain list
model (reuse, LRU eviction order with tail-first freeing, capacity)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.sim.blockpool import NO_KEYS, BlockPool, CacheKeys, EngineHash, Hasher
from engines.sim.kvcache import KVCacheManager, cdiv
from engines.sim.request import Sampling, SimRequest
from engines.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored

# Real vLLM 0.32.0 (block size 32, sha256, uint64 on the wire): the first two blocks of a
# completion prompt and the block hashes it published for them.
REAL_TOKENS = [
    *[0, 61, 313, 1234, 303, 1611, 1625, 18, 434, 509, 396, 363, 488, 429, 499, 396],
    *[472, 495, 451, 457, 378, 469, 414, 499, 419, 457, 468, 521, 396, 406, 295, 376],
    *[472, 446, 397, 475, 508, 414, 526, 419, 419, 419, 451, 498, 295, 457, 386, 469],
    *[468, 397, 419, 371, 475, 396, 472, 499, 465, 475, 505, 475, 386, 475, 396, 444],
]
REAL_HASHES = [1538499950733491916, 20068913177127549]
# A first block requested with cache_salt "tenant-A", and its published hash.
REAL_SALTED_TOKENS = [0, 61, 313, 1234, 303, 1611, 1625, 18, *[438] * 24]
REAL_SALTED = 8230154728710594860


def wire_int(h: EngineHash) -> int:
    return int.from_bytes(h[-8:], "big")


def test_hashes_match_real_vllm() -> None:
    hashes = Hasher(32).hashes(REAL_TOKENS)
    assert [wire_int(h) for h in hashes] == REAL_HASHES


def test_cache_salt_is_hashed_into_block_0_like_real_vllm() -> None:
    (salted,) = Hasher(32).hashes(REAL_SALTED_TOKENS, CacheKeys(cache_salt="tenant-A"))
    assert wire_int(salted) == REAL_SALTED
    assert Hasher(32).hashes(REAL_SALTED_TOKENS) != [salted]


def test_lora_keys_every_block_and_events_carry_untagged_keys() -> None:
    keys = CacheKeys(lora_name="ad", lora_path="/p", lora_id=3, cache_salt="s")
    assert keys.block_extra_keys(0) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert keys.block_extra_keys(16) == (("lora", "ad", "/p"),)
    pool, kv = make(8, bs=4)
    req = request(list(range(9)), keys)
    assert kv.allocate_slots(req, 9)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == [["ad", "s"], ["ad"]]
    assert (stored.lora_id, stored.lora_name) == (3, "ad")


def make(num_blocks: int, bs: int = 4, caching: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, bs, enable_caching=caching)
    return pool, KVCacheManager(pool, Hasher(bs))


def request(tokens: list[int], keys: CacheKeys = NO_KEYS) -> SimRequest:
    return SimRequest("r", tokens, Sampling(max_tokens=1), keys)


def test_stored_event_shape_like_real_frames() -> None:
    pool, kv = make(8)
    req = request(list(range(10)))
    assert kv.allocate_slots(req, 10)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(8)) and event.block_size == 4
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
    assert event.extra_keys == [None, None]
    assert all(isinstance(h, int) for h in event.block_hashes)


def test_a_hit_chains_new_blocks_to_the_last_cached_one() -> None:
    pool, kv = make(16)
    first = request([*list(range(8)), 99])
    kv.allocate_slots(first, 9)
    kv.free(first)
    pool.take_events()
    second = request([*list(range(12)), 7])
    hit = kv.computed_blocks(second)
    assert len(hit) == 2
    kv.allocate_slots(second, 5, hit)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == wire_int(kv.hashes(first)[1])
    assert event.token_ids == [8, 9, 10, 11]


def test_the_last_token_is_never_a_hit() -> None:
    _pool, kv = make(16)
    req = request(list(range(8)))
    kv.allocate_slots(req, 8)
    kv.free(req)
    assert len(kv.computed_blocks(request(list(range(8))))) == 1
    assert len(kv.computed_blocks(request(list(range(9))))) == 2
    assert kv.peek(list(range(8)), CacheKeys()) == 2


def test_free_is_tail_first_and_eviction_takes_the_lru_head() -> None:
    pool, kv = make(5)  # 4 usable
    req = request(list(range(16)))
    kv.allocate_slots(req, 16)
    kv.free(req)
    hashes = [wire_int(h) for h in kv.hashes(req)]
    pool.take_events()
    other = request([100 + i for i in range(8)])
    kv.allocate_slots(other, 8)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [hashes[3], hashes[2]]  # the tail went first
    assert kv.peek(list(range(16)), CacheKeys()) == 2


def test_a_block_aligned_repeat_makes_a_twin_block_as_vllm_does() -> None:
    """vLLM never hits a prompt's last token, so a repeat of a block-aligned prompt recomputes
    its last block into a second block with the same hash (no de-duplication: NOTE #1 in
    vLLM's block_pool.py). Both are stored, each eviction is published, and the hash stays
    cached until the last twin goes: a router must count stores per engine hash."""
    pool, kv = make(4, bs=4)  # 3 usable
    tokens = list(range(8))
    first = request(tokens)
    kv.allocate_slots(first, 8)
    kv.free(first)
    second = request(tokens)
    hit = kv.computed_blocks(second)
    assert len(hit) == 1
    kv.allocate_slots(second, 4, hit)
    kv.free(second)
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    h1, h2 = stored[0].block_hashes
    assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [([h1, h2], None), ([h2], h1)]
    pool.allocate(1)  # evicts the older twin, which sits at the head of the LRU queue
    assert pool.take_events() == [BlockRemoved([h2], "GPU", group_idx=0)]
    assert kv.peek(tokens, CacheKeys()) == 2  # still cached through the other twin


def test_no_caching_publishes_nothing_and_never_hits() -> None:
    pool, kv = make(8, caching=False)
    req = request(list(range(9)))
    kv.allocate_slots(req, 9)
    kv.free(req)
    assert pool.take_events() == []
    assert kv.computed_blocks(request(list(range(9)))) == []


def test_reset_refused_while_held_then_clears() -> None:
    pool, kv = make(8)
    req = request(list(range(9)))
    kv.allocate_slots(req, 9)
    assert not pool.reset()
    kv.free(req)
    pool.take_events()
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert kv.peek(list(range(9)), CacheKeys()) == 0


def test_null_block_is_never_handed_out() -> None:
    pool, _ = make(3)
    assert pool.num_free == 2
    assert 0 not in {b.block_id for b in pool.allocate(2)}
    with pytest.raises(ValueError):
        pool.allocate(1)


# ---- against a plain model -------------------------------------------------------------------


class Reference:
    """The free queue as a list of slots (None = empty block, else the hash it caches)."""

    def __init__(self, usable: int) -> None:
        self.free: list[EngineHash | None] = [None] * usable
        self.held: dict[int, list[EngineHash | None]] = {}
        self.refs: Counter[EngineHash] = Counter()
        self.evicted: list[EngineHash] = []

    def cached(self) -> set[EngineHash]:
        return {h for h in self.free if h is not None} | {h for h, n in self.refs.items() if n}

    def admit(self, rid: int, hashes: list[EngineHash], n_tokens: int) -> int | None:
        cached = self.cached()
        hit = 0
        while hit < min(len(hashes), (n_tokens - 1) // BS) and hashes[hit] in cached:
            hit += 1
        revived = [h for h in hashes[:hit] if h in self.free]
        need = cdiv(n_tokens, BS) - hit
        if need + len(revived) > len(self.free):
            return None
        for h in revived:
            self.free.remove(h)
        for _ in range(need):
            slot = self.free.pop(0)
            if slot is not None:
                self.evicted.append(slot)
        entries: list[EngineHash | None] = [
            hashes[i] if i < len(hashes) else None for i in range(cdiv(n_tokens, BS))
        ]
        self.refs.update(h for h in entries if h is not None)
        self.held[rid] = entries
        return hit

    def finish(self, rid: int) -> None:
        to_front: list[EngineHash | None] = []
        for entry in reversed(self.held.pop(rid)):
            if entry is None:
                to_front.append(None)
                continue
            self.refs[entry] -= 1
            if not self.refs[entry]:
                self.free.append(entry)
        self.free[:0] = to_front


BS = 4
PREFIXES = [[7] * 8, [7] * 4 + [8] * 4, [9] * 12]
op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 14), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 3), st.just(0), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(usable=st.integers(2, 12), ops=st.lists(op, max_size=40))
def test_pool_matches_the_reference(usable: int, ops: list[tuple[str, int, int, int]]) -> None:
    pool, kv = make(usable + 1)
    ref = Reference(usable)
    held: list[tuple[int, SimRequest]] = []
    for n, (kind, a, length, salt) in enumerate(ops):
        if kind == "admit":
            length += length % BS == 0  # block-aligned repeats make twins (tested above)
            tokens = (PREFIXES[a] + [n % 5] * 16)[:length]
            req = request(tokens, CacheKeys(cache_salt=f"s{salt}" if salt else None))
            hit = kv.computed_blocks(req)
            expected = ref.admit(n, kv.hashes(req), len(tokens))
            ok = kv.allocate_slots(
                req, len(tokens) - len(hit) * BS, hit, full_sequence_must_fit=True
            )
            assert ok == (expected is not None)
            if ok:
                assert len(hit) == expected
                held.append((n, req))
        elif kind == "finish" and held:
            rid, req = held.pop(a % len(held))
            kv.free(req)
            ref.finish(rid)
        elif kind == "reset" and pool.reset():
            ref.free = [None] * usable
        removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
        assert removed == [wire_int(h) for h in ref.evicted]
        ref.evicted.clear()
        assert pool.cached_hashes() == ref.cached()
        assert [b.block_hash for b in pool.free_order()] == ref.free
        assert pool.num_free + sum(len(r.blocks) for _, r in held) - _shared(held) == usable


def _shared(held: list[tuple[int, SimRequest]]) -> int:
    """Blocks counted more than once because several held requests share them."""
    ids = Counter(b.block_id for _, r in held for b in r.blocks)
    return sum(n - 1 for n in ids.values())
