"""Scorers: plugins that rate each candidate worker 0..1 (1 = best). The framework weighs,
clamps, times and explains them; a scorer only says how good each worker looks by its own
measure.

Adding one: a class with `name` and `score(request, candidates)`, a factory taking its typed
parameters, one line in `REGISTRY`, a weight in the config (`scoring.weights.<name>`).

  prefix    cached prompt fraction on the worker, tier-credited (GPU 1.0, CPU 0.75, disk 0.25)
  load      1 for the least loaded candidate, 0 for the most (prefill tokens + decode blocks)
  headroom  free fraction of the worker's KV cache by the index's count (cache pressure), so
            new prefixes spread over the caches instead of piling where load ties
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.core.load import LoadView


@dataclass(frozen=True)
class Candidate:
    """Everything a scorer may look at for one worker. Built by the picker."""

    name: str
    block_size: int
    overlap_by_tier: Mapping[str, int]  # leading cached blocks of this request, per tier
    load: LoadView
    cached_blocks: int  # blocks the index shows on this worker
    capacity_blocks: int | None  # the worker's KV cache size in blocks, if known
    caching: bool = True  # false when the engine runs with prefix caching off

    @property
    def overlap_blocks(self) -> int:
        return sum(self.overlap_by_tier.values())


@dataclass(frozen=True)
class ScoreRequest:
    prompt_tokens: int


class Scorer(Protocol):
    name: str

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]: ...


class PrefixScorer:
    name = "prefix"

    def __init__(self, tier_credit: Mapping[str, float]) -> None:
        self.tier_credit = dict(tier_credit)

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

    @staticmethod
    def load_blocks(c: Candidate) -> float:
        return c.load.prefill_tokens / c.block_size + c.load.decode_blocks

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        loads = {c.name: self.load_blocks(c) for c in cands}
        worst = max(loads.values(), default=0.0)
        if worst <= 0:
            return dict.fromkeys(loads, 1.0)
        return {name: 1.0 - load / worst for name, load in loads.items()}


class HeadroomScorer:
    name = "headroom"

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


REGISTRY: dict[str, Callable[..., Scorer]] = {
    "prefix": PrefixScorer,
    "load": LoadScorer,
    "headroom": HeadroomScorer,
}


def build_scorers(
    weights: Mapping[str, float], tier_credit: Mapping[str, float]
) -> list[tuple[Scorer, float]]:
    out: list[tuple[Scorer, float]] = []
    for name, weight in weights.items():
        if weight <= 0:
            continue
        factory = REGISTRY.get(name)
        if factory is None:
            raise ValueError(
                f"unknown scorer {name!r} in scoring.weights; known: {', '.join(REGISTRY)}"
            )
        out.append((factory(tier_credit) if name == "prefix" else factory(), weight))
    return out


def clamp(value: float) -> float:
    """Scores outside 0..1 (or NaN) from a plugin are clamped, never trusted."""
    if math.isnan(value):
        return 0.0
    return 0.0 if value < 0 else 1.0 if value > 1 else value
