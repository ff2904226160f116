"""events-flowing: subscribe to a worker's publisher ourselves, send that worker a fresh
prompt of several blocks, and wait for BlockStored events carrying exactly its token ids."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engines.vllm.hints import KV_EVENTS_FLAG, PREFIX_CACHING_FIX
from router.check.context import Context, rank_headers
from router.check.httpio import Fetched
from router.check.model import Result, combine, failed, passed, warned
from router.check.prompts import sized_text
from router.check.workerfacts import Publisher, WorkerFacts
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
    """Each engine of the worker (each data-parallel rank, asked for by name) publishes the
    BlockStored of a probe sent to it."""
    pubs = w.publishers
    if not any(p.candidates for p in pubs):
        return _no_publisher(w)
    parts = await asyncio.gather(*(_rank_flowing(ctx, w, p) for p in pubs))
    if len(parts) == 1:
        return parts[0]
    labelled = [(p.label, r) for p, r in zip(pubs, parts, strict=True)]
    return combine(NAME, labelled, w.name, **_totals([r.data for r in parts]))


def _totals(data: list[dict[str, int]]) -> dict[str, int]:
    """Counts summed over the ranks; the slowest rank's time."""
    keys = dict.fromkeys(k for d in data for k in d)
    return {k: (max if k == "ms" else sum)(d.get(k, 0) for d in data) for k in keys}


async def _rank_flowing(ctx: Context, w: WorkerFacts, p: Publisher) -> Result:
    endpoints = p.candidates
    if not endpoints:
        return _no_publisher(w)
    tap, why = await _subscribe(ctx, endpoints)
    if tap is None:
        fix = "see events-endpoint: the router cannot subscribe either"
        return failed(NAME, f"cannot subscribe: {why}", fix, w.name)
    try:
        return await _probe(ctx, w, p, tap)
    finally:
        tap.close()


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


async def _probe(ctx: Context, w: WorkerFacts, p: Publisher, tap: EventTap) -> Result:
    await asyncio.sleep(SETTLE_S)
    probes: list[Probe] = []
    matched = False
    t0 = 0.0
    try:
        for _ in range(2):  # a second fresh probe covers a subscription still settling
            probes.append(await _send(ctx, w, p.rank))
            t0 = t0 or time.perf_counter()
            matched = await tap.until(lambda s: _done(s, probes), ctx.opts.timeout_s / 2)
            if matched:
                break
        ms = (time.perf_counter() - t0) * 1000
    finally:
        answers = await asyncio.gather(*(probe.sent for probe in probes))
    w.seen[p.name] = tap.seen
    tokens = max(len(probe.tokens or ()) for probe in probes)
    ran = Ran(tap, answers, matched, ms, tokens, _coverage(tap.seen, probes))
    return _judge(ctx, w, p, ran)


async def _send(ctx: Context, w: WorkerFacts, rank: int | None) -> Probe:
    """A fresh prompt of several blocks, served by `rank` where the worker runs several."""
    bs = w.metrics.block_size if w.metrics else None
    target = PROBE_BLOCKS * bs + bs // 2 if bs else UNKNOWN_BLOCK_SIZE_TOKENS
    target = max(min(target, (w.max_model_len or 1 << 30) - 16), 1)

    async def count(text: str) -> int | None:
        tokens = await ctx.count_tokens(w, text)
        return len(tokens) if tokens else None

    text = await sized_text(target, count, "events")
    tokens = await ctx.count_tokens(w, text)
    body = {"model": w.model, "prompt": text, "max_tokens": 1, "temperature": 0}
    sent = ctx.worker_call(w, "POST", "/v1/completions", body, rank_headers(rank))
    return Probe(tokens, asyncio.create_task(sent))


def _coverage(seen: Observation, probes: list[Probe]) -> tuple[int, int]:
    """The best-covered probe: (its blocks seen stored, its full blocks)."""
    found = [seen.coverage(p.tokens) for p in probes if p.tokens]
    return max(found, key=lambda f: (f[0] / f[1] if f[1] else 0.0, f[0]), default=(0, 0))


def _done(seen: Observation, probes: list[Probe]) -> bool:
    if all(p.tokens is None for p in probes):
        return seen.stored_events > 0
    got, want = _coverage(seen, probes)
    return want > 0 and got == want


@dataclass(frozen=True)
class Ran:
    """What one rank's probe gave: the tap, the answers, and the blocks seen of expected."""

    tap: EventTap
    answers: list[Fetched]
    matched: bool
    ms: float
    tokens: int
    coverage: tuple[int, int]  # (probe blocks seen, expected)


def _judge(ctx: Context, w: WorkerFacts, p: Publisher, ran: Ran) -> Result:
    seen = ran.tap.seen
    got, want = ran.coverage
    data = {
        "batches": seen.batches,
        "stored_events": seen.stored_events,
        "probe_blocks": want,
        "probe_blocks_seen": got,
        "ms": round(ran.ms),
        "probe_tokens": ran.tokens,
        "probes": len(ran.answers),
    }
    endpoint = ran.tap.endpoint
    where = endpoint + (
        "" if endpoint == (p.router or endpoint) else " (the engine's endpoint, not the router's)"
    )
    if seen.malformed:
        evidence = f"{seen.malformed} of {seen.batches} batches on {where} are not vLLM KV events"
        fix = "use a kvroute release that decodes this vLLM version's KV events"
        return failed(NAME, evidence, fix, w.name, **data)
    if ran.matched and want:
        evidence = (
            f"BlockStored for {got}/{want} probe blocks (block_size "
            f"{_sizes(seen)}, topic {_topics(seen)}) {ran.ms:.0f} ms after "
            f"{_nth(len(ran.answers))}, on {where}"
        )
        return passed(NAME, evidence, w.name, **data)
    if ran.matched:
        evidence = (
            f"{seen.stored_events} BlockStored after the probe on {where}, but the engine "
            "has no POST /tokenize to match their token ids"
        )
        return warned(NAME, evidence, w.name, **data)
    return _not_seen(ctx, w, ran, where, data)


def _not_seen(ctx: Context, w: WorkerFacts, ran: Ran, where: str, data: dict[str, int]) -> Result:
    bad = next((a for a in ran.answers if not a.ok), None)
    if bad is not None:
        fix = f"the worker must serve POST /v1/completions for model {w.model!r}: see its log"
        return failed(NAME, f"the probe request failed: {bad.describe()}", fix, w.name, **data)
    seen = ran.tap.seen
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
        f"{len(ran.answers)} probe requests of {data['probe_tokens'] or '?'} tokens"
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
