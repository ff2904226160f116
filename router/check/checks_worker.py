"""Per-worker checks of the engine: reachable, prefix caching on, KV events configured, the
event sockets answer."""

from __future__ import annotations

import asyncio
from typing import Any

from engines.vllm.hints import KV_EVENTS_FLAG, PREFIX_CACHING_FIX
from router.check.context import Context, WorkerFacts
from router.check.model import Finding, Result, Status, failed, passed, verdict, warned
from router.check.zmqprobe import Reach, handshake, replay_ping


async def check_worker(ctx: Context, w: WorkerFacts) -> Result:
    """Answers HTTP, serves a model, and the router has it in rotation."""
    if not w.reachable:
        why = w.health.describe() if w.health is not None else "not asked"
        fix = (
            "start the worker, or correct its URL in the router's worker list; run "
            "router-check where the router runs (it dials the workers itself) or pass --worker"
        )
        return failed("worker", f"cannot reach {w.url}: {why}", fix, w.name)
    assert w.health is not None
    evidence = (
        f"GET /health {w.health.status} in {w.health.ms:.0f} ms, model {w.model or '?'} "
        f"(max_model_len {w.max_model_len or '?'})"
    )
    return verdict("worker", evidence, [*_health(w), *_router_view(ctx, w)], w.name)


def _health(w: WorkerFacts) -> list[Finding]:
    assert w.health is not None
    if w.health.ok:
        return []
    return [
        Finding(
            Status.FAIL,
            f"the engine's GET /health answered {w.health.describe()}",
            "the engine reports itself unhealthy: see its log",
        )
    ]


def _router_view(ctx: Context, w: WorkerFacts) -> list[Finding]:
    if w.entry is None:
        return (
            []
            if not ctx.router.entries
            else [Finding(Status.FAIL, "the router does not list this worker", _ADD)]
        )
    return [*_availability(w, w.entry), *_drained(w, w.entry)]


def _availability(w: WorkerFacts, entry: dict[str, Any]) -> list[Finding]:
    if entry.get("available"):
        if entry.get("draining"):
            return []  # reachable, yet out of rotation: `_drained` says so
        return [Finding(Status.PASS, f"router: available, mode {entry.get('mode')}")]
    last = (w.report or {}).get("last_error", "")
    return [
        Finding(
            Status.FAIL,
            f"the router marks it unavailable ({last or 'failed health checks'})",
            "let the router reach the worker's URL (network policy, DNS, TLS)",
        )
    ]


def _drained(w: WorkerFacts, entry: dict[str, Any]) -> list[Finding]:
    """An operator's drain is deliberate (a rolling update), so a WARN, not a FAIL: the
    router sends the worker nothing new until it is undrained."""
    if not entry.get("draining"):
        return []
    text = (
        f"router: draining, out of rotation (POST /admin/workers/{w.name}/drain): it gets no "
        f"new requests until POST /admin/workers/{w.name}/undrain"
    )
    return [Finding(Status.WARN, text)]


_ADD = "add the worker to kvroute serve (--worker URL, or workers: in kvroute.yaml)"


async def check_prefix_caching(ctx: Context, w: WorkerFacts) -> Result:
    """vllm:cache_config_info{enable_prefix_caching="True"}: nothing is reused otherwise."""
    m = w.metrics
    if m is None:
        why = w.metrics_fetch.describe() if w.metrics_fetch is not None else "not asked"
        return warned("prefix-caching", f"cannot read GET /metrics ({why})", w.name)
    if m.prefix_caching is None:
        return warned("prefix-caching", "GET /metrics has no vllm:cache_config_info", w.name)
    evidence = (
        f"vllm:cache_config_info enable_prefix_caching={m.prefix_caching}, block_size "
        f"{m.block_size}, num_gpu_blocks {m.num_gpu_blocks}, hash {m.hash_algo}"
    )
    if m.prefix_caching is False:
        return failed("prefix-caching", evidence, PREFIX_CACHING_FIX, w.name)
    hits = f"; prefix cache hits {m.prefix_hits:.0f} of {m.prefix_queries:.0f} queried tokens"
    return passed("prefix-caching", evidence + (hits if m.prefix_queries else ""), w.name)


