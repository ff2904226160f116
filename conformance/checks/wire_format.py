"""Check 1: the KV-event wire format. Every batch the engine published (live and from the
replay socket, byte-identical) decodes with kvroute's adapter exactly as with vLLM's own
msgspec `KVEventBatch` decoder, field by field; on the vLLM target the simulator's frames
must decode with vLLM's decoder too."""

from __future__ import annotations

import asyncio

from conformance.checks.wire_compare import compare_payloads
from conformance.client import client
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import (
    KV_EVENTS,
    LORA,
    REPLAY,
    RESET,
    ROLES,
    VLLM_DECODER,
    Engine,
    SimTarget,
)
from conformance.traffic import FrameTap, mixed_traffic, replayed_frames
from conformance.wire import Payload


async def engine_frames(engine: Engine, f: Findings, label: str) -> list[Payload]:
    """Drive mixed traffic while tapping the PUB socket, then fetch everything buffered."""
    async with client(engine.url) as http, FrameTap(engine.events_endpoint, engine.topic) as tap:
        sent = await mixed_traffic(engine, http, label)
    replayed = dict(await replayed_frames(engine))
    live_only = sorted(set(tap.frames) - set(replayed))
    differ = sorted(s for s in tap.frames if s in replayed and tap.frames[s] != replayed[s])
    f.note(
        f"{label}_stream",
        {
            "requests_sent": sent,
            "live_batches": len(tap.frames),
            "replayed_batches": len(replayed),
            "topics": sorted(t.decode() for t in tap.topics),
            "replay_byte_identical_to_live": not differ and not live_only,
        },
    )
    f.require(bool(tap.frames), f"{label}: no live batch arrived on {engine.events_endpoint}")
    f.require(not differ, f"{label}: replayed batches {differ[:10]} differ from live ones")
    f.require(not live_only, f"{label}: live batches {live_only[:10]} missing from the replay")
    f.require(tap.topics <= {engine.topic.encode()}, f"{label}: topic frames {tap.topics}")
    return [(f"{label}#{seq}", payload) for seq, payload in sorted(replayed.items())]


@check(
    "wire-format",
    "every published batch (live == replayed, byte for byte) decodes with kvroute's adapter "
    "field by field like vLLM's own KVEventBatch decoder; so do the simulator's frames",
    needs=(KV_EVENTS, REPLAY, RESET, LORA),
    engines=("main",),
)
async def wire_format(ctx: Context, f: Findings) -> None:
    engine = await ctx.engine("main")
    sets = {ctx.target.name: await engine_frames(engine, f, ctx.target.name)}
    if ctx.target.features().get(VLLM_DECODER) is None and ctx.target.name != "sim":
        for role in ("main", "bytes"):
            sets[f"sim-{role}"] = await _sim_frames(f, role)
    await compare_payloads(ctx, f, sets)


async def _sim_frames(f: Findings, role: str) -> list[Payload]:
    """The simulator's frames, for vLLM's decoder to judge."""
    sim = await asyncio.to_thread(SimTarget().start, ROLES[role])
    try:
        return await engine_frames(sim, f, f"sim-{role}")
    finally:
        sim.stop()
