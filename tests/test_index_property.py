"""The index, fed through the real vLLM wire format and the ingest layer, against a plain
reference model that knows nothing of hashes: a worker holds token prefixes."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engines.vllm import events as wire
from indexer.clock import FakeClock
from indexer.events import DEFAULT_TIER
from indexer.hashing import Namespace, hash_request
from indexer.index import Overlap, PrefixIndex, available_backends, tier_rank
from indexer.ingest import WorkerIngest

BS = 4
WORKERS = ("w0", "w1", "w2")
TIERS = ("GPU", "CPU")
MODEL = "m"
NAMESPACES = ((None, None), ("lora-a", None), (None, "tenant-1"))

Key = tuple[object, ...]


def engine_hash(key: Key) -> int:
    """Stands in for the engine's own hash: any injective-enough id, unrelated to ours."""
    return hash(("engine", key)) & 0xFFFF_FFFF_FFFF_FFFF


class Reference:
    """Per worker: prefix key -> tier -> copies cached; engine hash -> key."""

    def __init__(self) -> None:
        self.held: dict[str, dict[Key, dict[str, int]]] = {w: {} for w in WORKERS}
        self.eng: dict[str, dict[int, Key]] = {w: {} for w in WORKERS}

    def store(
        self,
        w: str,
        parent: int | None,
        base: Key,
        blocks: list[tuple[int, ...]],
        tier: str,
        ids: list[int],
    ) -> None:
        root = parent is None and tier == DEFAULT_TIER  # vLLM's re-reports come so
        if parent is not None:
            if parent not in self.eng[w]:
                return
            base = self.eng[w][parent]
        for block, eh in zip(blocks, ids, strict=True):
            base = (*base, block)
            if self.eng[w].get(eh, base) != base:  # the id named another block: it goes
                del self.held[w][self.eng[w].pop(eh)]
            tiers = self.held[w].setdefault(base, {})
            if not (root and tier in tiers):  # a GPU root chain's held block: no copy
                tiers[tier] = tiers.get(tier, 0) + 1
            self.eng[w][eh] = base

    def remove(self, w: str, eh: int, tier: str) -> None:
        key = self.eng[w].get(eh)
        if key is None or tier not in self.held[w].get(key, {}):
            return
        tiers = self.held[w][key]
        tiers[tier] -= 1
        if not tiers[tier]:
            del tiers[tier]
        if not tiers:
            del self.held[w][key]
            del self.eng[w][eh]

    def clear(self, w: str) -> None:
        self.held[w].clear()
        self.eng[w].clear()

    def overlaps(self, root: Key, blocks: list[tuple[int, ...]]) -> dict[str, Overlap]:
        out: dict[str, Overlap] = {}
        for w in WORKERS:
            key, split, n = root, {}, 0
            for block in blocks:
                key = (*key, block)
                tiers = self.held[w].get(key)
                if not tiers:
                    break
                best = min(tiers, key=tier_rank)
                split[best] = split.get(best, 0) + 1
                n += 1
            if n:
                out[w] = Overlap(n, split)
        return out


