from __future__ import annotations

from engines import ADAPTERS
from indexer.clock import FakeClock
from indexer.health import EventHealth, HealthTracker


def tracker() -> tuple[HealthTracker, FakeClock]:
    clock = FakeClock()
    fixes = ADAPTERS["vllm"].hints.health
    t = HealthTracker("w1", clock, grace_s=10, endpoint="tcp://10.0.0.1:5557", fixes=fixes)
    return t, clock


def test_the_neutral_core_names_no_engine() -> None:
    clock = FakeClock()
    t = HealthTracker("w1", clock, grace_s=1)
    t.note_request(expects_new_blocks=True)
    clock.advance(2)
    report = t.report()
    assert report.state is EventHealth.NO_EVENTS
    assert "vLLM" not in report.fix and "KV event publisher" in report.fix


def test_no_requests_is_ok() -> None:
    t, clock = tracker()
    clock.advance(100)
    assert t.report().state is EventHealth.OK


def test_cache_hits_are_not_judged() -> None:
    t, clock = tracker()
    t.note_request(expects_new_blocks=False)
    clock.advance(60)
    assert t.report().state is EventHealth.OK


def test_no_events_after_grace_names_worker_and_fix() -> None:
    t, clock = tracker()
    for _ in range(3):
        t.note_request(expects_new_blocks=True)
    clock.advance(9.9)
    assert t.report().state is EventHealth.OK
    clock.advance(0.2)
    report = t.report()
    assert report.state is EventHealth.NO_EVENTS and not report.healthy
    assert "w1" in report.reason and "3 requests" in report.reason
    assert "--kv-events-config" in report.fix and "tcp://10.0.0.1:5557" in report.fix


def test_events_then_silence_is_stale() -> None:
    t, clock = tracker()
    t.note_request(True)
    t.note_stored()
    clock.advance(30)
    t.note_request(True)
    clock.advance(11)
    assert t.report().state is EventHealth.STALE
    t.note_stored()
    assert t.report().state is EventHealth.OK


def test_resync_is_degraded_for_a_while() -> None:
    t, clock = tracker()
    t.note_resync("gap")
    report = t.report()
    assert report.state is EventHealth.RESYNCING and report.healthy
    clock.advance(31)
    assert t.report().state is EventHealth.OK


def test_errors_make_it_unhealthy_until_cleared() -> None:
    t, _ = tracker()
    t.set_error("block_size", "mismatch")
    assert not t.report().healthy
    t.set_error("block_size", None)
    assert t.report().healthy
