"""Per-worker sequence tracking for KV event batches (pure; the subscriber does the IO).

vLLM numbers batches 0, 1, 2, ... per engine process. The live stream of one process never
goes backwards, so a live sequence at or below the last live one means the engine restarted.
Replayed batches may repeat what already arrived live: those are duplicates, not restarts.
"""

from __future__ import annotations

from enum import Enum


class Verdict(Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


class SeqTracker:
    """Decides what to do with each batch's sequence number."""

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self._last_live: int | None = None

    def reconnected(self) -> None:
        """A fresh subscription: its first batch may follow a gap (ZMQ slow joiner)."""
        self._last_live = None

    def restart(self) -> None:
        """Forget everything: the engine process is new and numbers from 0 again."""
        self.last_applied = None
        self._last_live = None

    @property
    def expected(self) -> int:
        return 0 if self.last_applied is None else self.last_applied + 1

    def classify_live(self, seq: int) -> Verdict:
        if self._last_live is not None:
            if seq <= self._last_live:
                return Verdict.RESTART
        elif self.last_applied is not None and seq <= self.last_applied:
            return Verdict.RESTART
        self._last_live = seq
        return self.classify(seq)

    def classify(self, seq: int) -> Verdict:
        """For replayed batches, and live ones after `classify_live` vetted them."""
        expected = self.expected
        if seq < expected:
            return Verdict.DUPLICATE
        return Verdict.APPLY if seq == expected else Verdict.GAP

    def applied(self, seq: int) -> None:
        self.last_applied = seq

    def skip_to(self, seq: int) -> None:
        """Accept that everything before `seq` is lost (after a resync)."""
        self.last_applied = seq - 1
