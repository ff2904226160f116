"""Check: a router (re)started beside a busy engine indexes the engine's whole replay buffer.

vLLM keeps the last 10,000 event batches for replay and sends a replay in one loop on a
ROUTER socket whose 1,000-message queue drops what overflows. kvroute fetches that buffer
whenever it (re)connects to a worker: every router start, rollout and rediscovery. Here
vLLM's own `ZmqEventPublisher` (conformance/vllm_replay_publisher.py, in the vLLM venv)
holds 10,000 batches of 64 blocks before kvroute's subscriber connects; the check asserts
that kvroute's index then holds every one of their blocks, found by hashing their tokens
itself, with no resync and no failed replay. Its evidence also shows the event loop's
longest stall while the replay went in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import zmq.asyncio

from conformance.model import REPO_ROOT
from conformance.procs import free_ports
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import REPLAY
from conformance.vllm_replay_publisher import tokens_of
from conformance.vllm_server import vllm_python
from engines.vllm.events import decode_batch
from indexer.clock import MonotonicClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest
from indexer.subscriber import EventSubscriber

BATCHES = 10_000  # vLLM's default buffer_steps: the whole buffer
BLOCKS = 64
BLOCK_SIZE = 32
START_S = 180.0  # importing vLLM and publishing the batches
APPLY_S = 60.0


@check(
    "replay-buffer",
    "vLLM's ZmqEventPublisher holding its whole 10,000-batch replay buffer: a subscriber "
    "that connects afterwards indexes every block, with no resync or failed replay",
    needs=(REPLAY,),
    targets=("vllm",),
    timeout_s=300.0,
)
async def replay_buffer(ctx: Context, f: Findings) -> None:
    events_port, replay_port = free_ports(2)
    log_path = ctx.folder("replay-buffer") / "publisher.log"
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            str(vllm_python()),
            "-m",
            "conformance.vllm_replay_publisher",
            f"--events-port={events_port}",
            f"--replay-port={replay_port}",
            f"--batches={BATCHES}",
            f"--blocks={BLOCKS}",
            f"--block-size={BLOCK_SIZE}",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            cwd=REPO_ROOT,
        )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), START_S)
        if not f.require(bool(line), f"vLLM's publisher did not start; see {log_path}"):
            return
        f.note("publisher", json.loads(line))
        await _subscribe(f, f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}")
    finally:
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _subscribe(f: Findings, endpoint: str, replay_endpoint: str) -> None:
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, decode_batch, MonotonicClock())
    ctx = zmq.asyncio.Context()
    sub = EventSubscriber(
        ingest, endpoint, replay_endpoint=replay_endpoint, topic="kv-events", ctx=ctx
    )
    stall = 0.0

    async def tick() -> None:  # the longest the event loop was held while the replay went in
        nonlocal stall
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            stall = max(stall, now - last)
            last = now

    ticker = asyncio.create_task(tick())
    task = asyncio.create_task(sub.run())
    started = time.monotonic()
    try:
        deadline = started + APPLY_S
        while ingest.tracker.last_applied != BATCHES - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        f.note("indexed_in_s", round(time.monotonic() - started, 2))
    finally:
        for t in (task, ticker):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        ctx.destroy(linger=0)
    c = ingest.counters
    f.note("last_applied", ingest.tracker.last_applied)
    f.note("blocks_indexed", index.entries_of("w"))
    f.note(
        "counters",
        {
            "replays": c.replays,
            "replay_failures": c.replay_failures,
            "resyncs": c.resyncs,
            "gaps": c.gaps,
            "catchups": c.catchups,
        },
    )
    f.note("longest_loop_stall_ms", round(stall * 1000, 1))
    f.require(
        ingest.tracker.last_applied == BATCHES - 1,
        f"applied up to batch {ingest.tracker.last_applied}, not {BATCHES - 1}",
    )
    f.require(
        index.entries_of("w") == BATCHES * BLOCKS,
        f"{index.entries_of('w')} blocks indexed of the {BATCHES * BLOCKS} the engine holds",
    )
    f.require(
        c.resyncs == 0 and c.replay_failures == 0,
        f"resyncs {c.resyncs}, failed replays {c.replay_failures}",
    )
    credited = {b: _blocks_found(index, b) for b in (0, BATCHES // 2, BATCHES - 1)}
    f.note("blocks_credited_by_batch", credited)
    f.require(
        all(n == BLOCKS for n in credited.values()),
        f"kvroute's own hashes of a batch's tokens find {credited} blocks, not {BLOCKS} each",
    )


def _blocks_found(index: PrefixIndex, batch: int) -> int:
    hashes = hash_request(tokens_of(batch, BLOCKS, BLOCK_SIZE), BLOCK_SIZE, Namespace())
    match = index.find_matches(hashes).get("w")
    return match.blocks if match else 0
