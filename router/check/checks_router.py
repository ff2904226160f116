"""Checks of the router itself: reachable and sanely configured; what its /health says."""

from __future__ import annotations

from typing import Any

from router.check.context import Context
from router.check.httpio import Fetched
from router.check.model import Finding, Result, Status, failed, passed, verdict, warned

TOKEN_FIX = "pass --admin-token TOKEN (or set KVROUTE_ADMIN_TOKEN) to router-check"
ADMIN_OFF_FIX = (
    "the router runs without an admin token, so /admin and /debug are off: start kvroute "
    "with --admin-token TOKEN and pass the same token here (checks that need them are "
    "skipped with WARN)"
)


def admin_fix(fetched: Fetched | None) -> str | None:
    """Why an /admin or /debug call was refused, as a fix; None if it was not refused."""
    if fetched is None or fetched.ok:
        return None
    if fetched.status in (401, 403):
        return TOKEN_FIX
    if fetched.status == 404 and "admin-token" in str(fetched.body):
        return ADMIN_OFF_FIX  # kvroute's own 404 (a worker's 404 is about a wrong URL)
    return None


async def check_router(ctx: Context) -> Result:
    """Reachable, ready, knows its workers, routes by KV cache, exposes what the checks read."""
    r = ctx.router
    assert r.health is not None and r.ready is not None
    entries = r.entries
    available = sum(1 for e in entries if e.get("available"))
    drained = f", {len(r.draining)} draining" if r.draining else ""
    # a data-parallel worker is listed once per rank: count workers, and say the endpoints
    endpoints = f"{len(entries)} endpoints, " if len(entries) != r.worker_count else ""
    evidence = (
        f"answers in {r.health.ms:.0f} ms, /ready {r.ready.status}, {r.worker_count} workers "
        f"listed ({endpoints}{available} available{drained}), policy {r.policy or '?'}"
    )
    findings = [
        *_ready(r.ready),
        *_workers(ctx, len(entries), available),
        *_policy(r.policy, r.debug),
        *_metrics(r.metrics),
    ]
    return verdict("router", evidence, findings, workers=len(entries), available=available)


def _ready(ready: Fetched) -> list[Finding]:
    if ready.ok:
        return []
    return [
        Finding(
            Status.FAIL,
            f"GET /ready answered {ready.describe()}: no worker can take traffic",
            "start the workers, or correct their URLs in the router's worker list",
        )
    ]


def _workers(ctx: Context, listed: int, available: int) -> list[Finding]:
    admin = ctx.router.admin
    assert admin is not None
    if not admin.ok:
        fix = admin_fix(admin) or "upgrade the router (kvroute serve)"
        return [Finding(Status.WARN, f"GET /admin/workers: {admin.describe()} ({fix})")]
    out: list[Finding] = []
    if listed == 0:
        out.append(Finding(Status.FAIL, "the router lists no workers", _ADD_WORKER))
    elif available == 0:
        out.append(Finding(Status.FAIL, "no listed worker is available", _FIX_AVAILABLE))
    for w in ctx.workers:
        if not w.ranks:
            out.append(
                Finding(Status.FAIL, f"--worker {w.url} is not in the router's list", _ADD_WORKER)
            )
    modes = {str(e.get("mode")) for e in ctx.router.entries}
    if modes == {"approx"}:
        out.append(Finding(Status.WARN, "every worker is routed in approx mode (no KV events)"))
    return out


_ADD_WORKER = "add the worker to kvroute serve (--worker URL, or workers: in kvroute.yaml)"
_FIX_AVAILABLE = "the router cannot reach its workers: check their URLs and that they are up"


def _policy(policy: str | None, debug: Fetched | None) -> list[Finding]:
    if policy is None:
        why = debug.describe() if debug is not None else "not asked"
        fix = admin_fix(debug)
        hint = f" ({fix})" if fix else ""
        return [Finding(Status.WARN, f"POST /debug/route: {why}: policy unknown{hint}")]
    if policy != "kv":
        return [
            Finding(
                Status.FAIL,
                f"the router runs --policy {policy}: it ignores the KV cache",
                "run kvroute serve with --policy kv (the default)",
            )
        ]
    return []


def _metrics(metrics: Fetched | None) -> list[Finding]:
    if metrics is not None and metrics.ok:
        return []
    why = metrics.describe() if metrics is not None else "not asked"
    return [Finding(Status.WARN, f"GET /metrics: {why}: the index check cannot read counters")]


async def check_router_health(ctx: Context) -> Result:
    """The router's own verdict: /health names each broken worker and its fix."""
    health = ctx.router.health
    assert health is not None
    doc: dict[str, Any] = health.body if isinstance(health.body, dict) else {}
    status = str(doc.get("status", "?"))
    bad = [w for w in ctx.router.health_entries if w.get("status") != "ok"]
    evidence = f"GET /health answered {health.status}: status {status}"
    if health.ok and status == "ok":
        return passed("router-health", f"{evidence}, every worker ok", status=status)
    if bad:
        evidence += "; " + "; ".join(_describe(w) for w in bad)
    if health.status == 200:
        return warned("router-health", evidence, status=status)
    return failed("router-health", evidence, _fixes(bad), status=status, unhealthy=len(bad))


def _describe(w: dict[str, Any]) -> str:
    problems = len(w.get("problems") or [])
    return (
        f"{w.get('name')} {w.get('status')} (event health {w.get('event_health', '?')}, "
        f"{problems} problem{'s' if problems != 1 else ''})"
    )


def _fixes(bad: list[dict[str, Any]]) -> str:
    """The router's own words: its problems name the fix, and `fix` the event-health one."""
    texts = [str(p) for w in bad for p in w.get("problems") or []]
    texts += [str(w["fix"]) for w in bad if w.get("fix")]
    texts += [f"{w.get('name')}: {w['last_error']}" for w in bad if w.get("last_error")]
    return "; ".join(dict.fromkeys(texts)) or "see the router's GET /health and its log"
