"""The scorer registry: one line per scorer, its parameter dataclass and what it measures.

prefix    cached prompt fraction on the worker, tier-credited (GPU 1.0, CPU 0.75, disk 0.25)
load      1 for the least loaded candidate, 0 for the most (prefill tokens + decode blocks)
headroom  free fraction of the worker's KV cache by the index's count (cache pressure), so
          new prefixes spread over the caches instead of piling where load ties
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.core.builtin_scorers import HeadroomScorer, LoadScorer, PrefixParams, PrefixScorer
from router.core.errors import ConfigError
from router.core.scoring import NoParams, Scorer, ScorerSpec
from router.core.typed import build

REGISTRY: dict[str, ScorerSpec] = {}


def register(name: str, factory: Callable[[Any], Scorer], params: type[Any], doc: str) -> None:
    REGISTRY[name] = ScorerSpec(factory, params, doc)


register("prefix", PrefixScorer, PrefixParams, "cached prompt fraction, tier-credited")
register("load", LoadScorer, NoParams, "least loaded 1, most loaded 0")
register("headroom", HeadroomScorer, NoParams, "free fraction of the worker's KV cache")


def scorer_params(name: str, raw: Mapping[str, Any] | None, where: str = "weights") -> Any:
    """The typed parameters of scorer `name` from `scoring.params.<name>` (errors name it)."""
    spec = REGISTRY.get(name)
    if spec is None:
        path = f"scoring.{where}.{name}"
        raise ConfigError(
            f"config field {path}: unknown scorer {name!r}; known: {', '.join(sorted(REGISTRY))}",
            param=path,
        )
    return build(spec.params, dict(raw or {}), f"scoring.params.{name}")


def build_scorers(
    weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
) -> list[tuple[Scorer, float]]:
    """The weighted scorers of a profile; a weight of 0 turns a scorer off."""
    for name in params:
        if name not in weights:
            scorer_params(name, params[name], "params")
    out: list[tuple[Scorer, float]] = []
    for name, weight in weights.items():
        typed = scorer_params(name, params.get(name))
        if weight > 0:
            out.append((REGISTRY[name].factory(typed), weight))
    return out
