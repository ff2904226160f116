"""Check: the engine's /metrics page reads the same through kvroute's fast path (only the
lines the router uses, `engines.vllm.metrics_text`) as through prometheus_client's full
parser, after traffic so the counters and gauges are not all zero; that the fast path takes
the real page without falling back; and that the page splits its queue by reason (vLLM
0.32's "deferred" part of the waiting). Notes the page size and both parse times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from conformance.client import client, complete
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import ENGINE
from engines.base import EngineMetrics
from engines.vllm.discovery import READ_METRICS, parse_metrics, parse_metrics_full
from engines.vllm.metrics_text import Unparsed, wanted_samples


def _median_ms(fn: Callable[[], object], n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 3)


@check(
    "metrics",
    "the engine's /metrics page gives kvroute the same load, cache config and prefix-cache "
    "counters through its fast path (only the lines it reads) as through prometheus_client's "
    "full parser, with no fallback on the real page",
    needs=(ENGINE,),
    engines=("main",),
)
async def metrics(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    async with client(engine.url) as http:
        prompt = "A page of counters needs traffic first. " * 20
        for _ in range(2):  # the second is a prefix-cache hit: the hit counter moves
            await complete(http, engine.model, prompt)
        resp = await http.get("/metrics")
    text = resp.text
    f.note("page", {"status": resp.status_code, "lines": text.count("\n"), "bytes": len(text)})
    if resp.status_code != 200:
        f.problems.append(f"GET /metrics answered {resp.status_code}")
        return
    try:
        found = {name for name, _, _ in wanted_samples(text, READ_METRICS)}
    except Unparsed as exc:
        f.problems.append(f"the fast path fell back to the full parser on this page: {exc}")
        return
    missing = sorted(READ_METRICS - found)
    if missing:
        f.problems.append(f"the page has none of {missing}: the router would not see them")
    fast, full = parse_metrics(text), parse_metrics_full(text)
    f.note("read", _summary(fast))
    if repr(fast) != repr(full):
        f.problems.append(f"fast path {_summary(fast)} != full parser {_summary(full)}")
    if fast.deferred is None:
        # without it a LoRA or prefill->decode worker learns no batch limit (worker_checks)
        f.problems.append(
            'no vllm:num_requests_waiting_by_reason{reason="deferred"} sample: kvroute cannot '
            "tell the requests the engine holds for a LoRA slot or KV in transfer from those "
            "waiting for a batch slot"
        )
    if not fast.generation_tokens:
        # a non-streaming request's timeout counts against its worker only where this did not
        # move (router/proxy.py): without it every such timeout counts, as a hang
        f.problems.append("generation_tokens_total is 0 after traffic: no sign of a live engine")
    if not fast.prefix_queries:
        f.problems.append("prefix_cache_queries_total is 0 after traffic: nothing was compared")
    f.note(
        "parse_ms",
        {
            "fast_path": _median_ms(lambda: parse_metrics(text)),
            "prometheus_client": _median_ms(lambda: parse_metrics_full(text)),
        },
    )


def _summary(m: EngineMetrics) -> dict[str, object]:
    return {
        "running": m.running,
        "waiting": m.waiting,
        "deferred": m.deferred,
        "kv_usage": m.kv_usage,
        "block_size": m.block_size,
        "num_gpu_blocks": m.num_gpu_blocks,
        "prefix_caching": m.prefix_caching,
        "hash_algo": m.hash_algo,
        "prefix_queries": m.prefix_queries,
        "prefix_hits": m.prefix_hits,
        "generation_tokens": m.generation_tokens,
        "ranks": sorted(m.by_rank),
    }
