"""Routing profiles: a policy, weighted scorers and eligibility filters, run over one shared
fleet state (as llm-d's scheduler profiles are). The proxy and the gateway picker use the
`default` profile; a prefill->decode handoff runs a `decode` and a `prefill` profile over
the same fleet.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.core.filters import REGISTRY as FILTERS
from router.core.filters import Filter
from router.core.policies import REGISTRY as POLICIES
from router.core.policies import Policy, PolicyState
from router.core.scorers import build_scorers
from router.core.scoring import Scorer

DEFAULT_FILTERS = ("model", "available", "subset", "tried", "busy", "load_bound", "prefill_wait")
# the prefill->decode handoff's profiles: the default filters plus the workers' role
PD_ROLES: dict[str, tuple[str, ...]] = {
    "decode": ("decode", "both"),
    "prefill": ("prefill", "both"),
}
PD_FILTERS = (
    "model", "role", "available", "subset", "tried", "busy", "load_bound", "prefill_wait"
)  # fmt: skip


@dataclass
class Profile:
    name: str
    policy: Policy
    scorers: list[tuple[Scorer, float]]
    filters: list[Filter]
    state: PolicyState

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: w for s, w in self.scorers}


def build_profile(
    name: str,
    *,
    policy: str,
    policy_params: Mapping[str, Any],
    weights: Mapping[str, float],
    scorer_params: Mapping[str, Mapping[str, Any]],
    filters: Sequence[str] = DEFAULT_FILTERS,
    filter_params: Mapping[str, Mapping[str, Any]] | None = None,
    rng: random.Random | None = None,
) -> Profile:
    """Everything is looked up in its registry and its parameters typed, so a bad name or
    value is a ConfigError naming the field (Config.validate builds each profile once)."""
    built_filters = [
        FILTERS.build(f, (filter_params or {}).get(f), f"filters.{f}", "filters") for f in filters
    ]
    return Profile(
        name=name,
        policy=POLICIES.build(policy, policy_params, "policy_params", "policy"),
        scorers=build_scorers(weights, scorer_params),
        filters=built_filters,
        state=PolicyState(rng or random.Random(0)),
    )
