"""Per-worker checks of the engine: reachable, prefix caching on, KV events configured, the
event sockets answer."""

from __future__ import annotations

import asyncio

from engines.base import EventSource
from engines.vllm.hints import KV_EVENTS_FLAG, PREFIX_CACHING_FIX
from router.check.context import Context
from router.check.model import (
    Finding,
    Result,
    Status,
    combine,
    failed,
    passed,
    verdict,
    warned,
)
from router.check.workerfacts import Publisher, Rank, WorkerFacts, rank_label
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
    if not w.ranks:
        return (
            []
            if not ctx.router.entries
            else [Finding(Status.FAIL, "the router does not list this worker", _ADD)]
        )
    return [*(f for r in w.ranks for f in _availability(r)), *_drained(w)]


def _availability(r: Rank) -> list[Finding]:
    """Each data-parallel rank is in rotation, or ejected, on its own."""
    entry = r.entry
    if entry.get("available"):
        if entry.get("draining"):
            return []  # reachable, yet out of rotation: `_drained` says so
        where = f"router {r.label}" if r.label else "router"
        return [Finding(Status.PASS, f"{where}: available, mode {entry.get('mode')}")]
    last = (r.report or {}).get("last_error", "")
    return [
        Finding(
            Status.FAIL,
            f"the router marks {r.label or 'it'} unavailable ({last or 'failed health checks'})",
            "let the router reach the worker's URL (network policy, DNS, TLS)",
        )
    ]


def _drained(w: WorkerFacts) -> list[Finding]:
    """An operator's drain is deliberate (a rolling update), so a WARN, not a FAIL: the
    router sends the worker nothing new until it is undrained. It drains a worker with all
    of its ranks, by the worker's name."""
    if not any(r.entry.get("draining") for r in w.ranks):
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
    """GET /kv_event_sources names a ZMQ publisher (vLLM's --kv-events-config), one per
    data-parallel rank."""
    src = w.sources
    assert src is not None
    approx = w.mode_setting == "approx"
    if src.status == 404 or not src.ok:
        evidence = f"GET /kv_event_sources: {src.describe()}"
        given = w.router_endpoints
        if given:
            return warned(
                "events-config", f"{evidence}; the router is given {', '.join(given)}", w.name
            )
        return _no_events(w, evidence + " and the router has no events endpoint for it", approx)
    sources = w.advertised
    if not sources:
        evidence = f"GET /kv_event_sources is {_short(src.text)}: the engine publishes no KV events"
        return _no_events(w, evidence, approx)
    ranked = len(sources) > 1
    evidence = "; ".join(_advertised(s, ranked) for s in sources)
    findings = [
        Finding(
            Status.WARN,
            f"no replay_endpoint{f' for {rank_label(s.rank)}' if ranked else ''}: lost events "
            "cannot be "
            'recovered (add "replay_endpoint":"tcp://*:5558" to --kv-events-config)',
        )
        for s in sources
        if not s.replay_endpoint
    ]
    return verdict("events-config", evidence, findings, w.name)


def _advertised(s: EventSource, ranked: bool) -> str:
    text = f"publisher {s.endpoint}, replay {s.replay_endpoint}, topic {s.topic!r}"
    return f"{rank_label(s.rank)} {text}" if ranked else text


def _short(text: str) -> str:
    return text.strip()[:80] or "empty"


def _no_events(w: WorkerFacts, evidence: str, approx: bool) -> Result:
    if approx:
        return warned("events-config", evidence + " (the router uses approx mode for it)", w.name)
    fix = f"start vLLM with {KV_EVENTS_FLAG}"
    return failed("events-config", evidence, fix, w.name)


async def check_events_endpoint(ctx: Context, w: WorkerFacts) -> Result:
    """The sockets the router dials (its events + replay endpoints) complete a ZMQ handshake;
    the replay socket answers a request. Each data-parallel rank has sockets of its own."""
    pubs = w.publishers
    if not any(p.endpoint for p in pubs):
        return warned(
            "events-endpoint",
            "nothing to probe: no publisher configured or advertised (see events-config)",
            w.name,
        )
    parts = await asyncio.gather(*(_probe_sockets(ctx, w, p) for p in pubs))
    if len(parts) == 1:
        return parts[0]
    return combine(
        "events-endpoint", [(p.label, r) for p, r in zip(pubs, parts, strict=True)], w.name
    )


async def _probe_sockets(ctx: Context, w: WorkerFacts, p: Publisher) -> Result:
    if p.endpoint is None:
        return warned("events-endpoint", "nothing to probe: no publisher for this rank", w.name)
    t = ctx.opts.timeout_s / 2
    targets = [p.endpoint, *([p.advertised.endpoint] if p.advertised else [])]
    reaches = await asyncio.gather(*(handshake(ctx.zmq, ep, t) for ep in dict.fromkeys(targets)))
    w.reach.update({r.endpoint: r for r in reaches})
    replayed = await replay_ping(ctx.zmq, p.replay, t) if p.replay else None
    findings = [*_pub_findings(p, reaches), *_replay_findings(replayed)]
    return verdict("events-endpoint", f"events {p.endpoint}: {reaches[0].detail}", findings, w.name)


def _pub_findings(p: Publisher, reaches: list[Reach]) -> list[Finding]:
    main, others = reaches[0], reaches[1:]
    if main.ok:
        return []
    alt = next((r for r in others if r.ok), None)
    whose = "the router subscribes to" if p.router else "the engine advertises"
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
