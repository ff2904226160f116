"""`kvroute bench index`: the prefix index under a fleet-sized workload, every built backend
(C core, pure Python) and Dynamo's RadixTree on the same workload in the same process when
`ai-dynamo-runtime` is installed; medians over rounds. `--scale 1m 10m` adds the growth
figures (router/bench/index_scale.py).

Workload: 8 workers, ~100k stored blocks (block size 16). Each worker serves requests made of
a shared prefix (16 prefixes of 384 blocks) cut at a random point plus a private tail; like
vLLM, a worker publishes only the blocks it did not already hold, each event naming its parent.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from indexer.events import BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, hash_request
from indexer.index import PrefixIndex, available_backends

BLOCK = 16
WORKERS = 8
PREFIXES = 16
PREFIX_BLOCKS = 384
TARGET_BLOCKS = 100_000
VOCAB = 32_000


@dataclass
class Workload:
    events: list[tuple[int, BlockStored, list[int]]]  # (worker, event, router hashes)
    queries: dict[str, list[list[int]]]  # "64"/"512" -> token lists (hits, partial, misses)
    stored_blocks: int = 0
    query_kinds: dict[str, int] = field(default_factory=dict)


def build_workload(seed: int = 7) -> Workload:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(PREFIXES)
    ]
    held: list[dict[tuple[int, int], int]] = [{} for _ in range(WORKERS)]  # (prefix, blocks) -> eh
    events: list[tuple[int, BlockStored, list[int]]] = []
    long_requests: list[list[int]] = []
    next_eh = PREFIXES * 10_000 + 1
    stored = 0
    while stored < TARGET_BLOCKS:
        w = rng.randrange(WORKERS)
        p = rng.randrange(PREFIXES)
        cut = rng.randint(64, PREFIX_BLOCKS)
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 160) * BLOCK)]
        tokens = prefixes[p][: cut * BLOCK] + tail
        have = max((b for (pp, b) in held[w] if pp == p and b <= cut), default=0)
        parent = held[w].get((p, have)) if have else None
        new_tokens = tokens[have * BLOCK :]
        n_new = len(new_tokens) // BLOCK
        # engines hash identical content identically (vLLM with a fixed PYTHONHASHSEED):
        # prefix blocks get ids from (prefix, position), private tails fresh ones
        ehs = [p * 10_000 + b for b in range(have + 1, cut + 1)]
        tail_n = n_new - len(ehs)
        ehs += list(range(next_eh, next_eh + tail_n))
        next_eh += tail_n
        for b in range(have + 1, cut + 1):
            held[w][(p, b)] = p * 10_000 + b
        event = BlockStored(
            engine_hashes=[EngineBlockHash(h) for h in ehs],
            parent=None if parent is None else EngineBlockHash(parent),
            token_ids=new_tokens,
            block_size=BLOCK,
        )
        rhs = hash_request(tokens, BLOCK, Namespace())[have:]
        events.append((w, event, list(rhs)))
        stored += n_new
        if len(tokens) >= 512 * BLOCK:
            long_requests.append(tokens)
    queries: dict[str, list[list[int]]] = {"64": [], "512": []}
    for _ in range(300):
        hit = rng.choice(long_requests)
        partial = hit[: rng.randint(32, 480) * BLOCK]
        partial += [rng.randrange(VOCAB) for _ in range(512 * BLOCK - len(partial))]
        miss = [rng.randrange(VOCAB) for _ in range(512 * BLOCK)]
        for q in (hit, partial, miss):
            queries["512"].append(q[: 512 * BLOCK])
            queries["64"].append(q[: 64 * BLOCK])
    return Workload(events, queries, stored)


def _timed_us(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def _pcts(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": round(statistics.median(s), 2), "p99": round(s[int(len(s) * 0.99) - 1], 2)}


def bench_kvroute(wl: Workload, backend: str) -> dict[str, Any]:
    """One round for one index backend: apply throughput, lookups, memory."""
    names = [f"w{i}" for i in range(WORKERS)]

    def fresh() -> PrefixIndex:
        ix = PrefixIndex(backend=backend)
        for n in names:
            ix.add_worker(n)
        return ix

    def apply_with_hashing() -> PrefixIndex:
        ix = fresh()
        for w, event, _ in wl.events:
            ix.apply(names[w], EventBatch(0.0, [event]))
        return ix

    def apply_index_only() -> PrefixIndex:
        ix = fresh()
        for w, event, rhs in wl.events:
            parent = None if event.parent is None else ix.router_hash_of(names[w], event.parent)
            ix.store_hashes(  # as `apply`: a root chain's held blocks are no copies
                names[w],
                event.engine_hashes,
                rhs,  # type: ignore[arg-type]
                parent,
                count_copies=event.parent is not None,
            )
        return ix

    with_hash = min(_seconds(apply_with_hashing) for _ in range(3))
    index_only = min(_seconds(apply_index_only) for _ in range(3))
    ix = apply_with_hashing()
    ix.verify()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    measured = apply_with_hashing()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = int(measured.stats()["entries"])  # type: ignore[call-overload]
    return {
        "backend": backend,
        "apply_blocks_per_s": round(wl.stored_blocks / index_only),
        "apply_blocks_per_s_with_hashing": round(wl.stored_blocks / with_hash),
        "find_matches_us": _find_matches(wl, lambda q: ix.find_matches(_hashes(q))),  # type: ignore[arg-type]
        "find_matches_only_us": _find_matches_pre_hashed(wl, ix.find_matches),  # type: ignore[arg-type]
        "hash_8k_tokens_us": _pcts(
            _timed_us(lambda: hash_request(wl.queries["512"][0][:8192], BLOCK, Namespace()), 500)
        )["p50"],
        "bytes_per_entry": round((after - before) / max(entries, 1), 1),
        "entries": entries,
    }


def _hashes(tokens: Sequence[int]) -> list[int]:
    return list(hash_request(tokens, BLOCK, Namespace()))


def _seconds(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _find_matches(wl: Workload, lookup: Callable[[list[int]], object]) -> dict[str, Any]:
    """Tokens in, overlaps out: hashing included (what a routing decision pays)."""
    out = {}
    for size, qs in wl.queries.items():
        samples: list[float] = []
        for q in qs:
            samples += _timed_us(lambda q=q: lookup(q), 3)  # type: ignore[misc]
        out[size] = _pcts(samples)
    return out


def _find_matches_pre_hashed(
    wl: Workload,
    lookup: Callable[[list[int]], object],
    hasher: Callable[[Sequence[int]], list[int]] | None = None,
) -> dict[str, Any]:
    """The index lookup alone, on hashes computed beforehand (comparable with a RadixTree
    that is handed hashes)."""
    out = {}
    for size, qs in wl.queries.items():
        hashed = [(hasher or _hashes)(q) for q in qs]
        samples: list[float] = []
        for h in hashed:
            samples += _timed_us(lambda h=h: lookup(h), 3)  # type: ignore[misc]
        out[size] = _pcts(samples)
    return out


def bench_dynamo(wl: Workload) -> dict[str, Any] | None:
    try:
        from dynamo._core import (  # type: ignore[import-not-found,unused-ignore]
            RadixTree,
            compute_block_hash_for_seq,
        )
    except ImportError:
        return None

    def dyn_hashes(tokens: Sequence[int]) -> list[int]:
        return list(compute_block_hash_for_seq(list(tokens), BLOCK))

    # Dynamo's tree is keyed by per-block token hashes (the tree itself does the chaining),
    # so each event's blocks are hashed on their own, as its vLLM relay does.
    built: list[tuple[int, bytes]] = []
    chains = _dynamo_chains(wl, dyn_hashes)
    for (w, event, _), local in zip(wl.events, chains, strict=True):
        doc = {
            "event_id": len(built) + 1,
            "data": {
                "stored": {
                    "parent_hash": None if event.parent is None else int(event.parent),
                    "blocks": [
                        {"block_hash": int(eh), "tokens_hash": th}
                        for eh, th in zip(event.engine_hashes, local, strict=True)
                    ],
                }
            },
        }
        built.append((w, json.dumps(doc).encode()))

    def apply_all() -> Any:
        tree = RadixTree()
        for w, raw in built:
            tree.apply_event(w, raw)
        tree.find_matches([0])  # the tree applies on a background thread: wait for it
        return tree

    apply_s = min(_seconds(apply_all) for _ in range(3))
    tree = apply_all()
    rss_before = _rss()
    keep = apply_all()
    rss_after = _rss()
    del keep
    entries = sum(len(e.engine_hashes) for _, e, _ in wl.events)
    return {
        "apply_blocks_per_s": round(wl.stored_blocks / apply_s),
        "find_matches_us": _find_matches(wl, lambda q: tree.find_matches(dyn_hashes(q))),
        "find_matches_only_us": _find_matches_pre_hashed(wl, tree.find_matches, dyn_hashes),
        "hash_8k_tokens_us": _pcts(_timed_us(lambda: dyn_hashes(wl.queries["512"][0][:8192]), 500))[
            "p50"
        ],
        "bytes_per_entry_rss": round(max(rss_after - rss_before, 0) / entries, 1),
    }


def _dynamo_chains(
    wl: Workload, dyn_hashes: Callable[[Sequence[int]], list[int]]
) -> list[list[int]]:
    """Per event, Dynamo's local hashes of its new blocks."""
    return [dyn_hashes(list(e.token_ids)) for _, e, _ in wl.events]


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def run(json_path: Path | None, repeat: int = 3, scale: Sequence[str] = ()) -> dict[str, Any]:
    """Each round measures every built backend and the peer in turn; medians over rounds."""
    t0 = time.perf_counter()
    wl = build_workload()
    print(
        f"workload: {len(wl.events)} events, {wl.stored_blocks} stored blocks, "
        f"{WORKERS} workers, block size {BLOCK} ({time.perf_counter() - t0:.1f} s to build); "
        f"{repeat} rounds, medians"
    )
    rounds: dict[str, list[dict[str, Any]]] = {b: [] for b in available_backends()}
    peer_rounds: list[dict[str, Any]] = []
    for _ in range(repeat):
        for backend, runs in rounds.items():
            runs.append(bench_kvroute(wl, backend))
        peer = bench_dynamo(wl)
        if peer is not None:
            peer_rounds.append(peer)
    backends = {b: _median_of(runs) for b, runs in rounds.items()}
    result: dict[str, Any] = {**backends[available_backends()[0]], "backends": backends}
    result["rounds"] = repeat
    if peer_rounds:
        peer = {"name": "ai-dynamo-runtime RadixTree", **_median_of(peer_rounds)}
        result["peer"] = peer
        result["ratios"] = _ratios(result, peer)
    _print(result)
    if scale:
        from router.bench.index_scale import run_scale

        result["scale"] = run_scale(scale)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return result


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-key median of rounds with the same shape (numbers only; others from round 1)."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        if isinstance(first, dict):
            out[key] = _median_of([r[key] for r in runs])
        elif isinstance(first, int | float) and not isinstance(first, bool):
            m = statistics.median(r[key] for r in runs)
            out[key] = round(m) if isinstance(first, int) else round(m, 2)
        else:
            out[key] = first
    return out


