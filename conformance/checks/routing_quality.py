"""Check: routing quality on the suite's own two engines. One prefix-repetition workload
(router.bench.workloads, driven by the routing bench's client) runs through kvroute (KV
events), round robin (kvroute's own policy, the baseline), sglang-router's and vllm-router's
cache_aware (router.bench.targets starts them, as the bench does), each on caches reset in
between.
The measure is the engines' own: the fraction of prompt tokens they report cached
(`usage.prompt_tokens_details.cached_tokens`), with their /metrics prefix-cache counters
and requests per worker alongside.

kvroute must clear round robin by MARGIN and come within PEER_SLACK of each peer.
A peer that cannot be installed is reported; with KVROUTE_NO_SKIPS=1 (CI) it fails the check.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import statistics
from typing import Any

from conformance.client import client, reset_prefix_cache
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import CACHED_TOKENS, KV_EVENTS, RESET, Engine
from router.bench import peers
from router.bench.driver import Sample, drive, engine_counters
from router.bench.ideal import ideal_fraction
from router.bench.routing import run_row
from router.bench.targets import TARGETS
from router.bench.workloads import Repetition, Workload, prefix_repetition, texts_for

log = logging.getLogger("kvroute.conformance")

PEERS = ("sglang-router-cache_aware", "vllm-router-cache_aware")
ROUTERS = ("kvroute", "round_robin", *PEERS)
# 6 prefixes of ~500 tokens (16 blocks of 32) x 4 requests with distinct ~24-token tails,
# 4 in flight, on two engines of 127 usable blocks. Kept on one engine each, the prefixes fit
# in a 4/2 split with nothing lost and a 5/1 split losing ~0.01, so two KV-aware routers that
# split them differently still score alike (a 900-token shape made a 4/2 split cost 0.05,
# and kvroute and sglang-router each drew 3/3 or 4/2 by timing). Spread over both engines,
# every prefix is prefilled cold on each, and each engine churns through all 6 and the tails.
SHAPE = Repetition(
    prefixes=6,
    per_prefix=4,
    prefix_len=500,
    suffix_len=24,
    concurrency=4,
    workers=2,
    kv_blocks=128,
    block_size=32,
    output_len=8,
)
SEEDS = (0, 1)  # two orders of the same texts (48 requests): the figure is their mean
# Measured on real vLLM here, 2 cores, 8 runs of each order: kvroute 0.608 (the
# capacity-aware ideal) every time, whatever its split (3/3, 4/2, 5/1); sglang-router 0.608,
# once 0.551 (all on one engine); round robin 0.374-0.474 per order, 0.42-0.44 as the mean of
# the two the check compares (0.396-0.411 in later CI runs). The margin is well under that
# gap (>= 0.17), so a noisy run passes, yet a router that ignores the cache cannot.
MARGIN = 0.10
PEER_SLACK = 0.02
Row = dict[str, Any]


def workloads() -> list[Workload]:
    """The workload once per order (seed): the same prompts, shuffled differently."""
    name = "routing-quality"
    return [prefix_repetition(texts_for(name), seed, SHAPE, name) for seed in SEEDS]


def _worker(e: Engine) -> dict[str, Any]:
    """An engine as the bench's targets describe a worker."""
    return {
        "url": e.url,
        "block_size": e.block_size,
        "events_endpoint": e.events_endpoint,
        "replay_endpoint": e.replay_endpoint,
    }


@check(
    "routing-quality",
    "one prefix-repetition workload on two engines through kvroute, round robin, "
    "sglang-router and vllm-router cache_aware (caches reset in between): kvroute's "
    f"engine-reported cached fraction beats round robin's by >= {MARGIN} and is within "
    f"{PEER_SLACK} of each peer's",
    needs=(KV_EVENTS, RESET, CACHED_TOKENS),
    engines=("main", "peer"),
    timeout_s=1200.0,  # the first run may pip-install the peers
)
async def routing_quality(ctx: Context, f: Findings) -> None:
    engines = [await ctx.engine("main"), await ctx.engine("peer")]
    f.require(
        all(e.block_size == SHAPE.block_size for e in engines)
        and all(e.spec.num_gpu_blocks == SHAPE.kv_blocks for e in engines),
        "engine specs changed: the workload is sized for 128 blocks of 32 tokens",
    )
    loads = workloads()
    f.note("workload", _describe(loads))
    installed = await asyncio.to_thread(peers.ensure_peers, ["sglang-router", "vllm-router"])
    rows: dict[str, Row] = {}
    for name in ROUTERS:
        peer = TARGETS[name].peer
        if peer is not None and installed.get(peer) is None:
            rows[name] = {"skipped": f"{peer} is not installed and could not be installed"}
            continue
        rows[name] = await _router_runs(name, loads, engines)
        log.info("routing-quality: %s cached %.3f", name, rows[name]["cached_fraction"])
    f.note("routers", rows)
    _judge(f, rows)


