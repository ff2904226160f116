"""Golden tests on real vLLM 0.32.0 KV-event frames that the project captured itself
(`python -m conformance.capture_fixtures`, see tests/fixtures/README.md). No vLLM needed:
the frames are decoded, re-encoded, indexed and queried, and every query's expected
overlap is what vLLM itself reported as cached when the capture was made."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engines.vllm.events import BlockRemoved, BlockStored, decode_batch, decode_wire, encode_batch
from indexer.capture import CapturedMessage, read_capture
from indexer.clock import MonotonicClock
from indexer.hashing import Namespace, hash_blocks, hash_request
from indexer.index import Overlap, PrefixIndex
from indexer.ingest import WorkerIngest
from router.cli import main as kvroute

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32.0"
SCENARIOS = sorted(p.parent.name for p in FIXTURES.glob("*/frames_index.json"))
WORKER = "captured"
TOPIC = "kv-events"


def test_every_scenario_is_committed() -> None:
    assert SCENARIOS == [
        "all-blocks-cleared",
        "bytes-hashes",
        "cache-salt",
        "duplicate-block",
        "eviction",
        "int-hashes",
        "lora",
        "report-full",
    ]


def messages(scenario: str) -> list[CapturedMessage]:
    return list(read_capture(FIXTURES / scenario))


def batches(scenario: str) -> list[CapturedMessage]:
    """Each batch once, in sequence order (a capture may hold one both replayed and live)."""
    by_seq = {m.seq: m for m in messages(scenario) if m.seq >= 0}
    return [by_seq[s] for s in sorted(by_seq)]


def wire_events(scenario: str) -> list[Any]:
    return [e for m in batches(scenario) for e in decode_wire(m.payload)[0].events]


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expected(scenario: str) -> dict[str, int]:
    return {e["id"]: e["overlap_blocks"] for e in jsonl(FIXTURES / scenario / "expected.jsonl")}


def ingest(scenario: str) -> WorkerIngest:
    """Feed a capture the way `kvroute events replay` does: its replay answer, then live."""
    index = PrefixIndex()
    index.add_worker(WORKER)
    worker = WorkerIngest(WORKER, index, decode_batch, MonotonicClock())
    msgs = messages(scenario)
    replayed = [(m.seq, m.payload) for m in msgs if m.kind == "replay" and m.seq >= 0]
    if replayed:
        worker.finish_replay(replayed)
    for m in msgs:
        if m.kind == "pub":
            request = worker.on_live(m.seq, m.payload)
            if request is not None:
                answer = [(s, p) for s, p in replayed if s >= request.start_seq]
                worker.finish_replay(answer or None)
    return worker


def overlap(worker: WorkerIngest, tokens: Sequence[int], ns: Namespace) -> int:
    assert worker.block_size is not None
    found = worker.index.find_matches(hash_request(tokens, worker.block_size, ns)).get(WORKER)
    return found.blocks if found else 0


def queries(scenario: str) -> dict[str, dict[str, Any]]:
    return {q["id"]: q for q in jsonl(FIXTURES / scenario / "queries.jsonl")}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_frames_decode_and_reencode_byte_exact(scenario: str) -> None:
    msgs = [m for m in messages(scenario) if m.seq >= 0]
    assert msgs
    for m in msgs:
        assert m.topic == TOPIC
        batch, skipped = decode_wire(m.payload)
        assert skipped == 0
        assert encode_batch(batch.ts, batch.events, batch.data_parallel_rank) == m.payload
        assert len(decode_batch(m.payload).events) == len(batch.events)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_parents_resolve_and_nothing_is_dropped(scenario: str) -> None:
    c = ingest(scenario).counters
    assert (c.unknown_parent, c.malformed, c.skipped_events, c.unknown_removed) == (0, 0, 0, 0)
    assert c.blocks_stored > 0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_index_equals_a_plain_reference_model(scenario: str) -> None:
    """engine hash -> router hash and a count of cached copies, kept with dicts: store
    chains from the parent's router hash (a hash stored again is one more copy, unless in a
    chain from the root: vLLM re-reporting a cached prefix), remove one copy per
    BlockRemoved, clear on AllBlocksCleared."""
    held: dict[Any, int] = {}
    copies: Counter[Any] = Counter()
    for event in wire_events(scenario):
        if isinstance(event, BlockStored):
            if event.parent_block_hash is None:
                salt = _salt(event)
                seed = Namespace("", event.lora_name, salt).seed(event.block_size)
            else:
                seed = held[event.parent_block_hash]
            chain = hash_blocks(event.token_ids, event.block_size, seed)
            for h, rh in zip(event.block_hashes, chain, strict=True):
                if event.parent_block_hash is None and held.get(h) == rh:
                    continue  # a root chain's held block: a re-report, no copy
                held[h] = rh
                copies[h] += 1
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                copies[h] -= 1
                if not copies[h]:
                    del held[h], copies[h]
        else:
            held.clear()
            copies.clear()
    worker = ingest(scenario)
    assert worker.index.holds(WORKER) == set(held.values())
    worker.index.verify()


def _salt(event: BlockStored) -> str | None:
    first = list((event.extra_keys or [None])[0] or [])
    if event.lora_name is not None and first[:1] == [event.lora_name]:
        first = first[1:]
    return str(first[-1]) if first else None


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_index_answers_what_vllm_reported(scenario: str) -> None:
    worker = ingest(scenario)
    want = expected(scenario)
    got = {}
    for qid, q in queries(scenario).items():
        got[qid] = overlap(
            worker, q["token_ids"], Namespace("", q.get("lora_name"), q.get("cache_salt"))
        )
    assert got == want


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_kvroute_events_replay_output_is_expected(
    scenario: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = FIXTURES / scenario
    assert kvroute(["events", "replay", str(folder), "--query", str(folder / "queries.jsonl")]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert out == jsonl(folder / "expected.jsonl")


# ---- what each scenario is about ----------------------------------------------------------


def test_int_hashes() -> None:
    events = wire_events("int-hashes")
    assert all(type(h) is int for e in events for h in getattr(e, "block_hashes", ()))
    assert expected("int-hashes") == {
        "a-3": 3,
        "b-4": 4,
        "a-1": 1,
        "a-2-then-new": 2,
        "unseen": 0,
    }


def test_bytes_hashes_are_32_bytes_and_chain() -> None:
    events = wire_events("bytes-hashes")
    hashes = [h for e in events for h in getattr(e, "block_hashes", ())]
    assert hashes and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    parents = [e.parent_block_hash for e in events if isinstance(e, BlockStored)]
    assert any(isinstance(p, bytes) and len(p) == 32 for p in parents)
    assert any(isinstance(e, BlockRemoved) for e in events)


def chains(scenario: str) -> list[list[Any]]:
    """Engine hashes of each stored chain (a BlockStored without parent starts one)."""
    out: list[list[Any]] = []
    for e in wire_events(scenario):
        if isinstance(e, BlockStored):
            if e.parent_block_hash is None or not out:
                out.append([])
            out[-1] += e.block_hashes
    return out


def test_eviction_removes_the_oldest_chain_tail_first() -> None:
    removed = [
        h for e in wire_events("eviction") if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    first = chains("eviction")[0]
    assert removed and removed == first[len(first) - len(removed) :][::-1]
    want = expected("eviction")
    assert want["c1"] == len(first) - len(removed) < 36
    assert (want["c2"], want["c4"]) == (36, 24)


def test_a_block_cached_twice_and_evicted_once_still_counts() -> None:
    """vLLM recomputes the last block of a fully cached block-aligned prompt into a second
    copy (BlockStored again, same hash) and evicts copies one at a time."""
    events = wire_events("duplicate-block")
    stored = Counter(h for e in events if isinstance(e, BlockStored) for h in e.block_hashes)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and all(stored[h] == 2 for h in removed)
    assert expected("duplicate-block") == {"p-3": 3, "p-2": 2}


def test_a_rereported_prefix_leaves_with_the_engines_eviction() -> None:
    """Sent with `kv_cache_report_mode: full`, the prompt's second request makes vLLM
    publish its 3 cached blocks again from the root; the fillers then evict each once and
    vLLM serves none of them: nor does the index (counted as copies, it kept all 3)."""
    events = wire_events("report-full")
    stores = [e for e in events if isinstance(e, BlockStored)]
    first, again = stores[0], stores[1]
    assert again.parent_block_hash is None and len(again.block_hashes) == 3
    assert again.block_hashes == first.block_hashes and again.token_ids == first.token_ids
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(first.block_hashes) <= removed
    assert expected("report-full") == {"p-3": 0, "filler-100": 100}
    index = ingest("report-full").index
    seed = Namespace("").seed(first.block_size)
    assert index.find_matches(hash_blocks(first.token_ids, first.block_size, seed)) == {}
    [filler] = [q for q in jsonl(FIXTURES / "report-full" / "queries.jsonl") if q["id"] != "p-3"]
    held = index.find_matches(hash_blocks(filler["token_ids"], first.block_size, seed))
    assert held == {WORKER: Overlap(100, {"GPU": 100})}  # the same lookup finds what is held


def test_all_blocks_cleared_forgets_what_came_before() -> None:
    kinds = [type(e).__name__ for e in wire_events("all-blocks-cleared")]
    cleared = len(kinds) - 1 - kinds[::-1].index("AllBlocksCleared")
    assert "BlockStored" in kinds[:cleared] and kinds[cleared + 1 :] == ["BlockStored"]
    assert expected("all-blocks-cleared") == {"before-reset": 0, "after-reset": 2}


def test_lora_blocks_live_in_their_own_namespace() -> None:
    lora = [e for e in wire_events("lora") if isinstance(e, BlockStored) and e.lora_name]
    assert lora and all(e.lora_name == "lora-a" and e.lora_id == 1 for e in lora)
    assert all(keys and keys[0] == "lora-a" for e in lora for keys in e.extra_keys or [None])
    want = expected("lora")
    # the plain prompt shares only 2 blocks, so a plain query of the LoRA tokens stops there
    assert (want["lora-as-lora"], want["lora-as-plain"]) == (3, 2)
    assert (want["plain-as-plain"], want["plain-as-lora"]) == (3, 2)
    assert (want["lora-salt-as-both"], want["lora-salt-as-lora"]) == (2, 0)


def test_cache_salt_separates_tenants() -> None:
    salted = [e for e in wire_events("cache-salt") if isinstance(e, BlockStored) and e.extra_keys]
    assert any(e.extra_keys and e.extra_keys[0] == ["tenant-a"] for e in salted)
    want = expected("cache-salt")
    assert (want["salted-as-a"], want["salted-as-plain"], want["salted-as-b"]) == (3, 2, 0)
    assert (want["plain-as-plain"], want["plain-as-a"]) == (3, 2)


def test_fixtures_say_how_they_were_made() -> None:
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert manifest["versions"]["vllm"].startswith("0.32.0")
    assert (FIXTURES.parent / "README.md").exists()
    for scenario in SCENARIOS:
        doc = json.loads((FIXTURES / scenario / "scenario.json").read_text())
        assert doc["name"] == scenario and doc["steps"]
        assert doc["engine"]["block_size"] == 32
