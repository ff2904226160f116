"""The index never promises a block the engine does not hold. A model of one vLLM worker
keeps physical copies per block and publishes what vLLM publishes for each way a request
meets the cache: hits then new blocks chained to the last hit; a block-aligned prompt's
last block recomputed into a second copy; a request that skips the cache (prompt_logprobs,
an async KV load) caching its whole prompt again from the root; `kv_cache_report_mode:
full` re-reporting the hits from the root; evictions one physical block at a time; and a
router that restarts while the engine keeps its cache (it learns only what comes after).
Whatever the order, every block the index credits the worker with has a copy on the
engine; and once the engine holds nothing, neither does the index."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from indexer.events import BlockRemoved, BlockStored, EngineBlockHash, EventBatch
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex, available_backends

BS = 2
MODEL = "m"
W = "w"
Block = tuple[int, ...]


def engine_id(prefix: tuple[Block, ...]) -> EngineBlockHash:
    return EngineBlockHash(hash(("engine", prefix)) & 0xFFFF_FFFF_FFFF_FFFF)


class EngineModel(RuleBasedStateMachine):
    backend = "python"

    @initialize(
        prompts=st.lists(
            st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=5),
            min_size=1,
            max_size=3,
        )
    )
    def setup(self, prompts: list[list[Block]]) -> None:
        self.prompts = prompts
        self.copies: dict[tuple[Block, ...], int] = {}  # prefix -> physical copies cached
        self.index = self._new_index()

    def _new_index(self) -> PrefixIndex:
        index = PrefixIndex(backend=self.backend)
        index.add_worker(W, model=MODEL)
        return index

    def _send(self, *events: BlockStored | BlockRemoved) -> None:
        self.index.apply(W, EventBatch(0.0, list(events)))

    def _hits(self, prompt: list[Block], n: int) -> int:
        h = 0
        while h < n and self.copies.get(tuple(prompt[: h + 1]), 0):
            h += 1
        return h

    def _cache(self, prompt: list[Block], start: int, end: int) -> None:
        """New physical blocks `start:end` of a prompt, published as vLLM's cache_full_blocks
        does: one BlockStored chained to the block before `start` (none: from the root)."""
        if start >= end:
            return
        keys = [tuple(prompt[: i + 1]) for i in range(start, end)]
        for key in keys:
            self.copies[key] = self.copies.get(key, 0) + 1
        parent = engine_id(tuple(prompt[:start])) if start else None
        tokens = [t for block in prompt[start:end] for t in block]
        self._send(BlockStored([engine_id(k) for k in keys], parent, tokens, BS))

    @rule(p=st.integers(0, 2), n=st.integers(1, 5), report=st.booleans(), aligned=st.booleans())
    def request(self, p: int, n: int, report: bool, aligned: bool) -> None:
        """A request for the prompt's first `n` blocks. `aligned`: the prompt ends on a block
        boundary, so its last block is never a hit (vLLM computes the last token)."""
        prompt = self.prompts[p % len(self.prompts)]
        n = min(n, len(prompt))
        hit = self._hits(prompt, n - 1 if aligned else n)
        if report and hit:  # kv_cache_report_mode full: the hits again, from the root
            tokens = [t for block in prompt[:hit] for t in block]
            ids = [engine_id(tuple(prompt[: i + 1])) for i in range(hit)]
            self._send(BlockStored(ids, None, tokens, BS))
        self._cache(prompt, hit, n)

    @rule(p=st.integers(0, 2), n=st.integers(1, 5))
    def request_skipping_the_cache(self, p: int, n: int) -> None:
        """prompt_logprobs, or a KV load that had not landed when the next one looked:
        the whole prompt computed and cached again, from the root."""
        prompt = self.prompts[p % len(self.prompts)]
        self._cache(prompt, 0, min(n, len(prompt)))

    @rule(pick=st.integers(0, 1000))
    def evict(self, pick: int) -> None:
        held = sorted(k for k, c in self.copies.items() if c)
        if not held:
            return
        key = held[pick % len(held)]
        self.copies[key] -= 1
        self._send(BlockRemoved([engine_id(key)]))

    @rule()
    def router_restarts(self) -> None:
        """The engine keeps its cache; the new router learns only what comes next (its
        replay buffer long wrapped)."""
        self.index = self._new_index()

    @invariant()
    def promises_only_what_the_engine_holds(self) -> None:
        if not hasattr(self, "prompts"):
            return
        for prompt in self.prompts:
            tokens = [t for block in prompt for t in block]
            found = self.index.find_matches(hash_request(tokens, BS, Namespace(MODEL)))
            credited = found[W].blocks if W in found else 0
            holds = [self.copies.get(tuple(prompt[: i + 1]), 0) for i in range(credited)]
            assert all(holds), (prompt, credited, holds)
        if not any(self.copies.values()):
            assert self.index.entries_of(W) == 0
        self.index.verify()


class CEngineModel(EngineModel):
    backend = "c"


EngineModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
CEngineModel.TestCase.settings = EngineModel.TestCase.settings
TestIndexAgainstEngineCopies = EngineModel.TestCase
TestCIndexAgainstEngineCopies = pytest.mark.skipif(
    "c" not in available_backends(),
    reason="C index core not built: pip install -e . needs gcc and the Python headers",
)(CEngineModel.TestCase)
