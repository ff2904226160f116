"""Through the router, as a client: a repeated prefix must come back to its worker, cached
and faster; a burst of distinct prompts must not pile onto one worker."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter

from router.check.context import Context
from router.check.httpio import Streamed, stream_completion
from router.check.model import Finding, Result, Status, failed, passed, verdict, warned
from router.check.prompts import fresh_text, sized_text

ROUTING_FIX = (
    "routing does not follow the cache: fix the FAILs above (events, block size, tokenizer) "
    "and run kvroute serve with --policy kv"
)
SPREAD_WORDS = 48


async def _send(ctx: Context, prompt: str, max_tokens: int) -> Streamed:
    body = {"model": ctx.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return await stream_completion(
        ctx.http,
        ctx.base + "/v1/completions",
        body,
        worker_header=ctx.opts.worker_header,
        timeout=ctx.opts.timeout_s,
    )


async def _count(ctx: Context, text: str) -> int | None:
    """Prompt tokens, as the router counts them (its /debug/route), else as a worker does."""
    got = await ctx.router_call("POST", "/debug/route", {"model": ctx.model, "prompt": text})
    if got.ok and isinstance(got.body, dict) and isinstance(got.body.get("prompt_tokens"), int):
        return int(got.body["prompt_tokens"])
    for w in ctx.workers:
        tokens = await ctx.count_tokens(w, text) if w.reachable else None
        if tokens:
            return len(tokens)
    return None


def _prompt_tokens(ctx: Context) -> int:
    limits = [w.max_model_len for w in ctx.workers if w.max_model_len]
    return max(min([ctx.opts.prompt_tokens, *(n - 64 for n in limits)]), 64)


# ---- repeat-prefix --------------------------------------------------------------------------


async def check_repeat_prefix(ctx: Context) -> Result:
    """`pairs` fresh long prompts, each sent twice: the second lands on the same worker, is
    served from cache, and reaches its first token faster by `margin` (medians)."""
    target = _prompt_tokens(ctx)
    pairs: list[tuple[Streamed, Streamed]] = []
    for _ in range(ctx.opts.pairs):
        text = await sized_text(target, lambda t: _count(ctx, t), "repeat")
        cold = await _send(ctx, text, 2)
        warm = await _send(ctx, text, 2)
        pairs.append((cold, warm))
        if cold.error or warm.error:
            break
    return _judge_repeat(ctx, pairs, target)


def _judge_repeat(ctx: Context, pairs: list[tuple[Streamed, Streamed]], target: int) -> Result:
    broken = next((s for p in pairs for s in p if s.error or s.ttft_s is None), None)
    if broken is not None:
        evidence = f"a request through the router failed: HTTP {broken.status} {broken.error}"
        return failed("repeat-prefix", evidence, "see the router's log and GET /health")
    cold = statistics.median(c.ttft_s or 0.0 for c, _ in pairs) * 1000
    warm = statistics.median(w.ttft_s or 0.0 for _, w in pairs) * 1000
    ratio = cold / warm if warm > 0 else float("inf")
    evidence = (
        f"{len(pairs)} pairs of ~{pairs[0][0].prompt_tokens or target}-token prompts: TTFT "
        f"p50 cold {cold:.0f} ms, warm {warm:.0f} ms ({ratio:.1f}x, margin {ctx.opts.margin:g}x)"
    )
    findings = [
        *_same_worker(ctx, pairs),
        *_cached(pairs),
        *_faster(ctx, ratio),
    ]
    return verdict(
        "repeat-prefix",
        evidence,
        findings,
        pairs=len(pairs),
        cold_ms=round(cold, 1),
        warm_ms=round(warm, 1),
        speedup=round(ratio, 2),
    )


def _same_worker(ctx: Context, pairs: list[tuple[Streamed, Streamed]]) -> list[Finding]:
    if any(c.worker is None or w.worker is None for c, w in pairs):
        text = f"responses carry no {ctx.opts.worker_header} header: cannot tell where they went"
        return [Finding(Status.WARN, text + " (set --worker-header)")]
    moved = [f"{c.worker} -> {w.worker}" for c, w in pairs if c.worker != w.worker]
    if moved:
        text = f"the repeat went to another worker in {len(moved)}/{len(pairs)} pairs ({moved[0]})"
        return [Finding(Status.FAIL, text, ROUTING_FIX)]
    workers = ", ".join(sorted({str(c.worker) for c, _ in pairs}))
    return [Finding(Status.PASS, f"every repeat on its first worker ({workers})")]


def _cached(pairs: list[tuple[Streamed, Streamed]]) -> list[Finding]:
    warm = [w for _, w in pairs]
    reported = [w.cached_tokens for w in warm if w.cached_tokens is not None]
    if not reported:
        return [
            Finding(
                Status.WARN,
                "the engine reports no cached_tokens (start vLLM with "
                "--enable-prompt-tokens-details to see them)",
            )
        ]
    if min(reported) <= 0:
        misses = sorted({str(w.worker) for w in warm if w.cached_tokens == 0})
        count = sum(1 for n in reported if n <= 0)
        text = f"{count}/{len(reported)} repeats report 0 cached tokens (on {', '.join(misses)})"
        return [
            Finding(Status.FAIL, text, "start vLLM with --enable-prefix-caching; " + ROUTING_FIX)
        ]
    return [Finding(Status.PASS, f"repeats report {min(reported)}..{max(reported)} cached tokens")]


def _faster(ctx: Context, ratio: float) -> list[Finding]:
    if ratio >= ctx.opts.margin:
        return []
    text = f"the repeat's first token is not {ctx.opts.margin:g}x faster"
    fix = (
        "if the repeats were cached, the prompt is too short to dominate time to first token "
        "on this engine: raise --prompt-tokens (or lower --margin); otherwise " + ROUTING_FIX
    )
    return [Finding(Status.FAIL, text, fix)]


# ---- load-spread ----------------------------------------------------------------------------


IDLE_WAIT_S = 3.0


async def _busy(ctx: Context) -> dict[str, float] | None:
    """Each worker's load as the router sees it (in-flight requests + decode blocks, local or
    scraped from the engine), once it reads zero everywhere or after a short wait: a scrape
    taken during an earlier check's request makes a worker look busy for a moment. None when
    the router's /debug/route is out of reach."""
    deadline = time.perf_counter() + min(ctx.opts.timeout_s, IDLE_WAIT_S)
    while True:
        got = await ctx.router_call("POST", "/debug/route", {"model": ctx.model, "prompt": "x"})
        if not got.ok or not isinstance(got.body, dict):
            return None
        load = {
            str(w.get("worker")): float(w.get("requests_in_flight") or 0)
            + float(w.get("decode_blocks") or 0)
            for w in got.body.get("workers") or []
            if isinstance(w, dict)
        }
        if not any(load.values()) or time.perf_counter() > deadline:
            return load
        await asyncio.sleep(0.1)


