"""Per-worker event health: does this worker's KV event stream really feed the index?

A worker is only judged once it was sent a request that should have stored new blocks (a full
block the index did not already hold for it); cache hits legitimately publish nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from indexer.clock import Clock


@dataclass(frozen=True)
class HealthFixes:
    """What to tell the operator for each broken state. Engine-specific wording comes from
    the engine's adapter (`engines.ADAPTERS`); these neutral defaults name no engine."""

    no_events: str = "enable the engine's KV event publisher"
    stale: str = "check the engine process and its KV event publisher"
    resync: str = (
        "none needed if it recurs rarely; frequent resyncs mean lost events: give the "
        "engine a replay endpoint and a larger event buffer"
    )


class EventHealth(Enum):
    OK = "OK"
    NO_EVENTS = "NO_EVENTS"
    STALE = "STALE"
    RESYNCING = "RESYNCING"


@dataclass(frozen=True)
class HealthReport:
    state: EventHealth
    reason: str
    fix: str = ""
    errors: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        """What /health treats as fine (RESYNCING is degraded, not broken)."""
        return self.state in (EventHealth.OK, EventHealth.RESYNCING) and not self.errors


class HealthTracker:
    """Pure state; time comes from the injected clock."""

    def __init__(
        self,
        worker: str,
        clock: Clock,
        *,
        grace_s: float = 10.0,
        resync_hold_s: float = 30.0,
        endpoint: str | None = None,
        fixes: HealthFixes | None = None,
    ) -> None:
        self.worker = worker
        self._clock = clock
        self.grace_s = grace_s
        self.resync_hold_s = resync_hold_s
        self.endpoint = endpoint
        self.fixes = fixes or HealthFixes()
        self._pending_since: float | None = None
        self._pending_requests = 0
        self._ever_stored = False
        self._last_stored: float | None = None
        self._last_resync: float | None = None
        self._resync_reason = ""
        self._errors: dict[str, str] = {}

    def note_request(self, expects_new_blocks: bool) -> None:
        """The router sent this worker a request; `expects_new_blocks` when it holds a full
        block the index does not show on this worker."""
        if not expects_new_blocks:
            return
        if self._pending_since is None:
            self._pending_since = self._clock.now()
        self._pending_requests += 1

    def withdraw_request(self) -> None:
        """A request noted as expecting new blocks was refused by the engine (a client's
        4xx): it will publish nothing for it."""
        if self._pending_requests > 0:
            self._pending_requests -= 1
        if self._pending_requests == 0:
            self._pending_since = None

    def forget_pending(self) -> None:
        """The requests it awaited blocks for were failed over or cut (the worker was taken
        out of rotation): what they stored, if anything, has been published or never will
        be; waiting on them would call a worker back in rotation silent."""
        self._pending_since = None
        self._pending_requests = 0

    def note_stored(self) -> None:
        self._ever_stored = True
        self._last_stored = self._clock.now()
        self._pending_since = None
        self._pending_requests = 0

    def note_resync(self, reason: str) -> None:
        self._last_resync = self._clock.now()
        self._resync_reason = reason

    def set_error(self, key: str, message: str | None) -> None:
        """A configuration error (block size, tokenizer): set, or clear with None."""
        if message is None:
            self._errors.pop(key, None)
        else:
            self._errors[key] = message

    def report(self) -> HealthReport:
        now = self._clock.now()
        errors = tuple(self._errors.values())
        if self._pending_since is not None and now - self._pending_since >= self.grace_s:
            return self._silent_report(now, errors)
        if self._last_resync is not None and now - self._last_resync < self.resync_hold_s:
            return HealthReport(
                EventHealth.RESYNCING,
                f"worker {self.worker} index was rebuilt {now - self._last_resync:.0f} s ago "
                f"({self._resync_reason}); prefixes cached before then are not visible",
                self.fixes.resync,
                errors,
            )
        reason = "events flowing" if self._ever_stored else "no requests judged yet"
        return HealthReport(EventHealth.OK, f"worker {self.worker}: {reason}", "", errors)

    def _silent_report(self, now: float, errors: tuple[str, ...]) -> HealthReport:
        waited = now - (self._pending_since or now)
        where = f" and check that the router can reach {self.endpoint}" if self.endpoint else ""
        if not self._ever_stored:
            return HealthReport(
                EventHealth.NO_EVENTS,
                f"worker {self.worker} published no KV events in {waited:.0f} s after "
                f"{self._pending_requests} requests",
                f"{self.fixes.no_events}{where}",
                errors,
            )
        return HealthReport(
            EventHealth.STALE,
            f"worker {self.worker} stopped publishing KV events: none in {waited:.0f} s after "
            f"{self._pending_requests} requests (the last came {self._age(now)} ago)",
            f"{self.fixes.stale}{where}",
            errors,
        )

    def _age(self, now: float) -> str:
        return "never" if self._last_stored is None else f"{now - self._last_stored:.0f} s"
