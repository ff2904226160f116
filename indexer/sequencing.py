"""Per-worker sequence tracking for KV event batches (pure; the subscriber does the IO).

vLLM numbers batches 0, 1, 2, ... per engine process, and one process's live stream never
goes backwards. So a live batch numbered below the next expected one is either a copy of
something already applied (a replay delivered it first, or the stream repeated itself), or
the first batch of a new engine process. Only the second wipes the worker's index, so a
lower number counts as a restart only with evidence:

- the subscription was just (re)connected: a new TCP connection whose number is at or below
  the last live one is a new process (the engine says so; numbers between the last live one
  and the expected one are live copies of what a replay applied); or
- it went back to the start (at most half the last applied number) *and* the next live
  batch carries on from it while still below the old position. Until then it is held.

Anything else below the expected number is dropped: `STALE`, never a restart.
The first batch of a stream (nothing applied yet) may start past 0 because ZMQ drops what
was published before a subscription reached the publisher: `CATCH_UP`, not a gap.
"""

from __future__ import annotations

from enum import Enum


class Verdict(Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"  # a live copy of a batch a replay already applied
    STALE = "stale"  # duplicate or out of order: dropped
    HOLD = "hold"  # back to the start: a restart if the next batch carries on from it
    GAP = "gap"  # batches were lost after the last applied one
    CATCH_UP = "catch_up"  # a stream's first batch starts past 0
    RESTART = "restart"  # a new engine process: forget the old one, then classify again


class SeqTracker:
    """Decides what to do with each batch's sequence number."""

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self._last_live: int | None = None
        self._fresh = True  # no live batch seen on this connection yet
        self._replayed: int | None = None  # what the replay on this connection applied

    def reconnected(self) -> None:
        """A fresh subscription: its first batch may follow a gap (ZMQ slow joiner), and a
        number on it at or below the last live one means the engine restarted. The last live
        number is kept: live copies of batches a replay already applied may still be queued
        from before the reconnect (a network blip during a replay), and numbers above it are
        such copies, not a new process; a new process numbers from 0 again."""
        self._fresh = True
        self._replayed = None

    def restart(self) -> None:
        """Forget everything: the engine process is new and numbers from 0 again."""
        self.last_applied = None
        self._last_live = None
        self._replayed = None

    @property
    def expected(self) -> int:
        return 0 if self.last_applied is None else self.last_applied + 1

    def classify_live(self, seq: int, replayed_copy: bool = False) -> Verdict:
        """`replayed_copy`: its bytes are those of the batch the replay on this connection
        returned under that number (an engine's replay is its live stream, byte for byte),
        so it is a copy whatever the number: a young engine's connect replay holds its
        whole stream, and copies queued meanwhile sit at its very start."""
        fresh, self._fresh = self._fresh, False
        if self.last_applied is None:
            verdict = Verdict.APPLY if seq == 0 else Verdict.CATCH_UP
        elif seq >= self.expected:
            verdict = Verdict.APPLY if seq == self.expected else Verdict.GAP
            self._replayed = None  # the live stream passed what the replay applied
        elif replayed_copy or self._copy_of_replayed(seq):
            verdict = Verdict.DUPLICATE  # the replay on connect applied it first
        elif self._last_live is not None and seq > self._last_live:
            verdict = Verdict.DUPLICATE
        elif fresh:
            return Verdict.RESTART
        else:
            return Verdict.HOLD if seq <= self.last_applied // 2 else Verdict.STALE
        self._last_live = seq
        return verdict

    def confirms_restart(self, held: int, seq: int) -> bool:
        """Does live batch `seq`, right after the held `held`, carry on from it below the
        old position (the new process's stream) rather than jump back to the old one?"""
        return held < seq < self.expected

    def classify(self, seq: int) -> Verdict:
        """For replayed batches, and held ones once the live stream vetted them."""
        expected = self.expected
        if seq < expected:
            return Verdict.DUPLICATE
        return Verdict.APPLY if seq == expected else Verdict.GAP

    def applied(self, seq: int) -> None:
        self.last_applied = seq

    def replayed_on_connect(self, last: int) -> None:
        """A replay fetched as this subscription connected applied up to `last`: live
        batches up to there on this connection, queued meanwhile, are copies of its batches
        (`_copy_of_replayed`). A later connection forgets it (its numbers may be a new
        process's), and so does the first live batch past it."""
        self._replayed = last

    def _copy_of_replayed(self, seq: int) -> bool:
        """Queued while the replay was served, a copy is one of its last few batches; a
        number back at the start is not one (an engine restarted behind a relay, whose
        connection to us never dropped): the restart rules judge it."""
        assert self.last_applied is not None
        return self._replayed is not None and self.last_applied // 2 < seq <= self._replayed

    def skip_to(self, seq: int) -> None:
        """Accept that everything before `seq` is lost (after a resync)."""
        self.last_applied = seq - 1
