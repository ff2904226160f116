"""Router and engine must agree: block size, tokens, and the router's index must fill."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.check.checks_router import admin_fix
from router.check.context import Context, WorkerFacts
from router.check.httpio import Fetched
from router.check.model import Finding, Result, Status, failed, passed, verdict, warned
from router.check.prompts import TOKENIZER_CHAT, TOKENIZER_TEXT

# ---- block-size -----------------------------------------------------------------------------


async def check_block_size(ctx: Context, w: WorkerFacts) -> Result:
    """The router hashes a worker's prompts in blocks of the size the engine caches them in."""
    now = await ctx.once("admin-now", lambda: ctx.router_call("GET", "/admin/workers"))
    sizes = _block_sizes(w, now)
    known = {k: v for k, v in sizes.items() if v is not None}
    evidence = ", ".join(f"{k} {v}" for k, v in known.items()) or "no block size known"
    problems = w.problems("block size")
    values = set(known.values())
    if len(values) > 1 or problems:
        return _mismatch(w, sizes, evidence, problems)
    if len(known) < 2 or "router" not in known:
        return warned("block-size", f"cannot compare: only {evidence}", w.name, **known)
    return passed("block-size", f"all agree: {evidence}", w.name, **known)


def _block_sizes(w: WorkerFacts, now: Fetched) -> dict[str, int | None]:
    entry_now = next((e for e in _entries(now) if e.get("name") == w.name), None)
    events = sorted(w.observed.block_sizes) if w.observed else []
    return {
        "router": _int((w.entry or {}).get("block_size")),
        "router after probes": _int((entry_now or {}).get("block_size")),
        "events": events[-1] if len(events) == 1 else None,
        "engine cache_config": w.metrics.block_size if w.metrics else None,
    }


def _entries(f: Fetched) -> list[dict[str, Any]]:
    doc = f.body if f.ok and isinstance(f.body, dict) else {}
    return [e for e in doc.get("workers") or [] if isinstance(e, dict)]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _mismatch(
    w: WorkerFacts, sizes: dict[str, int | None], evidence: str, problems: list[str]
) -> Result:
    truth = sizes["engine cache_config"] or sizes["events"]
    router = sizes["router"]
    text = f"mismatch: {evidence}" + (f"; the router says: {problems[0]}" if problems else "")
    if truth is None or router is None or router == truth:
        fix = "make every worker's engine use one --block-size and let the router learn it"
    else:
        fix = (
            f"the router must hash {w.name}'s prompts in blocks of {truth}: remove "
            f"--block-size {router} / this worker's block_size: {router} from the router config "
            f"(it learns the size) or set it to {truth}; or start vLLM with --block-size {router}"
        )
    return failed("block-size", text, fix, w.name)


# ---- tokenizer ------------------------------------------------------------------------------

COUNTS_ONLY = "token counts only: the router's /debug/route returns no prompt_token_ids"
TOKENIZER_FIX = (
    "point kvroute serve --tokenizer at the tokenizer folder the engine loads (tokenizer.json "
    "and tokenizer_config.json with its chat_template), or use --tokenizer remote"
)


async def _router_tokens(ctx: Context) -> dict[str, Fetched]:
    bodies = {
        "completion": {"model": ctx.model, "prompt": TOKENIZER_TEXT},
        "chat": {"model": ctx.model, "messages": TOKENIZER_CHAT},
    }
    got = await asyncio.gather(
        *(ctx.router_call("POST", "/debug/route?tokens=1", b) for b in bodies.values())
    )
    return dict(zip(bodies, got, strict=True))


async def _worker_tokens(ctx: Context, w: WorkerFacts) -> dict[str, Fetched]:
    bodies = {
        "completion": {"model": w.model, "prompt": TOKENIZER_TEXT},
        "chat": {"model": w.model, "messages": TOKENIZER_CHAT, "add_generation_prompt": True},
    }
    got = await asyncio.gather(
        *(ctx.worker_call(w, "POST", "/tokenize", b) for b in bodies.values())
    )
    return dict(zip(bodies, got, strict=True))


async def check_tokenizer(ctx: Context, w: WorkerFacts) -> Result:
    """The router's tokens for a completion prompt and a chat conversation (with the
    generation prompt) equal the worker's own /tokenize."""
    mine = await ctx.once("router-tokens", lambda: _router_tokens(ctx))
    theirs = await _worker_tokens(ctx, w)
    findings = [_compare(kind, mine[kind], theirs[kind]) for kind in mine]
    if any(_counts_only(f) for f in mine.values()):
        findings.append(Finding(Status.PASS, COUNTS_ONLY))
    findings += [
        Finding(Status.FAIL, f"the router says: {p.split('; ')[0]}", TOKENIZER_FIX)
        for p in w.problems("tokenizer")
    ]
    return verdict("tokenizer", "router vs worker POST /tokenize", findings, w.name)


def _counts_only(router: Fetched) -> bool:
    return router.ok and isinstance(router.body, dict) and "prompt_token_ids" not in router.body