def _ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """> 1 means kvroute is better (faster, or more throughput)."""
    r = {
        "apply_blocks_per_s": ours["apply_blocks_per_s"] / peer["apply_blocks_per_s"],
        "hash_8k_tokens": peer["hash_8k_tokens_us"] / ours["hash_8k_tokens_us"],
    }
    for key in ("find_matches_us", "find_matches_only_us"):
        for size in ("64", "512"):
            r[f"{key}_{size}_p50"] = peer[key][size]["p50"] / ours[key][size]["p50"]
    return {k: round(v, 2) for k, v in r.items()}


def _print(result: dict[str, Any]) -> None:
    cols = [(f"kvroute/{b}", r) for b, r in result["backends"].items()]
    peer = result.get("peer")
    if peer:
        cols.append(("dynamo", {**peer, "bytes_per_entry": f"{peer['bytes_per_entry_rss']} RSS"}))
    print(f"{'':48}" + "".join(f"{name:>18}" for name, _ in cols))
    for size in ("64", "512"):
        for key, what in (("find_matches_us", "tokens"), ("find_matches_only_us", "hashes")):
            cells = [f"{r[key][size]['p50']}/{r[key][size]['p99']}" for _, r in cols]
            label = f"find_matches {size} blocks, {what} in, p50/p99 us"
            print(f"{label:48}" + "".join(f"{c:>18}" for c in cells))
    for key, label in (
        ("apply_blocks_per_s", "apply blocks/s (index only)"),
        ("apply_blocks_per_s_with_hashing", "apply blocks/s (with hashing token_ids)"),
        ("hash_8k_tokens_us", "hash 8,192 tokens p50 us"),
        ("bytes_per_entry", "bytes per entry"),
    ):
        cells = [_cell(r.get(key)) for _, r in cols]
        print(f"{label:48}" + "".join(f"{c:>18}" for c in cells))
    if peer:
        print("ratios (>1: kvroute better):", json.dumps(result["ratios"]))
    else:
        print("peer: not installed (pip install ai-dynamo-runtime) - no ratios")


def _cell(v: object) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)