async def check_events_config(ctx: Context, w: WorkerFacts) -> Result:
    """GET /kv_event_sources names a ZMQ publisher (vLLM's --kv-events-config)."""
    src = w.sources
    assert src is not None
    approx = w.mode_setting == "approx"
    if src.status == 404 or not src.ok:
        evidence = f"GET /kv_event_sources: {src.describe()}"
        if w.router_endpoint:
            return warned(
                "events-config", f"{evidence}; the router is given {w.router_endpoint}", w.name
            )
        return _no_events(w, evidence + " and the router has no events endpoint for it", approx)
    adv = w.advertised
    if adv is None:
        evidence = f"GET /kv_event_sources is {_short(src.text)}: the engine publishes no KV events"
        return _no_events(w, evidence, approx)
    evidence = f"publisher {adv.endpoint}, replay {adv.replay_endpoint}, topic {adv.topic!r}"
    findings = (
        []
        if adv.replay_endpoint
        else [
            Finding(
                Status.WARN,
                "no replay_endpoint: lost events cannot be recovered (add "
                '"replay_endpoint":"tcp://*:5558" to --kv-events-config)',
            )
        ]
    )
    return verdict("events-config", evidence, findings, w.name)


def _short(text: str) -> str:
    return text.strip()[:80] or "empty"


def _no_events(w: WorkerFacts, evidence: str, approx: bool) -> Result:
    if approx:
        return warned("events-config", evidence + " (the router uses approx mode for it)", w.name)
    fix = f"start vLLM with {KV_EVENTS_FLAG}"
    return failed("events-config", evidence, fix, w.name)


async def check_events_endpoint(ctx: Context, w: WorkerFacts) -> Result:
    """The sockets the router dials (its events + replay endpoints) complete a ZMQ handshake;
    the replay socket answers a request."""
    adv = w.advertised
    pub = w.router_endpoint or (adv.endpoint if adv else None)
    replay = w.router_replay or (adv.replay_endpoint if adv and not w.router_endpoint else None)
    if pub is None:
        return warned(
            "events-endpoint",
            "nothing to probe: no publisher configured or advertised (see events-config)",
            w.name,
        )
    t = ctx.opts.timeout_s / 2
    targets = [pub, *([adv.endpoint] if adv and adv.endpoint != pub else [])]
    reaches = await asyncio.gather(*(handshake(ctx.zmq, ep, t) for ep in targets))
    w.reach.update({r.endpoint: r for r in reaches})
    replayed = await replay_ping(ctx.zmq, replay, t) if replay else None
    findings = [*_pub_findings(w, reaches), *_replay_findings(replayed)]
    return verdict("events-endpoint", f"events {pub}: {reaches[0].detail}", findings, w.name)


def _pub_findings(w: WorkerFacts, reaches: list[Reach]) -> list[Finding]:
    main, others = reaches[0], reaches[1:]
    if main.ok:
        return []
    alt = next((r for r in others if r.ok), None)
    whose = "the router subscribes to" if w.router_endpoint else "the engine advertises"
    text = f"{whose} {main.endpoint} and it does not answer"
    if alt is not None:
        text += f"; the engine advertises {alt.endpoint}, which answers"
        fix = (
            f"set events: {alt.endpoint} for this worker in the router config (or remove "
            "events: to discover it from GET /kv_event_sources)"
        )
    else:
        fix = (
            f"make {main.endpoint} reachable from the router (vLLM binds the endpoint of "
            "--kv-events-config; open that port), or correct events: in the router config"
        )
    return [Finding(Status.FAIL, text, fix)]


def _replay_findings(replayed: Reach | None) -> list[Finding]:
    if replayed is None:
        return [Finding(Status.WARN, "no replay endpoint: gaps cannot be repaired")]
    if replayed.ok:
        return [Finding(Status.PASS, f"replay {replayed.endpoint}: {replayed.detail}")]
    fix = (
        f"make {replayed.endpoint} reachable (vLLM's replay_endpoint), or correct replay: "
        "in the router config"
    )
    return [Finding(Status.FAIL, f"replay {replayed.endpoint}: {replayed.detail}", fix)]
