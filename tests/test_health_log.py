"""An unhealthy worker is logged at ERROR once a minute, not on every check."""

from __future__ import annotations

import logging

import pytest

from indexer.clock import FakeClock
from router.verdicts import log_problems


def test_error_line_once_per_minute_per_worker(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    seen: dict[str, float] = {}

    def log_them(reports: list[dict[str, object]]) -> None:
        log_problems(reports, clock.now(), seen)

    report = {
        "name": "w1",
        "status": "unhealthy",
        "problems": ["no events"],
        "reason": "published no KV events",
        "fix": "add --kv-events-config",
    }
    caplog.set_level(logging.ERROR, logger="kvroute.workers")
    log_them([report])
    log_them([report])
    clock.advance(59)
    log_them([report])
    assert len(caplog.records) == 1
    assert "w1 is unhealthy" in caplog.records[0].message
    assert "--kv-events-config" in caplog.records[0].message
    clock.advance(2)
    log_them([report, {**report, "name": "w2"}])
    assert [r.message.split()[1] for r in caplog.records] == ["w1", "w1", "w2"]
    log_them([{**report, "status": "ok"}])
    assert len(caplog.records) == 3
