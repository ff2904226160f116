"""Recent demand on a worker's cache as the KV events show it: blocks stored, decayed; and
the blocks it stored again soon after evicting them (its cache is losing what it needs).

Every router replica consumes the same events, so every replica computes the same figure
(routing decisions, by contrast, are each replica's own: a demand counted from them differs
between replicas, and two replicas then home one new prefix on two workers)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from indexer.clock import Clock


class DecayingCount:
    """A sum whose every term halves each `half_life_s` (time from the injected clock)."""

    def __init__(self, clock: Clock, half_life_s: float = 60.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._clock = clock
        self._rate = math.log(2) / half_life_s
        self._value = 0.0
        self._at = clock.now()

    def _decay(self) -> None:
        now = self._clock.now()
        if now > self._at:
            self._value *= math.exp(-self._rate * (now - self._at))
            self._at = now

    def add(self, n: float) -> None:
        self._decay()
        self._value += n

    def value(self) -> float:
        self._decay()
        return self._value

    def clear(self) -> None:
        self._value = 0.0


class EvictedBlocks:
    """The last `size` blocks a worker evicted, to count those it stores again: a cache
    that evicts one-off tails (a query's own blocks) loses nothing it needs; one that
    evicts a conversation's context, then prefills it again for its next turn, churns.
    A churning cache stores its losses again within a few requests, so a short memory
    finds them (4,096 hashes, ~0.4 MB a worker, next to its index entries)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._hashes: OrderedDict[object, None] = OrderedDict()

    def evicted(self, hashes: Iterable[object]) -> None:
        memory = self._hashes
        for h in hashes:
            memory[h] = None
            memory.move_to_end(h)
        while len(memory) > self.size:
            memory.popitem(last=False)

    def stored(self, hashes: Iterable[object]) -> int:
        """How many of these newly stored blocks were evicted lately (each counted once)."""
        memory = self._hashes
        if not memory:
            return 0
        return sum(1 for h in hashes if memory.pop(h, 0) is None)

    def clear(self) -> None:
        self._hashes.clear()
