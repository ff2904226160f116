"""The checks, in the order they run, and the run itself.

Cheap facts (each router and worker endpoint, fetched once) come first; then each check, in
order, router-wide or once per worker (workers concurrently). Probes leave what they saw on
the worker's facts, so later checks (block-size, index) use it instead of probing again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import zmq.asyncio

from router.check.checks_agree import check_block_size, check_index, check_tokenizer
from router.check.checks_events import check_events_flowing
from router.check.checks_pd import check_pd_path
from router.check.checks_router import admin_fix, check_router, check_router_health
from router.check.checks_routing import check_load_spread, check_repeat_prefix
from router.check.checks_worker import (
    check_events_config,
    check_events_endpoint,
    check_prefix_caching,
    check_worker,
)
from router.check.context import (
    Context,
    Options,
    UsageError,
    load_router,
    load_worker,
    worker_list,
)
from router.check.model import Report, Result, failed, warned
from router.check.workerfacts import WorkerFacts
from router.worker_checks import CONTROL_KEEPALIVE_S

RouterCheck = Callable[[Context], Awaitable[Result]]
WorkerCheck = Callable[[Context, WorkerFacts], Awaitable[Result]]


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    router: RouterCheck | None = None
    worker: WorkerCheck | None = None
    # how many --timeout periods it may spend before it is cut off (a safety net: every
    # call inside is bounded already)
    budget: Callable[[Options], float] = lambda o: 10 * o.timeout_s


CHECKS = (
    Check("router", "reachable, ready, lists its workers, --policy kv, /metrics", check_router),
    Check("router-health", "the router's own GET /health verdict", check_router_health),
    Check("worker", "each worker answers and is in the router's rotation", worker=check_worker),
    Check(
        "prefix-caching",
        "vllm:cache_config_info enable_prefix_caching",
        worker=check_prefix_caching,
    ),
    Check(
        "events-config", "GET /kv_event_sources names a ZMQ publisher", worker=check_events_config
    ),
    Check(
        "events-endpoint",
        "the router's event + replay sockets complete a ZMQ handshake",
        worker=check_events_endpoint,
    ),
    Check(
        "events-flowing",
        "a probe prompt's BlockStored (same token ids) arrives",
        worker=check_events_flowing,
    ),
    Check("block-size", "router = events = engine cache config", worker=check_block_size),
    Check(
        "tokenizer",
        "router tokens = worker /tokenize (completion and chat)",
        worker=check_tokenizer,
    ),
    Check("index", "router index filled; no gaps/malformed/resyncs", worker=check_index),
    Check(
        "repeat-prefix",
        "a repeat lands on its worker, cached, faster by --margin",
        check_repeat_prefix,
        budget=lambda o: (4 * o.pairs + 2) * o.timeout_s,
    ),
    Check(
        "load-spread", "a burst of distinct prompts uses more than one worker", check_load_spread
    ),
    Check(
        "pd-path",
        "a probe handoff prefill->decode: KV pulled, bytes moved, link speed; live splits proved",
        check_pd_path,
        budget=lambda o: 6 * max(o.timeout_s, 30.0),
    ),
)
NAMES = tuple(c.name for c in CHECKS)
CONCURRENT_WORKERS = 8


async def run_checks(opts: Options) -> Report:
    """Run every check not in `opts.skip` against the live router; never raises for what
    the fleet does (that is what the report is for)."""
    opts = opts.validate()
    if opts.router is None:
        raise UsageError("give --router URL: its checks read the router")
    zmq_ctx = zmq.asyncio.Context()
    try:
        # idle connections not reused near the workers' 5 s keep-alive (vLLM's): a call
        # sent as the worker closes one would read as a failed check
        limits = httpx.Limits(
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=CONTROL_KEEPALIVE_S
        )
        async with httpx.AsyncClient(
            follow_redirects=True, headers=opts.api_headers(), limits=limits
        ) as http:
            return await _run(Context(opts, http, zmq_ctx))
    finally:
        zmq_ctx.destroy(linger=0)


async def _run(ctx: Context) -> Report:
    report = Report(ctx.base)
    await load_router(ctx)
    health = ctx.router.health
    assert health is not None
    if health.status is None:
        report.fatal = f"cannot reach the router at {ctx.base}: {health.error}"
        fix = "start kvroute serve, or correct --router"
        report.results.append(failed("router", report.fatal, fix))
        return report
    ctx.workers = worker_list(ctx)
    if not ctx.workers:
        report.fatal = _no_workers(ctx)
        return report
    await asyncio.gather(*(load_worker(ctx, w) for w in ctx.workers))
    for check in CHECKS:
        if check.name not in ctx.opts.skip:
            report.results += await _one(ctx, check)
    return report


def _no_workers(ctx: Context) -> str:
    admin = ctx.router.admin
    why = admin.describe() if admin is not None else "not asked"
    hint = admin_fix(admin) or "pass the workers with --worker URL"
    return f"no workers to check: the router's GET /admin/workers gave {why}; {hint}"


async def _one(ctx: Context, check: Check) -> list[Result]:
    budget = check.budget(ctx.opts)
    if check.router is not None:
        return [await _bounded(check, check.router(ctx), budget, None)]
    assert check.worker is not None
    gate = asyncio.Semaphore(CONCURRENT_WORKERS)

    async def each(w: WorkerFacts) -> Result:
        if check.name != "worker" and not w.reachable:
            return warned(check.name, "not run: the worker is unreachable", w.name)
        async with gate:
            assert check.worker is not None
            return await _bounded(check, check.worker(ctx, w), budget, w.name)

    return list(await asyncio.gather(*(each(w) for w in ctx.workers)))


async def _bounded(
    check: Check, run: Awaitable[Result], budget: float, worker: str | None
) -> Result:
    """No check may hang the run, and a bug in one must not hide the others."""
    try:
        return await asyncio.wait_for(run, budget)
    except TimeoutError:
        return warned(check.name, f"did not finish within {budget:g} s", worker)
    except Exception as exc:  # reported, never a silent PASS
        return warned(check.name, f"could not run: {type(exc).__name__}: {exc}", worker)