def _describe(loads: list[Workload]) -> dict[str, Any]:
    return {
        "shape": SHAPE.__dict__,
        "orders": list(SEEDS),
        "requests": sum(len(w.requests) for w in loads),
        "ideal_cached_fraction": round(statistics.fmean(ideal_fraction(w) for w in loads), 4),
    }


async def _router_runs(name: str, loads: list[Workload], engines: list[Engine]) -> Row:
    """One router over every order, each run on a fresh router and cold caches."""
    runs = [await _measure(name, w, engines) for w in loads]
    return {
        "cached_fraction": round(statistics.fmean(r["cached_fraction"] for r in runs), 4),
        "errors": sum(r["errors"] for r in runs),
        "error_texts": [t for r in runs for t in r["error_texts"]],
        "runs": runs,
    }


async def _measure(name: str, w: Workload, engines: list[Engine]) -> Row:
    """One run on a fresh router and cold caches: the engines' answers and counters."""
    for e in engines:
        async with client(e.url) as http:
            await reset_prefix_cache(http)
    workers = [_worker(e) for e in engines]
    stack = contextlib.ExitStack()
    atexit.register(stack.close)  # the routers are plain children: stop them on any exit
    try:
        launch = TARGETS[name].launch(workers, w.seed)
        urls = await asyncio.to_thread(stack.enter_context, launch)
        before = await asyncio.to_thread(_counters, engines)
        result = await drive(w, urls, model=engines[0].model)
        after = await asyncio.to_thread(_counters, engines)
    finally:
        await asyncio.to_thread(stack.close)
        atexit.unregister(stack.close)
    row = run_row(result)
    row["cached_fraction"] = round(row["cached_fraction"], 4)
    row["ttft_ms"] = {k: round(v, 1) for k, v in row["ttft_ms"].items()}
    row["itl_ms_p90"] = round(row["itl_ms_p90"], 1)
    row["error_texts"] = result.error_texts
    row["placement"] = _placement(result.samples)
    row.update(_engine_view(before, after))
    return row


def _placement(samples: list[Sample]) -> dict[str, list[str]]:
    """The engines each prefix went to, from kvroute's x-kvroute-worker header (peers send
    none: empty)."""
    out: dict[str, set[str]] = {}
    for s in samples:
        if s.worker:
            out.setdefault(s.group, set()).add(s.worker)
    return {group: sorted(workers) for group, workers in sorted(out.items())}


def _counters(engines: list[Engine]) -> list[dict[str, float]]:
    return [engine_counters(e.url) for e in engines]


def _engine_view(before: list[dict[str, float]], after: list[dict[str, float]]) -> Row:
    """What the engines' /metrics saw during the drive: requests each, prefix-cache hits."""

    def delta(key: str) -> list[float]:
        return [a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True)]

    hits = sum(delta("vllm:prefix_cache_hits_total"))
    queries = sum(delta("vllm:prefix_cache_queries_total"))
    return {
        "requests_per_worker": [int(x) for x in delta("vllm:request_success_total")],
        "metrics_hit_fraction": round(hits / queries, 4) if queries else None,
    }


def _judge(f: Findings, rows: dict[str, Row]) -> None:
    for name, row in rows.items():
        if "skipped" in row:
            _peer_missing(f, name, row["skipped"])
        else:
            f.require(row["errors"] == 0, f"{name}: {row['errors']} errors: {row['error_texts']}")
    kv, rr = rows["kvroute"]["cached_fraction"], rows["round_robin"]["cached_fraction"]
    f.note("cached_fraction", {n: r.get("cached_fraction") for n, r in rows.items()})
    f.require(
        kv >= rr + MARGIN,
        f"kvroute's cached fraction {kv:.3f} is not {MARGIN} above round robin's {rr:.3f}",
    )
    _judge_spread(f, rows["kvroute"])
    for name in PEERS:
        theirs = rows[name].get("cached_fraction")
        if theirs is not None:
            f.require(
                kv >= theirs - PEER_SLACK,
                f"kvroute's cached fraction {kv:.3f} is below {name}'s {theirs:.3f} "
                f"by more than {PEER_SLACK}",
            )


def _judge_spread(f: Findings, row: Row) -> None:
    """Every prefix also fits one engine: kvroute must not win by piling all on one."""
    for run in row.get("runs", []):
        served = run["requests_per_worker"]
        f.require(
            min(served) >= SHAPE.per_prefix,
            f"kvroute left an engine (almost) idle: requests per engine {served}",
        )


def _peer_missing(f: Findings, name: str, why: str) -> None:
    """Outside CI a missing peer is reported and the rest still judged; in CI
    (KVROUTE_NO_SKIPS=1) a comparison left out is not a pass."""
    f.note(f"{name}_missing", why)
    if os.environ.get("KVROUTE_NO_SKIPS") == "1":
        f.require(False, f"{name} did not run ({why}) and KVROUTE_NO_SKIPS=1")
    else:
        log.warning("routing-quality: %s left out: %s", name, why)
