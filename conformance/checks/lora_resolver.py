"""Check: an adapter the engine loads at its first request, routed by `kvroute serve
--lora-resolver`.

`main` runs vLLM's filesystem LoRA resolver (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
VLLM_LORA_RESOLVER_CACHE_DIR), as fleets that load adapters on demand do: no worker lists
an adapter before a request names it, so a router that pools by the workers' /v1/models
refuses it. Through `kvroute serve --lora-resolver <base model>` in front of `main`, the
check asserts:
- an adapter no worker listed is served (the engine loads it), and then listed, under the
  base model, by the engine's /v1/models and by the router's;
- kvroute credits that adapter's blocks from the engine's KV events (its namespace: the
  adapter's name; the router's own predictions expire at once, so only the events can
  credit them) and the base model none of them, and the engine's reported cached tokens on
  the adapter's repeat equal what kvroute predicted;
- a name no resolver finds is the engine's own 404, relayed (not a router error);
- through a second router with `--tokenizer remote`, text prompts for the adapter (tokens
  from the engine's /tokenize, asked as the base model) are credited exactly as the engine
  reports them cached."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from conformance.client import client, completion_body, stream_completion
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import CACHED_TOKENS, ENGINE, KV_EVENTS, LORA, Engine
from conformance.traffic import token_source, tokens
from router.procs import RouterProcess

ADAPTER = "lora-resolved"  # loaded at its first request, from main's resolver folder
ABSENT = "lora-nowhere"  # no resolver finds it
PREFIX_BLOCKS = 10
WAIT_S = 15.0  # for the router's next /v1/models refresh and the adapter's KV events
PREDICTION_TTL_S = 0.05


@check(
    "lora-resolver",
    "an adapter the engine loads at its first request (vLLM's filesystem LoRA resolver) "
    "is routed by kvroute serve --lora-resolver: served, listed, its blocks credited in its "
    "own namespace as the engine caches them; a name no resolver finds is the engine's 404",
    needs=(ENGINE, LORA, KV_EVENTS, CACHED_TOKENS),
    engines=("main",),
    timeout_s=240.0,
)
async def lora_resolver(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    f.note("adapter_folder", str(engine.install_adapter(ADAPTER)))
    router = await _router(ctx, engine, ctx.tokenizer_dir, "lora-resolver-router")
    admin = {"authorization": f"Bearer {router.admin_token}"}
    worker = engine.url.split("://", 1)[1]
    try:
        f.note("router_log", str(router.log_path))
        async with client(router.url) as via, client(engine.url) as direct:
            listed = await _listed(direct)
            f.require(ADAPTER not in listed, f"the engine listed {ADAPTER} before any request")
            rng = token_source("lora-resolver")
            prefix = tokens(rng, PREFIX_BLOCKS * engine.block_size)
            first = await stream_completion(via, ADAPTER, prefix + tokens(rng, 7))
            f.note("first", {"worker": first.worker, "prompt_tokens": first.prompt_tokens})
            f.require(first.worker == worker, f"the first {ADAPTER} request went to {first.worker}")
            listed = await _listed(direct)
            f.note("engine_lists", listed)
            f.require(
                listed.get(ADAPTER) == engine.model,
                f"the engine does not list {ADAPTER} under {engine.model} after serving it",
            )
            repeat = prefix + tokens(rng, 7)
            await asyncio.sleep(PREDICTION_TTL_S * 2)
            seen = await _until_known(via, admin, repeat, engine.model)
            f.note("router_sees", seen)
            f.require(
                seen["router_lists"] == engine.model,
                f"kvroute's /v1/models does not list {ADAPTER} under {engine.model}",
            )
            f.require(
                seen["adapter_blocks"] == PREFIX_BLOCKS,
                f"kvroute credits {seen['adapter_blocks']} of {ADAPTER}'s {PREFIX_BLOCKS} "
                "prefix blocks from the engine's events",
            )
            f.require(
                seen["base_blocks"] == 0,
                f"the base model is credited {seen['base_blocks']} blocks of the adapter's",
            )
            again = await stream_completion(via, ADAPTER, repeat)
            predicted = seen["adapter_blocks"] * engine.block_size
            f.note("repeat", {"worker": again.worker, "cached_tokens": again.cached_tokens})
            f.require(
                again.worker == worker and again.cached_tokens == predicted,
                f"the repeat's cached tokens {again.cached_tokens} (engine) against "
                f"{predicted} (kvroute's prediction)",
            )
            resp = await via.post("/v1/completions", json=completion_body(ABSENT, prefix))
            message = _message(resp)
            f.note("absent", {"status": resp.status_code, "message": message[:200]})
            f.require(
                resp.status_code == 404
                and resp.headers.get("x-kvroute-worker") == worker
                and "does not exist" in message,
                f"{ABSENT} got {resp.status_code} ({message[:120]!r}), not the engine's 404",
            )
    finally:
        await asyncio.to_thread(router.stop)
    await _remote_tokenizer(ctx, engine, f)


async def _router(ctx: Context, engine: Engine, tokenizer: str | Path, name: str) -> RouterProcess:
    return await asyncio.to_thread(
        RouterProcess,
        [engine.url],
        tokenizer=tokenizer,
        extra=["--lora-resolver", engine.model],
        ready_timeout=90.0,
        log_dir=ctx.workdir / name,
        # the pick's own predictions credit the first request's blocks for 5 s: gone at
        # once, what kvroute credits can only come from the engine's KV events
        env={"KVROUTE_PREDICTION_TTL_S": str(PREDICTION_TTL_S)},
    )


async def _remote_tokenizer(ctx: Context, engine: Engine, f: Findings) -> None:
    """The same adapter's text prompts through a router that asks the engine's /tokenize
    (as the base model: the adapter shares its tokenizer): the blocks kvroute credits from
    those tokens are the blocks the engine reports cached."""
    router = await _router(ctx, engine, "remote", "lora-resolver-remote-router")
    admin = {"authorization": f"Bearer {router.admin_token}"}
    try:
        async with client(router.url) as via:
            text = _text(engine.block_size * PREFIX_BLOCKS)
            first = await stream_completion(via, ADAPTER, f"{text} The first question.")
            repeat = f"{text} A second, different question."
            await asyncio.sleep(PREDICTION_TTL_S * 2)
            seen = await _until_known(via, admin, repeat, engine.model, text=True)
            again = await stream_completion(via, ADAPTER, repeat)
            predicted = seen["adapter_blocks"] * engine.block_size
            f.note(
                "remote_tokenizer",
                {"first_prompt_tokens": first.prompt_tokens, "predicted_cached": predicted}
                | {"engine_cached": again.cached_tokens},
            )
            f.require(
                predicted > 0 and again.cached_tokens == predicted,
                f"with --tokenizer remote: the engine's cached tokens {again.cached_tokens} "
                f"against kvroute's prediction {predicted}",
            )
    finally:
        await asyncio.to_thread(router.stop)


def _text(min_tokens: int) -> str:
    """Plain prose of at least `min_tokens` tokens (a word is at least one)."""
    words = ["the", "lantern", "over", "the", "harbor", "burned", "through", "a", "long"]
    words += ["winter", "night", "and", "its", "signal", "held"]
    return " ".join(words[i % len(words)] for i in range(min_tokens + 40))


async def _listed(http: httpx.AsyncClient) -> dict[str, Any]:
    """Served name -> its parent (None for a base model), from /v1/models."""
    resp = await http.get("/v1/models")
    resp.raise_for_status()
    return {m["id"]: m.get("parent") for m in resp.json()["data"]}


async def _until_known(
    http: httpx.AsyncClient,
    admin: dict[str, str],
    prompt: list[int] | str,
    base: str,
    *,
    text: bool = False,
) -> dict[str, Any]:
    """What kvroute believes of the adapter once its /v1/models refresh and the engine's
    KV events have reached it (or WAIT_S has passed). A text prompt's blocks are as many
    as its tokens fill: any at all will do."""
    deadline = time.monotonic() + WAIT_S
    while True:
        blocks = await _overlap(http, admin, ADAPTER, prompt)
        seen = {
            "router_lists": (await _listed(http)).get(ADAPTER),
            "adapter_blocks": blocks,
            "base_blocks": await _overlap(http, admin, base, prompt),
        }
        enough = blocks >= (1 if text else PREFIX_BLOCKS)
        if (seen["router_lists"] and enough) or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.2)


async def _overlap(
    http: httpx.AsyncClient, admin: dict[str, str], model: str, prompt: list[int] | str
) -> int:
    """The blocks of `prompt` kvroute credits its one worker with, under `model`."""
    resp = await http.post("/debug/route", json={"model": model, "prompt": prompt}, headers=admin)
    resp.raise_for_status()
    return max((int(w["overlap_blocks"]) for w in resp.json()["workers"]), default=0)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("error", {}).get("message", ""))
    except ValueError:
        return resp.text
