"""The scorer registry: one line per scorer, its parameter dataclass and what it measures.

prefix    cached prompt fraction on the worker, tier-credited (GPU 1.0, CPU 0.75, disk 0.25)
load      1 for the least loaded candidate, 0 for the most (prefill tokens + decode blocks)
placement for a prompt no worker holds yet: 1 - the worker's recent demand on its cache
          (distinct blocks routed there) / the most demanded one's; neutral otherwise
headroom  free fraction of the worker's KV cache by the index's count (cache pressure), so
          new prefixes spread over the caches instead of piling where load ties
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.core.builtin_scorers import (
    HeadroomScorer,
    LoadScorer,
    PlacementParams,
    PlacementScorer,
    PrefixParams,
    PrefixScorer,
)
from router.core.registry import Registry
from router.core.scoring import NoParams, Scorer

REGISTRY: Registry[Scorer] = Registry("scorer")
register = REGISTRY.register

register("prefix", PrefixScorer, PrefixParams, "cached prompt fraction, tier-credited")
register("load", LoadScorer, NoParams, "least loaded 1, most loaded 0")
register("headroom", HeadroomScorer, NoParams, "free fraction of the worker's KV cache")
register("placement", PlacementScorer, PlacementParams, "new prefixes to the least demanded cache")


def build_scorers(
    weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
) -> list[tuple[Scorer, float]]:
    """The weighted scorers of a profile; a weight of 0 turns a scorer off (its parameters
    are still checked)."""
    for name in params:
        if name not in weights:
            REGISTRY.params(name, params[name], f"scoring.params.{name}", f"scoring.params.{name}")
    out: list[tuple[Scorer, float]] = []
    for name, weight in weights.items():
        path, where = f"scoring.params.{name}", f"scoring.weights.{name}"
        scorer = REGISTRY.build(name, params.get(name), path, where)
        if weight > 0:
            out.append((scorer, weight))
    return out
