"""Injected time, so that TTLs and health grace periods are testable without sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds. The core never reads the wall clock itself."""

    def now(self) -> float: ...


class MonotonicClock:
    """The production clock."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._t += seconds
