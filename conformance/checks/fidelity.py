"""Check 5: index fidelity. Over a capacity-bound workload (>= 200 requests, shared
documents and system prompts, LoRA and cache_salt tenants, eviction all along), the overlap
kvroute's index predicts for the worker before each request equals what the engine then
reports as cached (`usage.prompt_tokens_details.cached_tokens`, in blocks) for >= 99% of
requests. vLLM never serves a prompt's last token from cache, so the prediction is
min(overlap, (prompt_len - 1) // block_size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.client import client, complete, reset_prefix_cache
from conformance.observe import Observer
from conformance.registry import Findings, check
from conformance.scenarios import BLOCK
from conformance.session import Context
from conformance.targets import CACHE_SALT, CACHED_TOKENS, KV_EVENTS, LORA, REPLAY, RESET, Engine
from conformance.traffic import token_source, tokens

REQUESTS = 220
REQUIRED_RATIO = 0.99


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    lora: bool = False
    salt: str | None = None


def workload(n: int = REQUESTS, seed: str = "fidelity") -> list[Request]:
    """Zipf-ish picks among 10 documents (2-6 blocks, some not block-aligned), half behind a
    shared system prompt, suffixes of 0-63 tokens (0 makes block-aligned prompts), 10% LoRA,
    10% salted, 5% long one-off prompts that flush much of the cache."""
    rng = token_source(seed)
    system = tokens(rng, BLOCK + 11)
    docs = [tokens(rng, rng.randint(2, 6) * BLOCK + rng.choice((0, 0, 5, 17))) for _ in range(10)]
    weights = [1 / (k + 1) for k in range(len(docs))]
    out = []
    for _ in range(n):
        if rng.random() < 0.05:
            out.append(Request(tokens(rng, rng.randint(15, 25) * BLOCK + 3)))
            continue
        doc = rng.choices(docs, weights)[0]
        prefix = (system if rng.random() < 0.5 else []) + doc
        suffix = tokens(rng, rng.choice((0, 0, rng.randrange(1, 64))))
        salt = rng.choice(("tenant-a", "tenant-b")) if rng.random() < 0.1 else None
        out.append(Request(prefix + suffix, lora=rng.random() < 0.1, salt=salt))
    return out


async def _one(engine: Engine, http: Any, obs: Observer, i: int, r: Request) -> dict[str, Any]:
    lora_name = engine.lora_name if r.lora else None
    ns = obs.namespace(lora_name, r.salt)
    overlap = obs.overlap(r.tokens, ns)
    predicted = min(overlap, (len(r.tokens) - 1) // BLOCK)
    model = lora_name or engine.model
    done = await complete(http, model, r.tokens, cache_salt=r.salt)
    await obs.wait_blocks(r.tokens, ns, len(r.tokens) // BLOCK)
    return {
        "i": i,
        "prompt_tokens": len(r.tokens),
        "lora": r.lora,
        "cache_salt": r.salt,
        "kvroute_overlap": overlap,
        "predicted_blocks": predicted,
        "engine_cached_blocks": done.cached_tokens // BLOCK,
        "engine_cached_tokens": done.cached_tokens,
    }


@check(
    "index-fidelity",
    f"over {REQUESTS} capacity-bound requests with shared prefixes, kvroute's predicted "
    f"overlap equals the engine's cached_tokens (in blocks) for >= {REQUIRED_RATIO:.0%}",
    needs=(KV_EVENTS, REPLAY, RESET, CACHED_TOKENS, LORA, CACHE_SALT),
    engines=("main",),
)
async def index_fidelity(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    rows = []
    async with (
        client(engine.url) as http,
        Observer(
            engine.events_endpoint, engine.replay_endpoint, engine.topic, block_size=BLOCK
        ) as obs,
    ):
        await reset_prefix_cache(http)
        for i, r in enumerate(workload()):
            rows.append(await _one(engine, http, obs, i, r))
        counters = obs.counter_summary()
    _judge(f, rows, counters, engine.spec.num_gpu_blocks)


def _judge(f: Findings, rows: list[dict[str, Any]], counters: dict[str, Any], kv: int) -> None:
    bad = [r for r in rows if r["predicted_blocks"] != r["engine_cached_blocks"]]
    ratio = (len(rows) - len(bad)) / len(rows) if rows else 0.0
    hits = sum(1 for r in rows if r["engine_cached_blocks"])
    f.note("requests", len(rows))
    f.note("matches", len(rows) - len(bad))
    f.note("ratio", round(ratio, 4))
    f.note("mismatches", bad)
    f.note("requests_with_cache_hits", hits)
    f.note("cached_blocks_total", sum(r["engine_cached_blocks"] for r in rows))
    f.note("kv_blocks", kv)
    f.note("live_index_counters", counters)
    f.require(len(rows) >= 200, f"only {len(rows)} requests ran")
    f.require(ratio >= REQUIRED_RATIO, f"ratio {ratio:.4f} < {REQUIRED_RATIO} ({len(bad)} off)")
    f.require(
        counters["blocks_removed"] > 0, "no eviction happened: the workload is not capacity-bound"
    )
    f.require(
        hits >= len(rows) // 4,
        f"only {hits} requests hit the cache: the workload shares too little",
    )
    f.require(counters["unknown_parent"] == 0, f"{counters['unknown_parent']} unresolved parents")
