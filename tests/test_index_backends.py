"""The C and Python index backends, driven with the same random operations, must agree on
every answer: overlaps, entry counts, evictions at the bound and at worker caps, what each
worker holds. The reference-model test (test_index_property.py) pins down the meaning;
this one pins the two implementations to each other where the model stops (the bound, caps,
aliases, wide engine ids, workers coming and going)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, RouterBlockHash, hash_request
from indexer.index import PrefixIndex, available_backends

BS = 2
WORKERS = ("w0", "w1", "w2")
TIERS = ("GPU", "CPU", "DISK")
Key = tuple[tuple[int, ...], ...]

pytestmark = pytest.mark.skipif(
    "c" not in available_backends(),
    reason="C index core not built: pip install -e . needs gcc and the Python headers",
)


def engine_id(key: Key, variant: int) -> EngineBlockHash:
    """Variant 0: a 64-bit id; 1: another id for the same block (an alias); 2: a wide id
    (vLLM's 32-byte digests arrive as ints of up to 256 bits)."""
    h = hash(("engine", variant & 1, key)) & 0xFFFF_FFFF_FFFF_FFFF
    return EngineBlockHash(h | (1 << 255) if variant == 2 else h)


class BackendsAgree(RuleBasedStateMachine):
    @initialize(
        pool=st.lists(
            st.lists(st.tuples(*[st.integers(0, 1)] * BS), min_size=2, max_size=6),
            min_size=2,
            max_size=3,
        ),
        max_entries=st.sampled_from([3, 7, 20, 1000]),
    )
    def setup(self, pool: list[list[tuple[int, ...]]], max_entries: int) -> None:
        self.pool = pool
        self.pair = [PrefixIndex(max_entries, backend=b) for b in ("c", "python")]
        for ix in self.pair:
            for w in WORKERS:
                ix.add_worker(w)

    def both(self, op: str, *args: object) -> None:
        results = [getattr(ix, op)(*args) for ix in self.pair]
        assert results[0] == results[1], (op, args, results)

    def chain(self, seq_i: int) -> list[tuple[int, ...]]:
        return self.pool[seq_i % len(self.pool)]

    @rule(
        w=st.sampled_from(WORKERS),
        seq_i=st.integers(0, 2),
        start=st.integers(0, 5),
        n=st.integers(1, 6),
        tier=st.sampled_from(TIERS),
        variant=st.integers(0, 2),
    )
    def store(self, w: str, seq_i: int, start: int, n: int, tier: str, variant: int) -> None:
        seq = self.chain(seq_i)
        start %= len(seq)
        blocks = seq[start : start + n]
        keys = [tuple(seq[: i + 1]) for i in range(start, start + len(blocks))]
        parent = engine_id(tuple(seq[:start]), variant) if start else None
        event = BlockStored(
            engine_hashes=[engine_id(k, variant) for k in keys],
            parent=parent,
            token_ids=[t for b in blocks for t in b],
            block_size=BS,
            tier=tier,
        )
        self.both("apply", w, EventBatch(0.0, [event]))

    @rule(
        w=st.sampled_from(WORKERS),
        ids_i=st.integers(0, 2),
        seq_i=st.integers(0, 2),
        start=st.integers(0, 5),
        n=st.integers(1, 6),
        tier=st.sampled_from(TIERS),
        variant=st.integers(0, 2),
        order=st.sampled_from(["as is", "reversed", "first"]),
    )
    def store_reused_ids(
        self,
        w: str,
        ids_i: int,
        seq_i: int,
        start: int,
        n: int,
        tier: str,
        variant: int,
        order: str,
    ) -> None:
        """Another chain's engine ids (reversed, or its first id for every block) stored for
        this chain's tokens: what each reused id named must go first."""
        seq, other = self.chain(seq_i), self.chain(ids_i)
        start %= len(seq)
        blocks = seq[start : start + n]
        ids = [engine_id(tuple(other[: i + 1]), variant) for i in range(len(other))]
        if order == "reversed":
            ids.reverse()
        elif order == "first":
            ids = ids[:1] * len(ids)
        ids = (ids * 6)[start : start + len(blocks)]  # one per block, wrapping round
        parent = engine_id(tuple(seq[:start]), variant) if start else None
        event = BlockStored(ids, parent, [t for b in blocks for t in b], BS, tier=tier)
        self.both("apply", w, EventBatch(0.0, [event]))

    @rule(
        w=st.sampled_from(WORKERS),
        seq_i=st.integers(0, 2),
        picks=st.lists(st.integers(0, 5), min_size=1, max_size=3),
        tier=st.sampled_from(TIERS),
        variant=st.integers(0, 2),
    )
    def remove(self, w: str, seq_i: int, picks: list[int], tier: str, variant: int) -> None:
        seq = self.chain(seq_i)
        ids = [engine_id(tuple(seq[: p % len(seq) + 1]), variant) for p in picks]
        self.both("apply", w, EventBatch(0.0, [BlockRemoved(ids, tier)]))

    @rule(w=st.sampled_from(WORKERS))
    def clear(self, w: str) -> None:
        self.both("apply", w, EventBatch(0.0, [AllBlocksCleared()]))

    @rule(w=st.sampled_from(WORKERS), cap=st.sampled_from([None, 1, 2, 4, 9]))
    def cap(self, w: str, cap: int | None) -> None:
        self.both("set_worker_cap", w, cap)

    @rule(w=st.sampled_from(WORKERS))
    def replace_worker(self, w: str) -> None:
        self.both("remove_worker", w)
        self.both("add_worker", w)

    def hashes(self, seq_i: int) -> list[RouterBlockHash]:
        tokens = [t for b in self.chain(seq_i) for t in b]
        return hash_request(tokens, BS, Namespace())

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "pair"):
            return
        for seq_i in range(len(self.pool)):
            hashes = self.hashes(seq_i)
            for cut in (1, len(hashes)):
                self.both("find_matches", hashes[:cut])
        for w in WORKERS:
            self.both("holds", w)
            self.both("evicted_at_cap", w)
        stats = [ix.stats() for ix in self.pair]
        for s in stats:
            del s["backend"], s["memory_bytes_estimate"]
        assert stats[0] == stats[1]
        for ix in self.pair:
            ix.verify()
            assert ix.stats()["entries"] <= ix.max_entries  # type: ignore[operator]


BackendsAgree.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBackendsAgree = BackendsAgree.TestCase
