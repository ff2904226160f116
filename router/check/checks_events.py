"""events-flowing: subscribe to a worker's publisher ourselves, send that worker a fresh
prompt of several blocks, and wait for BlockStored events carrying exactly its token ids."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engines.vllm.hints import KV_EVENTS_FLAG, PREFIX_CACHING_FIX
from router.check.context import Context, WorkerFacts
from router.check.httpio import Fetched
from router.check.model import Result, failed, passed, warned
from router.check.prompts import sized_text
from router.check.zmqprobe import EventTap, Observation

NAME = "events-flowing"
SETTLE_S = 0.2  # a new SUB's subscription needs a moment to reach the PUB (slow joiner)
PROBE_BLOCKS = 6
UNKNOWN_BLOCK_SIZE_TOKENS = 800  # 6 blocks of 128, the largest common block size


@dataclass
class Probe:
    tokens: list[int] | None  # the worker's /tokenize of the prompt; None without /tokenize
    sent: asyncio.Task[Fetched]


async def check_events_flowing(ctx: Context, w: WorkerFacts) -> Result:
    endpoints = _candidates(w)
    if not endpoints:
        return _no_publisher(w)
    tap, why = await _subscribe(ctx, endpoints)
    if tap is None:
        fix = "see events-endpoint: the router cannot subscribe either"
        return failed(NAME, f"cannot subscribe: {why}", fix, w.name)
    try:
        return await _probe(ctx, w, tap)
    finally:
        tap.close()


def _candidates(w: WorkerFacts) -> list[str]:
    """The router's endpoint first; the engine's own if different."""
    adv = w.advertised
    return list(dict.fromkeys(e for e in (w.router_endpoint, adv and adv.endpoint) if e))


def _no_publisher(w: WorkerFacts) -> Result:
    evidence = "no KV events: the engine advertises no publisher and the router has none for it"
    if w.mode_setting == "approx":
        return warned(NAME, evidence + " (approx mode)", w.name)
    return failed(NAME, evidence, f"start vLLM with {KV_EVENTS_FLAG}", w.name)


async def _subscribe(ctx: Context, endpoints: list[str]) -> tuple[EventTap | None, str]:
    details = []
    for ep in endpoints:
        tap = EventTap(ctx.zmq, ep)
        reach = await tap.connect(ctx.opts.timeout_s / 2)
        if reach.ok:
            return tap, reach.detail
        tap.close()
        details.append(f"{ep}: {reach.detail}")
    return None, "; ".join(details)


async def _probe(ctx: Context, w: WorkerFacts, tap: EventTap) -> Result:
    await asyncio.sleep(SETTLE_S)
    probes: list[Probe] = []
    matched = False
    t0 = 0.0
    try:
        for _ in range(2):  # a second fresh probe covers a subscription still settling
            probes.append(await _send(ctx, w))
            t0 = t0 or time.perf_counter()
            matched = await tap.until(lambda s: _done(s, probes), ctx.opts.timeout_s / 2)
            if matched:
                break
        ms = (time.perf_counter() - t0) * 1000
    finally:
        answers = await asyncio.gather(*(p.sent for p in probes))
    w.observed, w.probe_seen = tap.seen, _coverage(tap.seen, probes)
    tokens = max(len(p.tokens or ()) for p in probes)
    return _judge(ctx, w, tap, answers, matched, ms, tokens)


async def _send(ctx: Context, w: WorkerFacts) -> Probe:
    bs = w.metrics.block_size if w.metrics else None
    target = PROBE_BLOCKS * bs + bs // 2 if bs else UNKNOWN_BLOCK_SIZE_TOKENS
    target = max(min(target, (w.max_model_len or 1 << 30) - 16), 1)

    async def count(text: str) -> int | None:
        tokens = await ctx.count_tokens(w, text)
        return len(tokens) if tokens else None

    text = await sized_text(target, count, "events")
    tokens = await ctx.count_tokens(w, text)
    body = {"model": w.model, "prompt": text, "max_tokens": 1, "temperature": 0}
    return Probe(tokens, asyncio.create_task(ctx.worker_call(w, "POST", "/v1/completions", body)))


def _coverage(seen: Observation, probes: list[Probe]) -> tuple[int, int]:
    """The best-covered probe: (its blocks seen stored, its full blocks)."""
    found = [seen.coverage(p.tokens) for p in probes if p.tokens]
    return max(found, key=lambda f: (f[0] / f[1] if f[1] else 0.0, f[0]), default=(0, 0))


def _done(seen: Observation, probes: list[Probe]) -> bool:
    if all(p.tokens is None for p in probes):
        return seen.stored_events > 0
    got, want = _coverage(seen, probes)
    return want > 0 and got == want


def _judge(
    ctx: Context,
    w: WorkerFacts,
    tap: EventTap,
    answers: list[Fetched],
    matched: bool,
    ms: float,
    tokens: int,
) -> Result:
    seen = tap.seen
    got, want = w.probe_seen or (0, 0)
    data = {
        "batches": seen.batches,
        "stored_events": seen.stored_events,
        "probe_blocks": want,
        "probe_blocks_seen": got,
        "ms": round(ms),
        "probe_tokens": tokens,
        "probes": len(answers),
    }
    where = tap.endpoint + (
        ""
        if tap.endpoint == (w.router_endpoint or tap.endpoint)
        else " (the engine's endpoint, not the router's)"
    )
    if seen.malformed:
        evidence = f"{seen.malformed} of {seen.batches} batches on {where} are not vLLM KV events"
        fix = "use a kvroute release that decodes this vLLM version's KV events"
        return failed(NAME, evidence, fix, w.name, **data)
    if matched and want:
        evidence = (
            f"BlockStored for {got}/{want} probe blocks (block_size "
            f"{_sizes(seen)}, topic {_topics(seen)}) {ms:.0f} ms after {_nth(len(answers))}, "
            f"on {where}"
        )
        return passed(NAME, evidence, w.name, **data)
    if matched:
        evidence = (
            f"{seen.stored_events} BlockStored after the probe on {where}, but the engine "
            "has no POST /tokenize to match their token ids"
        )
        return warned(NAME, evidence, w.name, **data)
    return _not_seen(ctx, w, answers, where, data)


def _not_seen(
    ctx: Context, w: WorkerFacts, answers: list[Fetched], where: str, data: dict[str, int]
) -> Result:
    bad = next((a for a in answers if not a.ok), None)
    if bad is not None:
        fix = f"the worker must serve POST /v1/completions for model {w.model!r}: see its log"
        return failed(NAME, f"the probe request failed: {bad.describe()}", fix, w.name, **data)
    seen = w.observed or Observation()
    if seen.stored_events:
        evidence = (
            f"{seen.stored_events} BlockStored on {where}, but only "
            f"{data['probe_blocks_seen']}/{data['probe_blocks']} probe blocks among them"
        )
        fix = (
            "the engine publishes events for other requests but not all of the probe's: "
            "rerun with a longer --timeout; check every data-parallel rank publishes"
        )
        return failed(NAME, evidence, fix, w.name, **data)
    evidence = (
        f"no KV event on {where} within {ctx.opts.timeout_s:g} s of "
        f"{len(answers)} probe requests of {data['probe_tokens'] or '?'} tokens"
    )
    return failed(NAME, evidence, _silent_fix(w), w.name, **data)


def _silent_fix(w: WorkerFacts) -> str:
    if w.metrics is not None and w.metrics.prefix_caching is False:
        return PREFIX_CACHING_FIX + " (vLLM publishes BlockStored only for cached blocks)"
    return (
        "the engine accepts subscribers but publishes nothing: check its --kv-events-config "
        '("enable_kv_cache_events": true, "publisher": "zmq") and its log'
    )


def _nth(probes: int) -> str:
    return "the probe" if probes == 1 else f"the first of {probes} probes"


def _sizes(seen: Observation) -> str:
    return "/".join(str(b) for b in sorted(seen.block_sizes)) or "?"


def _topics(seen: Observation) -> str:
    return ", ".join(repr(t) for t in sorted(seen.topics)) or "?"