def _compare(kind: str, router: Fetched, worker: Fetched) -> Finding:
    if not router.ok or not isinstance(router.body, dict):
        fix = admin_fix(router)
        hint = f" ({fix})" if fix else ""
        return Finding(Status.WARN, f"{kind}: router's /debug/route: {router.describe()}{hint}")
    tokens = worker.body.get("tokens") if worker.ok and isinstance(worker.body, dict) else None
    if not isinstance(tokens, list):
        return Finding(Status.WARN, f"{kind}: worker's POST /tokenize: {worker.describe()}")
    ids = router.body.get("prompt_token_ids")
    if isinstance(ids, list):
        return _compare_ids(kind, ids, tokens)
    count = router.body.get("prompt_tokens")
    if count == len(tokens):
        return Finding(Status.PASS, f"{kind}: {count} tokens on both")
    return Finding(
        Status.FAIL,
        f"{kind}: the router makes {count} tokens, the worker {len(tokens)}",
        TOKENIZER_FIX,
    )


def _compare_ids(kind: str, mine: list[Any], theirs: list[Any]) -> Finding:
    if mine == theirs:
        return Finding(Status.PASS, f"{kind}: {len(mine)} token ids identical")
    at = next(
        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
        min(len(mine), len(theirs)),
    )
    text = (
        f"{kind}: the router makes {len(mine)} tokens, the worker {len(theirs)}; first "
        f"difference at {at}: router {mine[at : at + 4]} vs worker {theirs[at : at + 4]}"
    )
    return Finding(Status.FAIL, text, TOKENIZER_FIX)


# ---- index ----------------------------------------------------------------------------------

INDEX_WAIT_S = 3.0
SAMPLES = {
    "kvroute_index_blocks": "index",
    "kvroute_kv_events_total": "events",
    "kvroute_kv_sequence_gaps_total": "gaps",
    "kvroute_kv_malformed_total": "malformed",
    "kvroute_kv_resyncs_total": "resyncs",
}


def router_samples(text: str, worker: str) -> dict[str, float]:
    """The router's per-worker index size and event counters from its /metrics."""
    out = dict.fromkeys(SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SAMPLES and s.labels.get("worker") == worker:
                out[SAMPLES[s.name]] += s.value
    return out


async def _index_samples(ctx: Context, w: WorkerFacts) -> tuple[Fetched, dict[str, float]]:
    """Poll briefly: the router applies the probe's events on its own schedule."""
    wait = 0.0 if w.mode_setting == "approx" else min(ctx.opts.timeout_s, INDEX_WAIT_S)
    deadline = time.perf_counter() + wait
    while True:
        got = await ctx.router_metrics()
        values = router_samples(got.text, w.name) if got.ok else {}
        if not got.ok or values["index"] > 0 or time.perf_counter() > deadline:
            return got, values
        await asyncio.sleep(0.1)


async def check_index(ctx: Context, w: WorkerFacts) -> Result:
    """After the probes the router's index holds blocks for the worker, and its event stream
    shows no malformed payloads, gaps or resyncs."""
    got, v = await _index_samples(ctx, w)
    if not got.ok:
        return warned("index", f"cannot read the router's GET /metrics: {got.describe()}", w.name)
    evidence = (
        f"router index {v['index']:.0f} blocks, {v['events']:.0f} events applied, "
        f"gaps {v['gaps']:.0f}, malformed {v['malformed']:.0f}, resyncs {v['resyncs']:.0f}"
    )
    findings = [*_index_findings(w, v), *_stream_findings(v)]
    return verdict("index", evidence, findings, w.name, **{k: int(x) for k, x in v.items()})


def _index_findings(w: WorkerFacts, v: dict[str, float]) -> list[Finding]:
    if w.mode_setting == "approx":
        text = "the router routes this worker in approx mode (no events)"
        if w.observed is not None and w.observed.stored_events:
            text += ", though the engine publishes them: kvroute serve --mode auto would use them"
        return [Finding(Status.WARN, text)]
    if v["index"] > 0:
        return []
    saw = w.observed.stored_events if w.observed else 0
    if saw:
        text = f"empty, though router-check saw {saw} BlockStored from the engine"
        fix = (
            f"the router does not ingest this worker's events: it dials "
            f"{w.router_endpoint or 'no endpoint'}; see events-endpoint"
        )
    else:
        text = "empty: no KV events reach it"
        fix = "make the engine publish KV events (see events-config and events-flowing)"
    return [Finding(Status.FAIL, text, fix)]


def _stream_findings(v: dict[str, float]) -> list[Finding]:
    out = []
    if v["malformed"]:
        fix = "the router cannot decode this engine's KV events: use a kvroute release for it"
        out.append(Finding(Status.FAIL, "malformed event batches were dropped", fix))
    if v["gaps"] or v["resyncs"]:
        out.append(
            Finding(
                Status.WARN,
                "events were lost (gaps/resyncs): check the replay "
                "endpoint and the publisher's hwm / the router's load",
            )
        )
    return out
