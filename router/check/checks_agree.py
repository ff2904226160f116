"""Router and engine must agree: block size, tokens, and the router's index must fill."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.check.checks_router import admin_fix
from router.check.context import Context
from router.check.httpio import Fetched
from router.check.model import Finding, Result, Status, failed, passed, verdict, warned
from router.check.prompts import TOKENIZER_CHAT, TOKENIZER_TEXT
from router.check.workerfacts import Publisher, WorkerFacts

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
    """Each source's block size: one value where the worker's ranks agree, one per rank
    where they do not (each rank's feed learns its own)."""
    mine = {r.name: r.label for r in w.ranks}
    after = {mine[str(e.get("name"))]: e for e in _entries(now) if e.get("name") in mine}
    events = {p.label: _only(w.seen[p.name].block_sizes) for p in w.publishers if p.name in w.seen}
    return {
        **_agreed("router", {r.label: _int(r.entry.get("block_size")) for r in w.ranks}),
        **_agreed("router after probes", {k: _int(e.get("block_size")) for k, e in after.items()}),
        **_agreed("events", events),
        "engine cache_config": w.metrics.block_size if w.metrics else None,
    }


def _agreed(source: str, by_rank: dict[str, int | None]) -> dict[str, int | None]:
    values = {v for v in by_rank.values() if v is not None}
    if len(values) <= 1:
        return {source: next(iter(values), None)}
    return {f"{source} {rank}": v for rank, v in by_rank.items()}


def _only(sizes: set[int]) -> int | None:
    """The block size a tap saw, if it saw exactly one."""
    return next(iter(sizes)) if len(sizes) == 1 else None


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


Samples = dict[str, dict[str, float]]  # endpoint -> the router's samples for it


def router_samples(text: str, *workers: str) -> dict[str, float]:
    """The router's index size and event counters from its /metrics for `workers` (a
    worker's endpoints: itself, or each of its data-parallel ranks), summed."""
    return _summed(endpoint_samples(text), workers)


def endpoint_samples(text: str) -> Samples:
    """The same, per endpoint (the `worker` label)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            worker = s.labels.get("worker")
            if s.name in SAMPLES and worker is not None:
                values = out.setdefault(worker, dict.fromkeys(SAMPLES.values(), 0.0))
                values[SAMPLES[s.name]] += s.value
    return out


def _summed(per: Samples, endpoints: Iterable[str]) -> dict[str, float]:
    names = list(endpoints)
    return {k: sum(per.get(name, {}).get(k, 0.0) for name in names) for k in SAMPLES.values()}


async def _index_samples(ctx: Context, w: WorkerFacts) -> tuple[Fetched, Samples]:
    """Poll briefly: the router applies the probe's events on its own schedule."""
    wait = 0.0 if w.mode_setting == "approx" else min(ctx.opts.timeout_s, INDEX_WAIT_S)
    deadline = time.perf_counter() + wait
    while True:
        got = await ctx.router_metrics()
        per = endpoint_samples(got.text) if got.ok else {}
        if not got.ok or _filled(w, per) or time.perf_counter() > deadline:
            return got, per
        await asyncio.sleep(0.1)


def _filled(w: WorkerFacts, per: Samples) -> bool:
    """Every rank router-check saw publish has blocks; without any seen, the worker has."""
    seen = [p.name for p in w.publishers if _saw(w, p.name)]
    if seen:
        return all(_index(per, name) > 0 for name in seen)
    return any(_index(per, name) > 0 for name in _endpoints(w))


def _endpoints(w: WorkerFacts) -> list[str]:
    """The names the router's metrics give the worker's engines."""
    return [r.name for r in w.ranks] or [p.name for p in w.publishers] or [w.name]


def _index(per: Samples, name: str) -> float:
    return per.get(name, {}).get("index", 0.0)


def _saw(w: WorkerFacts, name: str) -> int:
    """BlockStored events router-check's own probe saw from this engine."""
    seen = w.seen.get(name)
    return seen.stored_events if seen is not None else 0


async def check_index(ctx: Context, w: WorkerFacts) -> Result:
    """After the probes the router's index holds blocks for the worker (for each of its
    data-parallel ranks the probes reached), and its event stream shows no malformed
    payloads, gaps or resyncs."""
    got, per = await _index_samples(ctx, w)
    if not got.ok:
        return warned("index", f"cannot read the router's GET /metrics: {got.describe()}", w.name)
    v = _summed(per, _endpoints(w))
    evidence = (
        f"router index {v['index']:.0f} blocks, {v['events']:.0f} events applied, "
        f"gaps {v['gaps']:.0f}, malformed {v['malformed']:.0f}, resyncs {v['resyncs']:.0f}"
    )
    findings = [*_index_findings(w, per, v), *_stream_findings(v)]
    return verdict("index", evidence, findings, w.name, **{k: int(x) for k, x in v.items()})


def _index_findings(w: WorkerFacts, per: Samples, v: dict[str, float]) -> list[Finding]:
    if w.mode_setting == "approx":
        text = "the router routes this worker in approx mode (no events)"
        if w.observed is not None and w.observed.stored_events:
            text += ", though the engine publishes them: kvroute serve --mode auto would use them"
        return [Finding(Status.WARN, text)]
    missed = [p for p in w.publishers if _saw(w, p.name) and _index(per, p.name) <= 0]
    if missed:
        return [_not_ingested(p, _saw(w, p.name)) for p in missed]
    if v["index"] > 0:
        return []
    text = "empty: no KV events reach it"
    fix = "make the engine publish KV events (see events-config and events-flowing)"
    return [Finding(Status.FAIL, text, fix)]


def _not_ingested(p: Publisher, saw: int) -> Finding:
    """The engine published the probe's blocks, yet the router's index has none of them."""
    whose = f"{p.label} " if p.label else ""
    text = f"{whose}empty, though router-check saw {saw} BlockStored from the engine"
    fix = (
        f"the router does not ingest {'this worker' if not p.label else p.label}'s events: it "
        f"dials {p.router or 'no endpoint'}; see events-endpoint"
    )
    return Finding(Status.FAIL, text, fix)


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
