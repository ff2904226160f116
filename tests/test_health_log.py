"""An unhealthy worker is logged at ERROR once a minute, not on every check."""

from __future__ import annotations

import logging

import httpx
import pytest

from indexer.clock import FakeClock
from router.core.config import Config, WorkerConfig
from router.core.picker import RoutingCore
from router.workers import WorkerPool


async def test_error_line_once_per_minute_per_worker(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    config = Config(workers=(WorkerConfig("http://127.0.0.1:9"),))
    async with httpx.AsyncClient() as client:
        pool = WorkerPool(config, RoutingCore(clock), client, clock, None)
        report = {
            "name": "w1",
            "status": "unhealthy",
            "problems": ["no events"],
            "reason": "published no KV events",
            "fix": "add --kv-events-config",
        }
        caplog.set_level(logging.ERROR, logger="kvroute.workers")
        pool.log_problems([report])
        pool.log_problems([report])
        clock.advance(59)
        pool.log_problems([report])
        assert len(caplog.records) == 1
        assert "w1 is unhealthy" in caplog.records[0].message
        assert "--kv-events-config" in caplog.records[0].message
        clock.advance(2)
        pool.log_problems([report, {**report, "name": "w2"}])
        assert [r.message.split()[1] for r in caplog.records] == ["w1", "w1", "w2"]
        pool.log_problems([{**report, "status": "ok"}])
        assert len(caplog.records) == 3
