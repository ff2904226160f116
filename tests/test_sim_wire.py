"""The simulator's KV events are vLLM's on the wire, and replaying them into a fresh router
index reproduces the simulator's own cache exactly (its ground truth), eviction and reset
included."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from engines.sim.blockpool import CacheKeys
from engines.sim.config import SimConfig
from engines.sim.engine import VirtualClock
from engines.sim.request import Sampling
from engines.sim.worker import SimWorker
from engines.vllm.events import decode_batch, decode_wire
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest

BS = 16
MODEL = "kvroute-sim"


async def workload(worker: SimWorker, rng: random.Random) -> list[tuple[list[int], str | None]]:
    """Rounds of concurrent requests from prefix families in a pool far too small for them,
    with a reset half way. Returns the prompts to probe afterwards."""
    words = worker.tokenizer.word_ids
    families = [[0] + [words[(f * 97 + i * 13) % len(words)] for i in range(400)] for f in range(6)]
    probes: list[tuple[list[int], str | None]] = []
    for round_ in range(12):
        batch = []
        for f in rng.sample(range(6), 3):  # one prompt per family per round: no twin blocks
            tail = [rng.randrange(4, 2000)] * rng.randrange(0, 30)
            ids = families[f][: rng.randrange(20, 400)] + tail
            if len(ids) % BS == 0:  # a block-aligned repeat makes a twin block: see blockpool
                ids.append(3)
            salt = "tenant" if f == 5 else None
            probes.append((ids, salt))
            batch.append(_run(worker, ids, rng.randrange(1, 150), salt))
        await asyncio.gather(*batch)
        if round_ == 6:
            assert worker.engine.reset_prefix_cache()
    return probes


async def _run(worker: SimWorker, ids: list[int], max_tokens: int, salt: str | None) -> None:
    handle = worker.engine.submit(
        ids, Sampling(max_tokens, ignore_eos=True), CacheKeys(cache_salt=salt)
    )
    async for _ in handle.outputs():
        pass


@pytest.mark.parametrize("int_hashes", [True, False], ids=["uint64", "bytes32"])
async def test_replayed_events_reproduce_the_ground_truth(int_hashes: bool) -> None:
    clock = VirtualClock()
    config = SimConfig(kv_blocks=48, block_size=BS, int_hashes=int_hashes, max_num_seqs=3)
    worker = SimWorker(config, clock=clock, sleep=clock.sleep)
    await worker.engine.start()
    probes = await workload(worker, random.Random(7))
    assert worker.engine.stats().preemptions > 0  # the pool really was too small
    await worker.engine.stop()

    index = PrefixIndex()
    index.add_worker("w", model=MODEL)
    ingest = WorkerIngest("w", index, decode_batch, FakeClock(), has_replay=False, block_size=BS)
    assert worker.publisher is not None
    for seq, payload in worker.publisher.buffered():
        assert ingest.on_live(seq, payload) is None
    c = ingest.counters
    assert c.events["BlockRemoved"] > 50 and c.events["AllBlocksCleared"] == 1
    assert (c.gaps, c.malformed, c.unknown_parent, c.unknown_removed, c.skipped_events) == (0,) * 5
    index.verify()

    for ids, salt in probes:
        hashes = hash_request(ids, BS, Namespace(MODEL, cache_salt=salt))
        overlap = index.find_matches(hashes).get("w")
        truth = worker.engine.cached_tokens(ids, CacheKeys(cache_salt=salt)) // BS
        assert (overlap.blocks if overlap else 0) == truth


async def test_payloads_are_vllm_maps_with_defaults_omitted() -> None:
    clock = VirtualClock()
    worker = SimWorker(SimConfig(kv_blocks=8, block_size=4), clock=clock, sleep=clock.sleep)
    await worker.engine.start()
    for first in (5, 6, 7):
        await _run(worker, [first] * 12, 1, None)
    await worker.engine.stop()
    assert worker.publisher is not None
    buffered = worker.publisher.buffered()
    assert [seq for seq, _ in buffered] == list(range(len(buffered)))
    raw = [msgspec.msgpack.decode(p) for _, p in buffered]
    ts, events, dp_rank = raw[0]
    assert isinstance(ts, float) and dp_rank == 0
    stored = events[0]
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    removed = next(e for _, evs, _ in raw for e in evs if e["type"] == "BlockRemoved")
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": removed["block_hashes"],
        "medium": "GPU",
        "group_idx": 0,
    }
    for _, payload in buffered:
        assert decode_wire(payload)[1] == 0


VLLM_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
dec, enc = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
payloads = msgspec.msgpack.decode(sys.stdin.buffer.read())
kinds = set()
for p in payloads:
    batch = dec.decode(p)
    kinds.update(type(e).__name__ for e in batch.events)
    assert enc.encode(batch) == p, "not byte-identical"
print(sorted(kinds))
"""


@pytest.mark.slow
async def test_vllms_own_decoder_reads_the_frames_byte_for_byte() -> None:
    """Decode with vLLM's `KVEventBatch` in the conformance venv (skipped without it)."""
    from conformance.vllm_server import VllmError, vllm_python

    try:
        python = vllm_python()
    except VllmError as exc:
        pytest.skip(str(exc))
    payloads: list[bytes] = []
    for int_hashes in (True, False):
        clock = VirtualClock()
        config = SimConfig(kv_blocks=10, block_size=4, int_hashes=int_hashes)
        worker = SimWorker(
            config.replace(lora_modules=(("ad", "/p"),)), clock=clock, sleep=clock.sleep
        )
        await worker.engine.start()
        for i in range(6):
            keys = CacheKeys("ad", "/p", 1, "salt") if i == 2 else CacheKeys()
            handle = worker.engine.submit([i + 5] * 13, Sampling(6, ignore_eos=True), keys)
            async for _ in handle.outputs():
                pass
            if i == 3:
                assert worker.engine.reset_prefix_cache()
        await worker.engine.stop()
        assert worker.publisher is not None
        payloads += [p for _, p in worker.publisher.buffered()]
    proc = await asyncio.create_subprocess_exec(
        str(python),
        "-c",
        VLLM_DECODE,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(msgspec.msgpack.encode(payloads)), 240)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert (
        out.decode().strip().splitlines()[-1]
        == "['AllBlocksCleared', 'BlockRemoved', 'BlockStored']"
    )
