"""`kvroute bench index --scale 1m 10m`: how the index's cost grows with its size. Memory per
entry, apply throughput (index only) and lookup latency at 1M and 10M entries, for the C core,
the pure-Python backend (up to 1M: at 10M it needs ~2 GB) and Dynamo's RadixTree when
installed, one round each (minutes at 10M).

The workload is hashes only, so that 10M entries build in seconds: 8 workers; each event is
one request made of a shared prefix (64 prefixes of 384 blocks) cut at a random point plus a
private tail of 8-160 blocks; like vLLM, a worker publishes only the blocks it does not hold.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from indexer.hashing import EngineBlockHash
from indexer.index import PrefixIndex, available_backends
from router.bench.index import _rss, _timed_us

SIZES = {"1m": 1_000_000, "10m": 10_000_000}
WORKERS = 8
PREFIXES = 64
PREFIX_BLOCKS = 384
PYTHON_MAX = 1_000_000  # target entries
BATCH = 2000
QUERIES = 200


@dataclass
class ScaleWorkload:
    events: list[tuple[int, array[int], array[int], int | None]]  # worker, ids, hashes, parent
    chains: list[array[int]]  # stored chains from block 0, for queries
    entries: int


def build(target: int, seed: int = 11) -> ScaleWorkload:
    rng = random.Random(seed)
    prefixes = [array("Q", rng.randbytes(8 * PREFIX_BLOCKS)) for _ in range(PREFIXES)]
    held = [[0] * PREFIXES for _ in range(WORKERS)]  # prefix blocks each worker holds
    events: list[tuple[int, array[int], array[int], int | None]] = []
    chains: list[array[int]] = []
    next_id, stored = PREFIXES * 1000 + 1, 0
    while stored < target:
        w, p = rng.randrange(WORKERS), rng.randrange(PREFIXES)
        cut, tail = rng.randint(64, PREFIX_BLOCKS), rng.randint(8, 160)
        have = min(held[w][p], cut)
        held[w][p] = max(held[w][p], cut)
        ids = array("Q", range(p * 1000 + have + 1, p * 1000 + cut + 1))
        ids.extend(range(next_id, next_id + tail))
        next_id += tail
        hashes = prefixes[p][have:cut] + array("Q", rng.randbytes(8 * tail))
        events.append((w, ids, hashes, p * 1000 + have if have else None))
        stored += len(ids)
        if len(chains) < QUERIES or rng.random() < 0.01:
            chains.append(prefixes[p][:cut] + hashes[cut - have :])
    return ScaleWorkload(events, chains[-QUERIES:], stored)


def _queries(wl: ScaleWorkload, size: int, seed: int = 5) -> list[list[int]]:
    """Hits (a stored chain, then unknown blocks), partial hits and misses."""
    rng = random.Random(seed)
    out = []
    for chain in wl.chains:
        fill = list(array("Q", rng.randbytes(8 * size)))
        hit = (list(chain) + fill)[:size]
        cut = rng.randint(1, min(len(chain), size))
        out += [hit, (list(chain[:cut]) + fill)[:size], fill]
    return out


def _lookups(find: Callable[[list[int]], object], wl: ScaleWorkload) -> dict[str, Any]:
    out = {}
    for size in (64, 512):
        samples: list[float] = []
        for q in _queries(wl, size):
            samples += _timed_us(lambda q=q: find(q), 3)  # type: ignore[misc]
        s = sorted(samples)
        out[str(size)] = {
            "p50": round(statistics.median(s), 2),
            "p99": round(s[len(s) * 99 // 100], 2),
        }
    return out


def bench_ours(wl: ScaleWorkload, backend: str) -> dict[str, Any]:
    gc.collect()
    rss0 = _rss()
    ix = PrefixIndex(max_entries=wl.entries + 1, backend=backend)
    names = [f"w{i}" for i in range(WORKERS)]
    for n in names:
        ix.add_worker(n)
    seconds = cpu = 0.0
    for start in range(0, len(wl.events), BATCH):  # lists built outside the clock, as in
        batch = [  # the main bench (events arrive as lists of ints)
            (names[w], list(ids), list(hashes), None if p is None else EngineBlockHash(p))
            for w, ids, hashes, p in wl.events[start : start + BATCH]
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        for name, ids, hashes, parent in batch:
            rh = None if parent is None else ix.router_hash_of(name, parent)
            ix.store_hashes(name, ids, hashes, rh)  # type: ignore[arg-type]
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - c0
    entries = int(ix.stats()["entries"])  # type: ignore[call-overload]
    rss = _rss() - rss0
    return {
        "entries": entries,
        "apply_blocks_per_s": round(wl.entries / seconds),
        "apply_blocks_per_cpu_s": round(wl.entries / cpu),
        "bytes_per_entry": round(ix.memory_estimate() / entries, 1),
        "bytes_per_entry_rss": round(rss / entries, 1),
        "find_matches_only_us": _lookups(ix.find_matches, wl),  # type: ignore[arg-type]
    }


def bench_dynamo(wl: ScaleWorkload) -> dict[str, Any] | None:
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    gc.collect()
    rss0 = _rss()
    tree = RadixTree()
    seconds = cpu = 0.0
    # JSON built per batch outside the clock; the tree applies on its own thread
    for start in range(0, len(wl.events), BATCH):
        docs = [_dynamo_event(i, e) for i, e in enumerate(wl.events[start : start + BATCH], start)]
        t0, c0 = time.perf_counter(), time.process_time()
        for w, raw in docs:
            tree.apply_event(w, raw)
        tree.find_matches([0])
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - c0  # includes the tree's own thread
    rss = _rss() - rss0
    return {
        "entries": wl.entries,
        "apply_blocks_per_s": round(wl.entries / seconds),
        "apply_blocks_per_cpu_s": round(wl.entries / cpu),
        "bytes_per_entry_rss": round(rss / wl.entries, 1),
        "find_matches_only_us": _lookups(tree.find_matches, wl),
    }


def _dynamo_event(
    i: int, event: tuple[int, array[int], array[int], int | None]
) -> tuple[int, bytes]:
    w, ids, hashes, parent = event
    blocks = [{"block_hash": b, "tokens_hash": h} for b, h in zip(ids, hashes, strict=True)]
    doc = {"event_id": i + 1, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}
    return w, json.dumps(doc).encode()


def run_scale(sizes: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sizes:
        t0 = time.perf_counter()
        wl = build(SIZES[name])
        print(
            f"\nscale {name}: {wl.entries:,} entries, {len(wl.events):,} events "
            f"({time.perf_counter() - t0:.1f} s to build)"
        )
        row: dict[str, Any] = {}
        for backend in available_backends():
            if backend == "python" and SIZES[name] > PYTHON_MAX:
                continue
            row[f"kvroute/{backend}"] = bench_ours(wl, backend)
        peer = bench_dynamo(wl)
        if peer is not None:
            row["dynamo"] = peer
        _print(row)
        out[name] = row
        del wl
    return out


def _print(row: dict[str, Any]) -> None:
    print(f"{'':40}" + "".join(f"{name:>18}" for name in row))
    lines: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
        ("apply blocks/s (index only)", lambda r: f"{r['apply_blocks_per_s']:,}"),
        ("apply blocks per CPU second", lambda r: f"{r['apply_blocks_per_cpu_s']:,}"),
        ("bytes per entry (own count)", lambda r: r.get("bytes_per_entry", "-")),
        ("bytes per entry (RSS growth)", lambda r: r["bytes_per_entry_rss"]),
    ]
    for size in ("64", "512"):
        lines.append(
            (
                f"find_matches {size}, hashes in, p50/p99 us",
                lambda r, s=size: "{p50}/{p99}".format(**r["find_matches_only_us"][s]),  # type: ignore[misc]
            )
        )
    for label, cell in lines:
        print(f"{label:40}" + "".join(f"{cell(r)!s:>18}" for r in row.values()))