async def check_load_spread(ctx: Context) -> Result:
    """A burst of distinct fresh prompts, sent at once to an idle fleet, does not all land on
    one worker."""
    entries = ctx.router.entries
    available = len(ctx.router.in_rotation) if entries else len(ctx.workers)
    drained = ctx.router.draining
    skipped = f" ({', '.join(drained)} draining, skipped)" if drained else ""
    if available < 2:
        text = f"{available} worker in rotation{skipped}: nothing to spread over"
        return warned("load-spread", text)
    before = await _busy(ctx)
    prompts = [fresh_text(SPREAD_WORDS, "spread") for _ in range(ctx.opts.burst)]
    sent = await asyncio.gather(*(_send(ctx, p, 8) for p in prompts))
    broken = next((s for s in sent if s.error), None)
    if broken is not None:
        evidence = f"a burst request failed: HTTP {broken.status} {broken.error}"
        return failed("load-spread", evidence, "see the router's log and GET /health")
    over = f"{available} workers"
    if entries and len(entries) != ctx.router.worker_count:
        # the router routes to each data-parallel rank on its own: a spread over ranks counts
        over = f"{available} endpoints of {ctx.router.worker_count} workers"
    return _judge_spread(ctx, sent, over + skipped, before)


def _judge_spread(
    ctx: Context, sent: list[Streamed], over: str, before: dict[str, float] | None
) -> Result:
    placed = Counter(s.worker or "?" for s in sent)
    spread = ", ".join(f"{w} {n}" for w, n in placed.most_common())
    evidence = f"{len(sent)} distinct prompts at once over {over}: {spread}"
    if "?" in placed:
        return warned("load-spread", evidence + f" (no {ctx.opts.worker_header} header)")
    if len(placed) > 1:
        return passed("load-spread", evidence, placement=dict(placed))
    busy = {w: n for w, n in (before or {}).items() if n}
    if busy:
        text = f"; but the router saw load before the burst ({busy}): rerun when the fleet is idle"
        return warned("load-spread", evidence + text, placement=dict(placed))
    fix = (
        "the router piles new prefixes onto one worker: run --policy kv with a non-zero "
        "scoring.weights.load (default 0.5)"
    )
    return failed("load-spread", evidence, fix, placement=dict(placed))
