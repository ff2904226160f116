"""The prefill->decode path: a probe handoff between a prefill and a decode worker of the
router's list (the same probe `kvroute serve` runs at start): did the decode worker really
pull the KV (its metrics say so), how many bytes, how fast; and what the router's own
verification of live splits found (`/health` pd: silent recomputes, failed pulls)."""

from __future__ import annotations

from typing import Any

from router.check.context import Context
from router.check.model import Finding, Result, Status, passed, verdict, warned
from router.pd.calibrate import PROBE_FIX
from router.pd.probe import Endpoint, ProbeResult, probe_handoff
from router.pd.verify import SILENT_FIX

NAME = "pd-path"
PROBE_TOKENS = 1024
FAULT_FIX = "restart kvroute serve without --pd-fault-strip-params (a test fault)"


async def check_pd_path(ctx: Context) -> Result:
    entries = ctx.router.entries
    prefill = [e for e in entries if e.get("role") == "prefill"]
    if not prefill:
        if ctx.router.admin is not None and not ctx.router.admin.ok:
            return warned(NAME, "not run: the worker list (and its roles) is unavailable")
        return passed(NAME, "no prefill workers: nothing is handed off")
    decode = [e for e in entries if e.get("role") in ("decode", "both")]
    pair = _pair(prefill, decode)
    if pair is None:
        return warned(NAME, "not run: no available prefill worker and decode worker to probe")
    result = await probe_handoff(
        ctx.http,
        _endpoint(pair[0]),
        _endpoint(pair[1]),
        model=_model(pair[0]),
        tokens=PROBE_TOKENS,
        block_size=int(pair[0].get("block_size") or 16),
        timeout_s=max(ctx.opts.timeout_s, 30.0),
    )
    findings = [*_probe_findings(result), *_router_findings(_pd_health(ctx))]
    link = result.link_bytes_per_s
    return verdict(
        NAME,
        result.describe(),
        findings,
        bytes_moved=result.moved.bytes_transferred,
        link_mb_s=None if link is None else round(link / 1e6, 1),
        proved=result.proved,
    )


def _pair(prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> tuple[Any, Any] | None:
    p = next((e for e in prefill if e.get("available")), None)
    d = next((e for e in decode if e.get("available")), None)
    return None if p is None or d is None else (p, d)


def _endpoint(entry: dict[str, Any]) -> Endpoint:
    return Endpoint(str(entry.get("name")), str(entry.get("url")).rstrip("/"))


def _model(entry: dict[str, Any]) -> str:
    models = entry.get("models") or []
    return str(models[0]) if models else ""


def _probe_findings(r: ProbeResult) -> list[Finding]:
    if r.error is not None:
        return [Finding(Status.FAIL, "the probe handoff failed", PROBE_FIX)]
    if not r.proved:
        text = (
            f"the decode worker did not pull the probe's KV (external_kv_transfer "
            f"{r.moved.external_kv_transfer:.0f} of {r.prompt_tokens} tokens, "
            f"{r.moved.bytes_transferred:.0f} bytes): it recomputed the prompt"
        )
        return [Finding(Status.FAIL, text, SILENT_FIX)]
    return []


def _pd_health(ctx: Context) -> dict[str, Any]:
    health = ctx.router.health
    doc = health.body if health is not None and isinstance(health.body, dict) else {}
    pd = doc.get("pd")
    return pd if isinstance(pd, dict) else {}


def _router_findings(pd: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    if pd.get("test_fault"):
        out.append(
            Finding(Status.FAIL, f"the router runs a test fault: {pd['test_fault']}", FAULT_FIX)
        )
    if pd.get("status") == "degraded":
        problems = "; ".join(str(p) for p in pd.get("problems") or [])
        out.append(
            Finding(
                Status.FAIL,
                f"the router's P/D verification: {problems}",
                str(pd.get("fix") or SILENT_FIX),
            )
        )
    elif pd:
        out.append(
            Finding(
                Status.PASS,
                f"the router proved {pd.get('verified_handoffs', 0)} handoffs, "
                f"{pd.get('silent_recomputes', 0)} silent recomputes, link estimate "
                f"{pd.get('link_mb_s')} MB/s, threshold {pd.get('threshold')}",
            )
        )
    return out
