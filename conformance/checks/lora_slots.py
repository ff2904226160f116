"""Check: requests an engine holds for a LoRA adapter slot do not teach kvroute a batch limit.

With --max-loras 1 (vLLM's default), while `main` runs a long request on `lora-a`, its
requests for `lora-b` wait although the batch has room; vLLM 0.32 counts them as waiting,
and as "deferred" in `vllm:num_requests_waiting_by_reason`. Read as a queue for batch
slots, that moment says "a batch of 1" (a wrong limit would turn every request after it
away from the worker). Through `kvroute serve` in front of `main`, scraping every SCRAPE_S
(the long request's decode lasts seconds, and a /metrics scrape of vLLM on two busy cores
was seen to take 4: kvroute's own scrape at the moment the held requests make the worker
look crowded, and its confirmation, come within a second), the check holds that moment
and asserts:
- the engine's page shows the held requests as waiting and all deferred, over at least
  HELD_MIN_S, kvroute's confirmation interval (the semantics kvroute relies on, on the
  real engine);
- the same scrapes, read without the split, would teach a limit (the moment can teach);
- kvroute learned none (`kvroute_worker_batch_limit` has no sample for the worker);
- the held requests are all served once `lora-a` ends or is hung up on: none lost.

How long the hold lasts is the engine's: on this machine 3,500 tokens took from under 2 s
to 20 s, as vLLM's API server, on the cores the router and this check share, kept up with
its engine or not. A lora-a request the engine finished before any page showed it running
(in CI one page came 17.7 s late) is sent again, and a hold no page read fell inside is held
again, each up to ATTEMPTS times: both are inconclusive, not failures."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

import httpx

from conformance.client import client
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import ENGINE, LORA, Engine
from engines.vllm.discovery import parse_metrics
from indexer.clock import FakeClock
from router.core.load import LEARN_CONFIRM_S, LoadTracker
from router.procs import RouterProcess

HELD = 3  # lora-b requests held while lora-a runs (kvroute learns from 2 waiting)
SCRAPE_S = 0.25  # kvroute's scrape interval here: several scrapes in a hold of seconds
START_S = 60.0  # for the lora-a request to run
# tries at each inconclusive step: a lora-a request sent before one is seen running, and a
# hold no page read fell inside (on two busy cores vLLM's API server once answered /metrics
# only after the engine had run a whole request, a page read 17.7 s late)
ATTEMPTS = 3
HOLD_MAX_S = 8.0  # then the lora-a request is hung up on, if it still runs
# the engine's page must show the hold twice this far apart, as kvroute's rule needs
HELD_MIN_S = LEARN_CONFIRM_S
LONG_TOKENS = 3500  # lora-a's output: seconds of decode, within main's 4,064 tokens
CONTROL = "control (the scrapes read without the split)"  # names it in the log line it gives


@check(
    "lora-slots",
    "requests the engine holds for a LoRA adapter slot (--max-loras) show as deferred on "
    "its /metrics, and kvroute serve in front of it learns no batch limit from them",
    needs=(ENGINE, LORA),
    engines=("main",),
    timeout_s=300.0,
)
async def lora_slots(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    router = await asyncio.to_thread(
        RouterProcess,
        [engine.url],
        tokenizer=ctx.tokenizer_dir,
        ready_timeout=90.0,
        log_dir=ctx.workdir / "lora-slots-router",
        env={"KVROUTE_SCRAPE_INTERVAL_S": str(SCRAPE_S)},
    )
    try:
        f.note("router_log", str(router.log_path))
        async with client(router.url) as via, client(engine.url) as direct:
            for attempt in range(1, ATTEMPTS + 1):
                if await _hold(engine, via, direct, f, last=attempt == ATTEMPTS):
                    break
                f.note("holds_unseen", attempt)  # no page read while it held: again
            page = (await via.get("/metrics")).text
    finally:
        await asyncio.to_thread(router.stop)
    worker = engine.url.split("://", 1)[1]
    learned = [
        line
        for line in page.splitlines()
        if line.startswith("kvroute_worker_batch_limit{") and f'"{worker}"' in line
    ]
    f.note("kvroute_batch_limit", learned or None)
    f.require(
        not learned,
        f"kvroute learned a batch limit from requests held for a LoRA slot: {learned}",
    )


async def _hold(
    engine: Engine, via: httpx.AsyncClient, direct: httpx.AsyncClient, f: Findings, last: bool
) -> bool:
    """One hold; False when no page read fell inside it (vLLM's API server, starved on two
    busy cores, once answered no /metrics read for 18.8 s while the engine ran the whole
    lora-a request) and this is not the `last` attempt: inconclusive, so held again."""
    first, second = engine.lora_name, engine.second_lora_name
    assert first is not None and second is not None
    # not streamed: nothing to relay per token, on cores the engine's are busy on
    body: dict[str, Any] = {"model": first, "prompt": "One adapter holds the slot. " * 8}
    body |= {"max_tokens": LONG_TOKENS, "ignore_eos": True}
    samples: list[dict[str, Any]] = []
    held: list[asyncio.Task[httpx.Response]] = []
    long: asyncio.Task[httpx.Response] | None = None
    try:
        for attempt in range(1, ATTEMPTS + 1):
            long = asyncio.create_task(via.post("/v1/completions", json=body))
            seen = await _started(direct, samples, long)
            if seen:
                break
            if seen is None or attempt == ATTEMPTS:
                f.require(False, f"the {first} request never ran: {samples[-3:]}")
                return True
            f.note("outran_the_page", attempt)  # done before a page showed it: again
            with contextlib.suppress(httpx.HTTPError):
                await long
        for i in range(HELD):
            body = {"model": second, "prompt": f"Held request {i} for the other adapter."}
            held.append(
                asyncio.create_task(via.post("/v1/completions", json=body | {"max_tokens": 2}))
            )
        ends = time.monotonic() + HOLD_MAX_S
        while time.monotonic() < ends and long is not None and not long.done():
            await _sample(direct, samples)
            await asyncio.sleep(0.1)
    except BaseException:
        for task in held:  # the check failed mid-hold: no request is left unawaited
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        raise
    finally:
        if long is not None:
            long.cancel()  # hanging up aborts it (through kvroute, on the engine)
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await long
    answers = await asyncio.gather(*held, return_exceptions=True)
    statuses = [a.status_code if isinstance(a, httpx.Response) else repr(a) for a in answers]
    f.note("held_answers", statuses)
    f.require(statuses == [200] * HELD, f"requests held for a LoRA slot were lost: {statuses}")
    if not last and not any(_holding(s) for s in samples):
        return False
    _judge(samples, f)
    return True


async def _started(
    direct: httpx.AsyncClient, samples: list[dict[str, Any]], long: asyncio.Task[httpx.Response]
) -> bool | None:
    """True once the engine's page shows a request running; False when the request ended
    before any page did (the engine outran its API server); None after START_S."""
    started = time.monotonic()
    while not (await _sample(direct, samples))["running"]:
        if long.done():
            return False
        if time.monotonic() - started > START_S:
            return None
        await asyncio.sleep(0.05)
    return True


async def _sample(direct: httpx.AsyncClient, samples: list[dict[str, Any]]) -> dict[str, Any]:
    m = parse_metrics((await direct.get("/metrics")).text)
    t = time.monotonic()
    samples.append({"t": t, "running": m.running, "waiting": m.waiting, "deferred": m.deferred})
    return samples[-1]


def _holding(s: dict[str, Any]) -> bool:
    return bool(s["running"] >= 1 and s["waiting"] >= HELD)


def _judge(samples: list[dict[str, Any]], f: Findings) -> None:
    held = [s for s in samples if _holding(s)]
    span = held[-1]["t"] - held[0]["t"] if held else 0.0
    f.note("samples", {"taken": len(samples), "holding": len(held), "held_s": round(span, 1)})
    f.require(
        len(held) >= 2 and span >= HELD_MIN_S,
        f"the engine's page showed the held requests {len(held)} times over {span:.1f} s "
        f"(kvroute scrapes every {SCRAPE_S} s): {samples[-3:]}",
    )
    if not held:
        return
    f.require(
        all(s["deferred"] == s["waiting"] for s in held),
        "the engine counted requests held for a LoRA slot as waiting for capacity: "
        f"{[s for s in held if s['deferred'] != s['waiting']][:3]}",
    )
    # the control: the same scrapes read as a plain worker's queue (no split) teach a limit
    # (two in a row showing the same running count, as kvroute's rule asks)
    pair = next(
        ((a, b) for a, b in itertools.pairwise(held) if a["running"] == b["running"]),
        None,
    )
    f.require(pair is not None, "no two scrapes of the hold showed the same running count")
    if pair is None:
        return
    clock = FakeClock()
    naive = LoadTracker(clock=clock)
    for s in pair:
        naive.scraped(CONTROL, s["running"], s["waiting"], 0.1, 1000, 0.0)
        clock.advance(LEARN_CONFIRM_S)
    f.note("read_without_the_split_learns", naive.batch_limit(CONTROL))
    f.require(
        naive.batch_limit(CONTROL) is not None,
        "the held moment teaches no limit even read without the split: the check proves nothing",
    )
