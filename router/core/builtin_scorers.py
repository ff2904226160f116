"""The built-in scorers (registered in `router/core/scorers.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.core.scoring import Candidate, NoParams, ScoreRequest


@dataclass(frozen=True)
class PrefixParams:
    # credit per cached token by where the block lives: a CPU or disk hit still has to be
    # loaded back into GPU memory, so it saves less prefill time than a GPU hit
    tier_credit: dict[str, float] = field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.75, "DISK": 0.25, "STORAGE": 0.25}
    )


class PrefixScorer:
    name = "prefix"

    def __init__(self, params: PrefixParams) -> None:
        self.tier_credit = dict(params.tier_credit)

    def credited_tokens(self, c: Candidate) -> float:
        return sum(
            blocks * c.block_size * self.tier_credit.get(tier, 0.25)
            for tier, blocks in c.overlap_by_tier.items()
        )

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        total = max(request.prompt_tokens, 1)
        return {c.name: self.credited_tokens(c) / total for c in cands}


class LoadScorer:
    name = "load"

    def __init__(self, params: NoParams) -> None:
        pass

    @staticmethod
    def load_blocks(c: Candidate) -> float:
        return c.load.prefill_tokens / c.block_size + c.load.decode_blocks

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        loads = {c.name: self.load_blocks(c) for c in cands}
        worst = max(loads.values(), default=0.0)
        if worst <= 0:
            return dict.fromkeys(loads, 1.0)
        return {name: 1.0 - load / worst for name, load in loads.items()}


@dataclass(frozen=True)
class PlacementParams:
    # a prompt whose best prefix credit on any worker is below this fraction is new
    new_below: float = 0.1


class PlacementScorer:
    """Where a new prefix should live. Load spreads requests, but not prefixes: on a fleet
    whose caches are full, the worker that was least loaded at the moment each new prefix
    arrived is effectively random, and a worker that ends up home to more prefixes than its
    cache holds evicts them in turn (measured: groups homed 7/8/8/9 over four workers gave a
    0.654 cached fraction where 8/8/8/8 gave 0.727). So for a new prompt this scores the
    workers by the distinct blocks routed to them recently (their demand on the cache): 0 for
    the most demanded, 1 for one with none. For a prompt some worker already holds it is
    neutral (1 for all) and the prefix credit decides."""

    name = "placement"

    def __init__(self, params: PlacementParams) -> None:
        self.new_below = params.new_below

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        total = max(request.prompt_tokens, 1)
        best = max((c.overlap_blocks * c.block_size / total for c in cands), default=0.0)
        most = max((c.routed_blocks for c in cands), default=0)
        if best >= self.new_below or most <= 0:
            return {c.name: 1.0 for c in cands}
        return {c.name: 1.0 - c.routed_blocks / most for c in cands}


class HeadroomScorer:
    name = "headroom"

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        out: dict[str, float] = {}
        most = max((c.cached_blocks for c in cands), default=0)
        for c in cands:
            if not c.caching:  # an empty cache that can never keep anything is not room
                out[c.name] = 0.0
            elif c.capacity_blocks:
                out[c.name] = 1.0 - min(1.0, c.cached_blocks / c.capacity_blocks)
            else:
                out[c.name] = 1.0 - (c.cached_blocks / most if most else 0.0)
        return out
