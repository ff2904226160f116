"""Per-endpoint verdicts behind /health, the metrics and the ERROR log lines: is this worker's
KV-aware routing really working, and if not, why and what fixes it."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from indexer.health import EventHealth
from router.core.fleet import APPROX

if TYPE_CHECKING:
    from router.workers import Feed, WorkerHandle, WorkerPool

log = logging.getLogger("kvroute.workers")
DEGRADING = frozenset({"api_key"})  # problems that degrade a worker rather than break it


def worker_reports(pool: WorkerPool, h: WorkerHandle) -> list[dict[str, Any]]:
    """One report per endpoint (a worker, or each of its data-parallel ranks)."""
    return [_report(pool, h, f) for f in h.feeds]


def _report(pool: WorkerPool, h: WorkerHandle, f: Feed) -> dict[str, Any]:
    state = f.state
    report = state.health.report() if state.health else None
    problems = dict(h.problems)
    for i, err in enumerate(report.errors if report else ()):
        problems[f"events_{i}"] = err
    held = pool.held(h) if not state.available else 0.0
    if not state.available:
        # first: its events' verdict ("events flowing") is beside the point while it is out
        back = (
            f"it was ejected for timeouts again, so --timeout-hold keeps it out another "
            f"{math.ceil(held)} s, or until its engine generates a token, though /health "
            "answers"
            if held
            else "it is re-admitted once its /health answers"
        )
        problems = {
            "unavailable": (
                f"worker {state.name} is out of rotation: {h.last_error or 'failing health checks'}"
                f"; check its vLLM process or pod: {back}"
            ),
            **problems,
        }
    sub = f.subscriber.status if f.subscriber is not None else None
    if sub is not None and sub.restarts and not sub.running:
        problems["subscriber"] = (
            f"worker {state.name}: its KV event subscriber failed ({sub.last_error}) and is "
            "being restarted; events are not applied meanwhile"
        )
    out: dict[str, Any] = {
        "name": state.name,
        "url": h.config.url,
        "status": _status(h, report, problems),
        "available": state.available,
        "draining": state.draining,  # an operator took it out of rotation: not a fault
        "mode_setting": h.mode_setting,
        "mode": state.mode,
        "event_health": _event_state(h, f, report),
        "block_size": state.block_size,
        "capacity_blocks": state.capacity_blocks,
        "cached_blocks": pool.fleet.index.entries_of(state.name),
        "models": sorted(state.models or ()),
        "role": state.role,
        "events_endpoint": f.source.endpoint if f.source else None,
        "replay_endpoint": f.source.replay_endpoint if f.source else None,
        "problems": list(problems.values()),
    }
    if state.rank is not None:
        out["data_parallel_rank"] = state.rank
    if report is not None and h.mode_setting != APPROX and state.available:
        out["reason"] = report.reason
        if report.fix:
            out["fix"] = report.fix
    if f.ingest is not None:
        out["events"] = _event_counters(f)
    if h.last_error and not state.available:
        out["last_error"] = h.last_error
    if held:
        out["held_s"] = round(held, 1)
    return out


def _event_state(h: WorkerHandle, f: Feed, report: Any) -> str:
    if h.mode_setting == APPROX:
        return "DISABLED"
    if f.source is None and "events" in h.problems:
        # nothing publishes, so nothing can arrive: the tracker, judging only requests
        # whose events it waits for, would say OK
        return EventHealth.NO_EVENTS.value
    return str(report.state.value) if report else "UNKNOWN"


def _status(h: WorkerHandle, report: Any, problems: dict[str, str]) -> str:
    if not h.available:
        return "unavailable"
    silent = report is not None and report.state in (EventHealth.NO_EVENTS, EventHealth.STALE)
    if h.mode_setting != APPROX and (silent or "events" in problems):
        return "degraded" if h.mode_setting == "auto" else "unhealthy"
    if not problems:
        return "ok"
    # its models unknown (a key kvroute lacks): routed by prefix still, maybe to a worker of
    # another model in a multi-model fleet: degraded, not broken
    return "degraded" if problems.keys() <= DEGRADING else "unhealthy"


def _event_counters(f: Feed) -> dict[str, Any]:
    assert f.ingest is not None
    c = f.ingest.counters
    out: dict[str, Any] = {
        "batches": c.batches,
        "gaps": c.gaps,
        "replays": c.replays,
        "resyncs": c.resyncs,
        "restarts": c.restarts,
        "malformed": c.malformed,
        "malformed_by_reason": dict(c.malformed_by_reason),
        "out_of_order": c.out_of_order,
        "unknown_parent": c.unknown_parent,
        "stored_blocks": c.blocks_stored,
        "removed_blocks": c.blocks_removed,
        "rereported_blocks": c.rereported_blocks,
    }
    if f.subscriber is not None:
        st = f.subscriber.status
        out["connected"] = st.connected
        out["subscriber"] = {
            "running": st.running,
            "restarts": st.restarts,
            "last_error": st.last_error,
        }
    return out


def log_problems(reports: list[dict[str, Any]], now: float, last: dict[str, float]) -> None:
    """An ERROR line per unhealthy endpoint, at most once a minute each."""
    for r in reports:
        if r["status"] == "ok":
            continue
        seen = last.get(r["name"])
        if seen is not None and now - seen < 60:
            continue
        last[r["name"]] = now
        detail = "; ".join([r.get("reason", ""), *r["problems"], r.get("fix", "")]).strip("; ")
        log.error("worker %s is %s: %s", r["name"], r["status"], detail or r.get("last_error", ""))
