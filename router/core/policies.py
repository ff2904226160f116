"""Policies order the eligible endpoints once scored; the first is the pick, the rest the
retry order. One registry line each, with a typed parameter dataclass (`policy_params:` in
the config, validated at start).

    kv           best total score first (ties by name, so decisions repeat); with
                 temperature > 0 the first is sampled from softmax(total / temperature)
    round_robin  rotate through the endpoints by name (a baseline)
    random       a random order (a baseline)
    least_load   fewest requests in flight, then fewest prefill tokens (a baseline)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from router.core.decision import WorkerScore
from router.core.registry import Registry
from router.core.scoring import NoParams


@dataclass
class PolicyState:
    """Per-profile state a policy may read; advanced only when a decision is committed."""

    rng: random.Random
    turns: int = 0  # committed decisions (round robin's position)


class Policy(Protocol):
    name: str

    def order(self, scores: list[WorkerScore], state: PolicyState) -> list[WorkerScore]: ...


@dataclass(frozen=True)
class KvParams:
    temperature: float = 0.0  # 0 = argmax; > 0 samples softmax(score / temperature)

    def __post_init__(self) -> None:
        if self.temperature < 0 or math.isnan(self.temperature):
            raise ValueError("temperature must be >= 0")


class KvPolicy:
    name = "kv"

    def __init__(self, params: KvParams) -> None:
        self.temperature = params.temperature

    def order(self, scores: list[WorkerScore], state: PolicyState) -> list[WorkerScore]:
        ranked = sorted(scores, key=lambda s: (-s.total, s.worker))
        if self.temperature <= 0 or len(ranked) < 2:
            return ranked
        top = ranked[0].total
        weights = [math.exp((s.total - top) / self.temperature) for s in ranked]
        first = state.rng.choices(ranked, weights=weights)[0]
        return [first, *[s for s in ranked if s is not first]]


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, scores: list[WorkerScore], state: PolicyState) -> list[WorkerScore]:
        ranked = sorted(scores, key=lambda s: s.worker)
        start = state.turns % len(ranked) if ranked else 0
        return ranked[start:] + ranked[:start]


class RandomPolicy:
    name = "random"

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, scores: list[WorkerScore], state: PolicyState) -> list[WorkerScore]:
        shuffled = list(scores)
        state.rng.shuffle(shuffled)
        return shuffled


class LeastLoadPolicy:
    name = "least_load"

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, scores: list[WorkerScore], state: PolicyState) -> list[WorkerScore]:
        return sorted(scores, key=lambda s: (s.requests, s.prefill_tokens, s.worker))


REGISTRY: Registry[Policy] = Registry("policy")
register = REGISTRY.register

register("kv", KvPolicy, KvParams)
register("round_robin", RoundRobinPolicy, NoParams)
register("random", RandomPolicy, NoParams)
register("least_load", LeastLoadPolicy, NoParams)
