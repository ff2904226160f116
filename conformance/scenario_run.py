"""Run a scenario against an engine: capture its KV events with `kvroute events capture`,
then ask the engine (from a replayed, identical state) what it holds for each query, and
compare three answers per query: the engine's `cached_tokens`, kvroute's live index (the
router's subscriber and ingest), and `kvroute events replay` over the captured frames.

The folder it writes is a fixture: frames + frames_index.json + queries.jsonl +
expected.jsonl + scenario.json.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conformance.capture import CaptureProcess, replay_queries, trim_capture
from conformance.client import client, complete, reset_prefix_cache
from conformance.observe import Observer
from conformance.scenarios import BLOCK, Query, Reset, Scenario, Step
from conformance.targets import Engine
from conformance.wire import capture_summary
from indexer.subscriber import ReplayClient

PROBE_TAIL = 7  # one token after the query's blocks: vLLM never serves a prompt's last token


@dataclass
class QueryOutcome:
    id: str
    engine_blocks: int  # cached_tokens // block_size of the probe
    kvroute_live: int  # the live index's overlap just before the probe
    kvroute_replay: int | None = None  # `kvroute events replay` on the capture

    @property
    def agree(self) -> bool:
        return self.engine_blocks == self.kvroute_live == self.kvroute_replay


@dataclass
class ScenarioOutcome:
    name: str
    folder: Path
    queries: list[QueryOutcome] = field(default_factory=list)
    capture: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    reproducible: bool = True  # each replayed run ended with the captured run's index
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "queries": [q.__dict__ for q in self.queries],
            "capture": self.capture,
            "live_index_counters": self.counters,
            "reproducible": self.reproducible,
            "problems": self.problems,
        }


class _Driver:
    """Sends a scenario's steps and keeps the observer in step with the engine."""

    def __init__(self, engine: Engine, http: httpx.AsyncClient, obs: Observer) -> None:
        self.engine = engine
        self.http = http
        self.obs = obs

    def model(self, lora: bool) -> str:
        if lora and self.engine.lora_name is None:
            raise ValueError(f"engine {self.engine.spec.role} serves no LoRA adapter")
        return self.engine.lora_name if lora and self.engine.lora_name else self.engine.model

    async def step(self, step: Step) -> None:
        if isinstance(step, Reset):
            await reset_prefix_cache(self.http)
            return
        xargs = {"kv_cache_report_mode": "full"} if step.report_full else None
        await complete(
            self.http, self.model(step.lora), list(step.tokens), cache_salt=step.salt, xargs=xargs
        )
        ns = self.obs.namespace(self.engine.lora_name if step.lora else None, step.salt)
        await self.obs.wait_blocks(step.tokens, ns, len(step.tokens) // BLOCK)

    async def run(self, steps: tuple[Step, ...]) -> None:
        await reset_prefix_cache(self.http)
        for step in steps:
            await self.step(step)
        await self.obs.settle()

    async def probe(self, q: Query) -> QueryOutcome:
        ns = self.obs.namespace(self.engine.lora_name if q.lora else None, q.salt)
        live = self.obs.overlap(q.tokens, ns)
        prompt = [*q.tokens, PROBE_TAIL]
        done = await complete(self.http, self.model(q.lora), prompt, cache_salt=q.salt)
        await self.obs.settle()
        return QueryOutcome(q.id, done.cached_tokens // BLOCK, live)


async def last_seq(engine: Engine) -> int | None:
    """The newest batch the engine has published (from its replay buffer), None if none."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        frames = await ReplayClient(ctx, engine.replay_endpoint, timeout_s=5.0).fetch(0)
    finally:
        ctx.destroy(linger=0)
    if frames is None:
        raise RuntimeError(f"replay socket {engine.replay_endpoint} did not answer")
    return max((seq for seq, _ in frames), default=None)


async def run_scenario(
    sc: Scenario, engine: Engine, folder: Path, log_dir: Path
) -> ScenarioOutcome:
    out = ScenarioOutcome(sc.name, folder)
    async with (
        client(engine.url) as http,
        Observer(
            engine.events_endpoint, engine.replay_endpoint, engine.topic, block_size=BLOCK
        ) as obs,
    ):
        drv = _Driver(engine, http, obs)
        await _captured_run(sc, engine, drv, out, log_dir)
        final = obs.holds()
        for q in sc.queries:
            await drv.run(sc.steps)
            out.reproducible &= obs.holds() == final
            out.queries.append(await drv.probe(q))
        out.counters = obs.counter_summary()
    _write_queries(sc, folder)
    answers = replay_queries(folder, folder / "queries.jsonl")
    for outcome, answer in zip(out.queries, answers, strict=True):
        outcome.kvroute_replay = int(answer["overlap_blocks"])
    _write_expected(out, folder)
    _judge(sc, out)
    return out


async def _captured_run(
    sc: Scenario, engine: Engine, drv: _Driver, out: ScenarioOutcome, log_dir: Path
) -> None:
    await reset_prefix_cache(drv.http)
    before = await last_seq(engine)
    first = 0 if before is None else before + 1
    endpoints = (engine.events_endpoint, engine.replay_endpoint, engine.topic)
    cap = CaptureProcess(*endpoints, out.folder, log_dir)
    await cap.start()
    try:
        for step in sc.steps:
            await drv.step(step)
        await drv.obs.settle()
        await cap.stop_after(drv.obs.ingest.tracker.last_applied)
    finally:
        cap.kill()
    out.capture = {"dropped_history_messages": trim_capture(out.folder, first), "first_seq": first}
    out.capture |= capture_summary(out.folder)
    (out.folder / "scenario.json").write_text(json.dumps(_describe(sc, engine), indent=1) + "\n")


def _describe(sc: Scenario, engine: Engine) -> dict[str, Any]:
    """What was sent, compactly: conformance/scenarios.py regenerates the token ids (seeded),
    and the fingerprint says whether it still does."""
    steps: list[dict[str, Any]] = []
    for s in sc.steps:
        if isinstance(s, Reset):
            steps.append({"reset_prefix_cache": True})
        else:
            digest = hashlib.sha256(json.dumps(list(s.tokens)).encode()).hexdigest()[:16]
            steps.append(
                {"tokens": len(s.tokens), "token_ids_sha256": digest, "lora": s.lora}
                | ({"cache_salt": s.salt} if s.salt else {})
                | ({"vllm_xargs": {"kv_cache_report_mode": "full"}} if s.report_full else {})
            )
    return {
        "name": sc.name,
        "description": sc.description,
        "engine": {k: v for k, v in engine.describe().items() if k not in ("url", "log")},
        "model": engine.model,
        "lora_name": engine.lora_name,
        "steps": steps,
        "probe": f"query token_ids + [{PROBE_TAIL}], max_tokens=1, from a replayed scenario",
    }


def _write_queries(sc: Scenario, folder: Path) -> None:
    lines = []
    for q in sc.queries:
        doc: dict[str, Any] = {"id": q.id, "token_ids": list(q.tokens)}
        if q.lora:
            doc["lora_name"] = "lora-a"
        if q.salt is not None:
            doc["cache_salt"] = q.salt
        lines.append(json.dumps(doc))
    (folder / "queries.jsonl").write_text("\n".join(lines) + "\n")


def _write_expected(out: ScenarioOutcome, folder: Path) -> None:
    lines = [json.dumps({"id": q.id, "overlap_blocks": q.engine_blocks}) for q in out.queries]
    (folder / "expected.jsonl").write_text("\n".join(lines) + "\n")


def _judge(sc: Scenario, out: ScenarioOutcome) -> None:
    p = out.problems
    for q in out.queries:
        if not q.agree:
            p.append(
                f"{sc.name}/{q.id}: engine cached {q.engine_blocks} blocks, kvroute live index "
                f"{q.kvroute_live}, kvroute events replay {q.kvroute_replay}"
            )
    if not any(q.engine_blocks for q in out.queries):
        p.append(f"{sc.name}: the engine reported no cached block for any query")
    if not out.reproducible:
        p.append(f"{sc.name}: a replayed run ended with a different index than the captured one")
    unknown = out.counters.get("unknown_parent", 0)
    if unknown:
        p.append(f"{sc.name}: {unknown} BlockStored events named a parent never stored")
    missing = sc.expect_events - set(out.capture.get("events", {}))
    if missing:
        p.append(f"{sc.name}: the capture holds no {sorted(missing)} event")
