"""Where a request's tokenization time goes, and the numbers behind `router.tokenize`'s
choices: the piece sizes, the inline threshold (thread hop vs work), rayon off, the caches'
layout (a full garbage collection with the caches full) and their memory per entry.

    python -m router.bench.tokenize [--json out.json]

CPU times are thread CPU (`time.thread_time`), medians, in microseconds; the machine is
shared, so compare the rows of one run with each other, not with another run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from router.bench.proxy_prompts import MIXES, Mix
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer, Tokens

SAMPLES = 150


def _cpu(fn: Callable[[Any], object], items: list[Any]) -> float:
    return _interleaved({"x": fn}, items)["x"]


def _interleaved(fns: dict[str, Callable[[Any], object]], items: list[Any]) -> dict[str, float]:
    """Median thread CPU of each function, taking turns on each item (a shared machine's
    drift then hits every function alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for item in items:
        for name, fn in fns.items():
            t0 = time.thread_time()
            fn(item)
            times[name].append(time.thread_time() - t0)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def _kvroute(tok: LocalTokenizer) -> Callable[[str], object]:
    return lambda p: tok._tokens(("c", p), p, specials=True)


def _prompts(mix: Mix, n: int = SAMPLES) -> list[str]:
    rng = random.Random(11)
    return [mix.prompt("bench", i, rng) for i in range(n)]


def per_mix(piece_chars: int, fine_chars: int) -> dict[str, Any]:
    """kvroute's sync path per mix (warm: the mix's earlier prompts seen) vs the tokenizer."""
    base = LocalTokenizer(PACKAGED_TOKENIZER)
    out: dict[str, Any] = {}
    for name in MIXES:
        prompts = _prompts(Mix(name, base))
        tok = LocalTokenizer(PACKAGED_TOKENIZER, piece_chars=piece_chars, fine_chars=fine_chars)
        tok.completion(prompts[0] + " warm")
        fns: dict[str, Callable[[Any], object]] = {
            "encode": lambda p: base._tok.encode(p),
            "encode_batch_fast": lambda p: base._tok.encode_batch_fast([p]),
            "kvroute": _kvroute(tok),
        }
        out[name] = _interleaved(fns, prompts)
    return out


def decision_path(samples: int = 300) -> dict[str, Any]:
    """Per mix, the CPU of each step of a routing decision (in process, no HTTP): tokenize
    (kvroute's path, sync: the same work without the thread hop), pick (block hashing,
    index lookups, scores), commit (predictions, load) and release."""
    from indexer.clock import MonotonicClock
    from indexer.hashing import Namespace
    from router.core.config import Config
    from router.core.decision import RouteRequest
    from router.core.fleet import EVENTS, FleetState, WorkerState
    from router.core.picker import Picker

    base = LocalTokenizer(PACKAGED_TOKENIZER)
    out: dict[str, Any] = {}
    for name in MIXES:
        prompts = _prompts(Mix(name, base), samples)
        tok = LocalTokenizer(PACKAGED_TOKENIZER)
        tok.completion(prompts[0] + " warm")
        fleet = FleetState(MonotonicClock())
        for i in range(2):
            fleet.add(WorkerState(f"w{i}", EVENTS, 16, capacity_blocks=100_000))
        profile = Config().profile("default", random.Random(1))
        picker = Picker(fleet)
        steps: dict[str, list[float]] = {"tokenize": [], "pick": [], "commit": [], "release": []}
        for p in prompts:
            t0 = time.thread_time()
            ids = tok._tokens(("c", p), p, specials=True)
            t1 = time.thread_time()
            req = RouteRequest(model="", namespace=Namespace("m"), prompt_tokens=len(ids))
            d = picker.pick(profile, req, ids)
            t2 = time.thread_time()
            ticket = picker.commit(profile, d, d.best.worker)
            t3 = time.thread_time()
            fleet.load.finish(ticket)
            t4 = time.thread_time()
            for step, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                steps[step].append(dt)
        out[name] = {k: round(statistics.median(v) * 1e6, 1) for k, v in steps.items()}
    return out


def thread_hop() -> dict[str, float]:
    """What moving work to a thread costs the event loop (CPU) and the request (wall)."""
    pool = ThreadPoolExecutor(1)

    async def hops(n: int) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            await loop.run_in_executor(pool, int)
        return (time.perf_counter() - w0) / n, (time.thread_time() - c0) / n

    wall, cpu = asyncio.run(hops(2000))
    pool.shutdown()
    return {"wall_us": round(wall * 1e6, 1), "loop_cpu_us": round(cpu * 1e6, 1)}


def encode_per_char() -> dict[str, float]:
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    texts = _prompts(Mix("distinct", tok), 40)
    per = [_cpu(lambda t: tok._tok.encode_batch_fast([t]), [t]) / len(t) for t in texts]
    return {"encode_batch_fast_us_per_char": round(statistics.median(per), 4)}


class _ListTokens(list[int]):
    """The layout before: token ids and the block-hash memo as lists of ints."""

    __slots__ = ("hash_memo",)

    def __init__(self, ids: list[int]) -> None:
        super().__init__(ids)
        self.hash_memo: dict[object, object] = {}


def gc_pause(entries: int = 4096) -> dict[str, float]:
    """CPU of a full collection with the token cache full (`entries` ~2k-token prompts,
    each with its block hashes memoized by the picker): the layout before (lists of ints)
    vs now (arrays, hashes as tuples), and with no cache (the rest of the process)."""
    from indexer.hashing import Namespace
    from router.core.picker import _hashes

    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    ids = tok.completion(_prompts(Mix("repeated", tok), 1)[0])
    out = {}
    makers: dict[str, Callable[[], Any]] = {
        "no_cache": lambda: [],
        "lists_of_ints": lambda: _ListTokens(ids),
        "arrays": lambda: Tokens(ids),
    }
    for name, make in makers.items():
        held = [make() for _ in range(entries)]
        for t in held:
            if t:
                _hashes(t, 16, Namespace("m"))
        out[f"full_gc_cpu_ms_{name}"] = _full_gc_cpu_ms()
        del held
    return out


def gc_during_traffic(seconds: float = 30.0) -> dict[str, Any]:
    """Garbage collections while the async path tokenizes fresh shared-prefix and distinct
    prompts for `seconds` (the caches filling up): how many per generation, the longest."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    mixes = [Mix("shared-prefix", tok), Mix("distinct", tok)]
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.thread_time())
        elif started:
            pauses[info["generation"]].append(time.thread_time() - started.pop())

    async def traffic() -> int:
        rng, n = random.Random(5), 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await tok.acompletion(mixes[n % 2].prompt("gc", n, rng))
            n += 1
        return n

    before = _full_gc_cpu_ms()
    gc.callbacks.append(timer)
    try:
        requests = asyncio.run(traffic())
    finally:
        gc.callbacks.remove(timer)
    return {
        "full_gc_cpu_ms_before": before,
        "full_gc_cpu_ms_caches_full": _full_gc_cpu_ms(),
        "seconds": seconds,
        "requests": requests,
        "collections": {f"gen{g}": len(p) for g, p in pauses.items()},
        "max_pause_cpu_ms": {f"gen{g}": _ms(max(p, default=0.0)) for g, p in pauses.items()},
        "cached_requests": len(tok.cache),
        "pieces": len(tok.pieces),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _full_gc_cpu_ms() -> float:
    times = []
    for _ in range(3):
        t0 = time.thread_time()
        gc.collect()
        times.append(time.thread_time() - t0)
    return round(min(times) * 1e3, 2)


def memory(entries: int = 200) -> dict[str, float]:
    """Bytes kept per distinct ~2k-token prompt (whole-request cache + pieces)."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    prompts = _prompts(Mix("distinct", tok), entries)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for p in prompts:
        tok.completion(p)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"bytes_per_2k_prompt": round((after - before) / entries)}


def run(json_path: Path | None) -> dict[str, Any]:
    results: dict[str, Any] = {
        "pieces": {
            f"{c}/{f}": per_mix(c, f) for c, f in ((256, 32), (128, 32), (512, 64), (256, 64))
        },
        "decision_path": decision_path(),
        "thread_hop": thread_hop(),
        "encode": encode_per_char(),
        "gc": gc_pause(),
        "gc_during_traffic": gc_during_traffic(),
        "memory": memory(),
    }
    print(json.dumps(results, indent=2))
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", type=Path)
    run(p.parse_args().json)


if __name__ == "__main__":
    main()
