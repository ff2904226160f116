"""Scorers: plugins that rate each candidate worker 0..1 (1 = best). The framework weighs,
clamps, times and explains them; a scorer only says how good each worker looks by its own
measure. The built-in ones are listed in `router/core/scorers.py`.

Adding one: a module with the class (`name`, `score(request, candidates)`) and its parameter
dataclass (typed fields, each with a default; validated at start from
`scoring.params.<name>`), one `register(...)` line in `router/core/scorers.py`, then a weight
in the config (`scoring.weights.<name>`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.core.load import LoadView


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class Candidate:
    """Everything a scorer may look at for one worker. Built by the picker."""

    name: str
    block_size: int
    overlap_by_tier: Mapping[str, int]  # leading cached blocks of this request, per tier
    load: LoadView
    cached_blocks: int  # blocks the index shows on this worker
    capacity_blocks: int | None  # the worker's KV cache size in blocks, if known
    caching: bool = True  # false when the engine runs with prefix caching off
    mode: str = "events"  # where the overlap came from: events (exact) or approx
    recent_blocks: float = 0.0  # demand on its cache lately: blocks stored (events), decayed
    new_blocks: float = 0.0  # blocks of the new prefixes sent to it lately, decayed (fleet)
    refetched: float | None = None  # blocks stored again soon after evicting them (events)

    @property
    def overlap_blocks(self) -> int:
        return sum(self.overlap_by_tier.values())


NEW_BELOW = 0.1  # a prompt of which no endpoint holds this fraction is a new prefix


def is_new_prefix(
    prompt_tokens: int, overlaps: Iterable[tuple[int, int]], below: float = NEW_BELOW
) -> bool:
    """No endpoint holds `below` of the prompt: `overlaps` are (cached leading blocks,
    block size) per endpoint."""
    total = max(prompt_tokens, 1)
    return all(blocks * size < below * total for blocks, size in overlaps)


def uncached_tokens(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """The prompt tokens a worker must prefill: those past its cached leading blocks. The
    in-flight load counts this at the pick, and the prefill-wait filter weighs the same."""
    return max(0, prompt_tokens - overlap_blocks * block_size)


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class ScoreRequest:
    prompt_tokens: int
    # a hash of the prompt's opening blocks (up to 8), the same for prompts that share them
    # and on every router replica: placement's tie-break
    key: int = 0


@dataclass(frozen=True)
class NoParams:
    """The parameters of a scorer (or policy, or filter) that has none."""


class Scorer(Protocol):
    name: str

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]: ...


def clamp(value: float) -> float:
    """Scores outside 0..1 (or NaN) from a plugin are clamped, never trusted."""
    if math.isnan(value):
        return 0.0
    return 0.0 if value < 0 else 1.0 if value > 1 else value
