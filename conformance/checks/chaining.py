"""Check 2: chaining. Router hashes computed from `token_ids` (engine hashes only as opaque
ids) agree with the engine's own cache across eviction, AllBlocksCleared, LoRA and
cache_salt, with uint64 and with 32-byte hashes; every BlockStored parent resolves. Each
scenario is captured with `kvroute events capture` (these captures are the golden fixtures)
and answered three ways: the engine's cached_tokens, kvroute's live index, and
`kvroute events replay` on the capture."""

from __future__ import annotations

import shutil
from pathlib import Path

from conformance.checks.wire_compare import compare_payloads
from conformance.registry import Findings, check
from conformance.scenario_run import run_scenario
from conformance.scenarios import Scenario, for_role
from conformance.session import Context
from conformance.targets import (
    BYTES_HASHES,
    CACHE_SALT,
    CACHED_TOKENS,
    KV_EVENTS,
    LORA,
    REPLAY,
    RESET,
    Engine,
)
from indexer.capture import read_capture

_COMMON = (KV_EVENTS, REPLAY, RESET, CACHED_TOKENS, CACHE_SALT)


def scenario_folder(ctx: Context, name: str) -> Path:
    base = ctx.fixtures_out if ctx.fixtures_out is not None else ctx.folder("captures")
    folder = base / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


async def run_role(ctx: Context, f: Findings, role: str) -> list[Path]:
    engine = await ctx.engine(role)
    return [
        await run_one(ctx, f, engine, sc, scenario_folder(ctx, sc.name)) for sc in for_role(role)
    ]


async def run_one(ctx: Context, f: Findings, engine: Engine, sc: Scenario, folder: Path) -> Path:
    out = await run_scenario(sc, engine, folder, ctx.folder("logs"))
    f.evidence.setdefault("scenarios", {})[sc.name] = {
        "answers (engine, kvroute live, kvroute replay)": {
            q.id: [q.engine_blocks, q.kvroute_live, q.kvroute_replay] for q in out.queries
        },
        **out.to_json(),
    }
    f.problems.extend(out.problems)
    return out.folder


@check(
    "chaining-32byte",
    "32-byte block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, sha256_cbor): parents "
    "resolve, overlaps equal the engine's cached_tokens, frames decode like vLLM's decoder",
    needs=(*_COMMON, BYTES_HASHES),
    engines=("bytes",),
)
async def chaining_bytes(ctx: Context, f: Findings) -> None:
    folders = await run_role(ctx, f, "bytes")
    payloads = [
        (f"{folder.name}#{m.seq}", m.payload)
        for folder in folders
        for m in read_capture(folder)
        if m.seq >= 0
    ]
    await compare_payloads(ctx, f, {"captured": payloads})
    kinds = {k for s in f.evidence["scenarios"].values() for k in s["capture"]["hash_kinds"]}
    f.require(kinds == {"32-byte"}, f"expected only 32-byte hashes on the wire, saw {kinds}")


@check(
    "chaining",
    "uint64 block hashes: parents resolve and kvroute's overlaps equal the engine's "
    "cached_tokens across eviction, AllBlocksCleared, LoRA, cache_salt and a block cached "
    "twice but evicted once",
    needs=(*_COMMON, LORA),
    engines=("main",),
)
async def chaining(ctx: Context, f: Findings) -> None:
    folders = await run_role(ctx, f, "main")
    kinds = {k for s in f.evidence["scenarios"].values() for k in s["capture"]["hash_kinds"]}
    f.require(kinds == {"int"}, f"expected only uint64 hashes on the wire, saw {kinds}")
    f.note("fixture_folders", [str(p) for p in folders])