class IndexMachine(RuleBasedStateMachine):
    backend = "python"

    @initialize(
        pool=st.lists(
            st.lists(st.tuples(*[st.integers(0, 2)] * BS), min_size=1, max_size=6),
            min_size=2,
            max_size=3,
        )
    )
    def setup(self, pool: list[list[tuple[int, ...]]]) -> None:
        self.pool = pool
        self.ref = Reference()
        self.index = PrefixIndex(backend=self.backend)
        clock = FakeClock()
        self.ingest: dict[str, WorkerIngest] = {}
        self.seq: dict[str, int] = {}
        for w in WORKERS:
            self.index.add_worker(w, model=MODEL)
            self.ingest[w] = WorkerIngest(w, self.index, wire.decode_batch, clock, has_replay=False)
            self.seq[w] = 0

    def root(self, ns: int) -> Key:
        lora, salt = NAMESPACES[ns]
        return (MODEL, lora, salt, BS)

    def send(self, w: str, events: list[wire.WireEvent], lost_before: bool = False) -> None:
        if lost_before:
            self.seq[w] += 1  # a batch the router never received
        payload = wire.encode_batch(time.time(), events)
        assert self.ingest[w].on_live(self.seq[w], payload) is None
        self.seq[w] += 1

    def blocks_event(
        self, w: str, ns: int, seq_i: int, start: int, n: int, tier: str, collide: bool = False
    ) -> tuple[wire.BlockStored, int | None, list[tuple[int, ...]], list[int]]:
        """A chain's blocks `start:start + n`, with their parent's and their own engine
        hashes. `collide`: the same engine hashes for other tokens (each token + 3, never in
        the pool), as a hash collision or a mangled batch would send them; a block is still
        named by one id only (a token shows which of the two an id's chain had there)."""
        seq = self.pool[seq_i % len(self.pool)]
        start = start % len(seq)
        root = self.root(ns)
        parent_key = (*root, *seq[:start]) if start else None
        parent = engine_hash(parent_key) if parent_key else None
        keys: list[int] = []
        key = (*root, *seq[:start])
        for b in seq[start : start + n]:
            key = (*key, b)
            keys.append(engine_hash(key))
        blocks = [tuple(t + 3 * collide for t in b) for b in seq[start : start + n]]
        lora, salt = NAMESPACES[ns]
        extra = [[salt]] + [None] * (len(blocks) - 1) if (salt and parent is None) else None
        event = wire.BlockStored(
            block_hashes=keys,
            parent_block_hash=parent,
            token_ids=[t for b in blocks for t in b],
            block_size=BS,
            lora_id=None,
            medium=tier,
            lora_name=lora,
            extra_keys=extra,
        )
        return event, parent, blocks, keys

    @rule(
        w=st.sampled_from(WORKERS),
        ns=st.integers(0, len(NAMESPACES) - 1),
        seq_i=st.integers(0, 5),
        start=st.integers(0, 5),
        n=st.integers(1, 6),
        tier=st.sampled_from(TIERS),
        lost=st.booleans(),
    )
    def store(self, w: str, ns: int, seq_i: int, start: int, n: int, tier: str, lost: bool) -> None:
        event, parent, blocks, ids = self.blocks_event(w, ns, seq_i, start, n, tier)
        if lost:
            self.ref.clear(w)  # no replay endpoint: the router must drop what it knew
        self.ref.store(w, parent, self.root(ns), blocks, tier, ids)
        self.send(w, [event], lost_before=lost)

    @rule(
        w=st.sampled_from(WORKERS),
        ns=st.integers(0, len(NAMESPACES) - 1),
        seq_i=st.integers(0, 5),
        start=st.integers(0, 5),
        n=st.integers(1, 6),
        tier=st.sampled_from(TIERS),
    )
    def store_colliding(self, w: str, ns: int, seq_i: int, start: int, n: int, tier: str) -> None:
        """Engine hashes stored again for other tokens: the blocks they named go first, in
        every tier, copies and all; the ids then name the new blocks."""
        event, parent, blocks, ids = self.blocks_event(w, ns, seq_i, start, n, tier, collide=True)
        self.ref.store(w, parent, self.root(ns), blocks, tier, ids)
        self.send(w, [event])

    @rule(
        w=st.sampled_from(WORKERS),
        ns=st.integers(0, len(NAMESPACES) - 1),
        seq_i=st.integers(0, 5),
        evict=st.integers(0, 5),
    )
    def rereport(self, w: str, ns: int, seq_i: int, evict: int) -> None:
        """vLLM's `kv_cache_report_mode: full`: BlockStored again, from the root, for the
        prefix the worker holds in GPU (as much of it as it holds, one block or more); then
        the engine evicts one of those blocks."""
        seq = self.pool[seq_i % len(self.pool)]
        key, held = self.root(ns), 0
        for b in seq:
            key = (*key, b)
            if "GPU" not in self.ref.held[w].get(key, {}):
                break
            held += 1
        if not held:
            return
        event, parent, blocks, ids = self.blocks_event(w, ns, seq_i, 0, held, "GPU")
        self.ref.store(w, parent, self.root(ns), blocks, "GPU", ids)
        evicted = ids[evict % len(ids)]
        self.ref.remove(w, evicted, "GPU")
        self.send(w, [event, wire.BlockRemoved(block_hashes=[evicted], medium="GPU")])

    @rule(
        w=st.sampled_from(WORKERS),
        pick=st.integers(0, 1000),
        tier=st.sampled_from(TIERS),
        count=st.integers(1, 3),
    )
    def remove(self, w: str, pick: int, tier: str, count: int) -> None:
        held = sorted(self.ref.eng[w]) or [12345]
        hashes = [held[(pick + i * 7) % len(held)] for i in range(count)]
        for eh in hashes:
            self.ref.remove(w, eh, tier)
        self.send(w, [wire.BlockRemoved(block_hashes=list(hashes), medium=tier)])

    @rule(w=st.sampled_from(WORKERS))
    def clear(self, w: str) -> None:
        self.ref.clear(w)
        self.send(w, [wire.AllBlocksCleared()])

    @rule(w=st.sampled_from(WORKERS), ns=st.integers(0, 2), seq_i=st.integers(0, 5))
    def restart(self, w: str, ns: int, seq_i: int) -> None:
        """The engine restarts: its sequence numbers begin again at 0, its cache is empty."""
        self.ref.clear(w)
        self.seq[w] = 0
        self.ingest[w].reconnected()  # a new process: its stream comes on a new connection
        event, parent, blocks, ids = self.blocks_event(w, ns, seq_i, 0, 3, "GPU")
        self.ref.store(w, parent, self.root(ns), blocks, "GPU", ids)
        self.send(w, [event])

    @invariant()
    def matches_agree(self) -> None:
        if not hasattr(self, "pool"):
            return
        for ns in range(len(NAMESPACES)):
            lora, salt = NAMESPACES[ns]
            for seq in self.pool:
                tokens = [t for b in seq for t in b]
                hashes = hash_request(tokens, BS, Namespace(MODEL, lora, salt))
                got = self.index.find_matches(hashes)
                assert got == self.ref.overlaps(self.root(ns), seq), (ns, seq)
        self.index.verify()


class CIndexMachine(IndexMachine):
    backend = "c"


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
CIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestIndexAgainstReference = IndexMachine.TestCase
TestCIndexAgainstReference = pytest.mark.skipif(
    "c" not in available_backends(),
    reason="C index core not built: pip install -e . needs gcc and the Python headers",
)(CIndexMachine.TestCase)
