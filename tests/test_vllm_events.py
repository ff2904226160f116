"""The vLLM adapter on hand-built payloads of every documented shape, and on hostile ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engines import msgpack_guard
from engines.vllm import events as wire
from engines.vllm.fuzz import hostile_payloads
from indexer import events as ev
from indexer.capture import read_capture
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32.0"

enc = msgspec.msgpack.Encoder()
BS = 4


def stored_map(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    doc.update(over)
    return doc


def payload(events: list[object], dp: int | None = 0) -> bytes:
    return enc.encode([1.5, events, dp])


def test_map_layout_with_every_optional_field() -> None:
    full = stored_map(
        extra_keys=[None, None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
        ownership="x",
        session_id="s",
    )
    batch = wire.decode_batch(payload([full]))
    assert batch.ts == 1.5 and batch.dp_rank == 0
    (stored,) = batch.events
    assert isinstance(stored, ev.BlockStored)
    assert list(stored.engine_hashes) == [11, 12]
    assert stored.parent is None and stored.block_size == BS and stored.tier == "GPU"


def test_unknown_extra_fields_are_tolerated() -> None:
    batch = wire.decode_batch(payload([stored_map(future_field={"a": 1})]))
    assert isinstance(batch.events[0], ev.BlockStored)


def test_older_array_layout() -> None:
    old = ["BlockStored", [1, 2], None, list(range(8)), BS, None, "GPU", None]
    removed = ["BlockRemoved", [1], "GPU"]
    batch = wire.decode_batch(payload([old, removed, ["AllBlocksCleared"]]))
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_bytes_hashes_become_opaque_ints() -> None:
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    batch = wire.decode_batch(payload([stored_map(block_hashes=[h1, h2], parent_block_hash=h1)]))
    (stored,) = batch.events
    assert isinstance(stored, ev.BlockStored)
    assert stored.parent == int.from_bytes(h1, "big")
    assert list(stored.engine_hashes) == [int.from_bytes(h, "big") for h in (h1, h2)]


def test_cache_salt_and_lora_come_out_of_extra_keys() -> None:
    salted = stored_map(extra_keys=[["tenant-A"], None])
    lora = stored_map(lora_name="ad", lora_id=1, extra_keys=[["ad", "tenant-B"], ["ad"]])
    a, b = wire.decode_batch(payload([salted, lora])).events
    assert isinstance(a, ev.BlockStored) and isinstance(b, ev.BlockStored)
    assert (a.cache_salt, a.lora_name, a.block_extras) == ("tenant-A", None, None)
    assert (b.cache_salt, b.lora_name, b.block_extras) == ("tenant-B", "ad", None)


def test_multimodal_keys_make_blocks_opaque() -> None:
    mm = stored_map(extra_keys=[[["img-1", 0]], None])
    (stored,) = wire.decode_batch(payload([mm])).events
    assert isinstance(stored, ev.BlockStored)
    assert stored.block_extras is not None and stored.block_extras[0] is not None
    assert stored.cache_salt is None


def test_other_kv_groups_and_unknown_types_are_skipped() -> None:
    events = [stored_map(group_idx=1), {"type": "SomethingNew", "x": 1}, stored_map()]
    batch = wire.decode_batch(payload(events))
    assert batch.skipped == 2 and len(batch.events) == 1


def wire_stored(
    hashes: list[wire.WireHash], tokens: list[int], block_size: int, medium: str
) -> wire.BlockStored:
    return wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_a_cpu_offload_store_without_tokens_is_skipped_and_its_batch_applies() -> None:
    """vLLM's OffloadingConnector adds, to the same step's batch as the GPU stores, a
    BlockStored with no token ids and its own (larger) block size for blocks it copied to
    CPU. The router cannot hash it, but the GPU blocks beside it must reach the index."""
    tokens = list(range(2 * BS))
    gpu = wire_stored([11, 12], tokens, BS, "GPU")
    offload = wire_stored([1234567, 7654321], [], 16 * BS, "CPU")
    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, wire.decode_batch, FakeClock())
    ingest.on_live(0, wire.encode_batch(1.0, [gpu, offload]))
    c = ingest.counters
    assert (c.malformed, c.skipped_events, c.blocks_stored) == (0, 1, 2)
    assert ingest.block_size == BS  # the offload event's block size is not learned
    overlap = index.find_matches(hash_request(tokens, BS, Namespace()))["w"]
    assert overlap.blocks == 2


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        enc.encode({"not": "a batch"}),
        payload([stored_map(token_ids=[1, 2, 3])]),
        payload([stored_map(block_hashes=[])]),
        payload([stored_map(block_hashes=["str"])]),
        payload([42]),
    ],
    ids=["not-msgpack", "map", "token-count", "no-hashes", "str-hash", "int-event"],
)
def test_malformed_payloads_raise(raw: bytes) -> None:
    with pytest.raises(wire.MalformedPayload):
        wire.decode_batch(raw)


HOSTILE = hostile_payloads()


@pytest.mark.parametrize(
    ("payload", "reason"), [(p, r) for _, p, r in HOSTILE], ids=[n for n, _, _ in HOSTILE]
)
def test_hostile_payloads_are_refused_with_their_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(wire.MalformedPayload) as caught:
        wire.decode_batch(payload)
    assert caught.value.reason == reason


def test_deep_nesting_is_refused_before_msgspec_recurses() -> None:
    """With the recursion limit raised, msgspec itself would crash the process on these
    (it recurses in C); the structural check must stop them first. In a child process, so
    a regression fails this test instead of killing the run."""
    script = (
        "import sys; sys.setrecursionlimit(1_000_000)\n"
        "from engines.vllm.events import decode_batch, MalformedPayload\n"
        "from engines.vllm.fuzz import hostile_payloads\n"
        "for name, payload, reason in hostile_payloads():\n"
        "    if reason != 'too_deep': continue\n"
        "    try: decode_batch(payload)\n"
        "    except MalformedPayload as exc: assert exc.reason == reason, name\n"
        "    else: raise AssertionError(name)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-2000:]


def test_real_frames_take_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every frame real vLLM sent decodes without the (slow, Python) structural walk."""

    def walked(data: bytes, limits: msgpack_guard.Limits) -> None:
        raise AssertionError("a real frame needed the structural check")

    monkeypatch.setattr(wire, "check_structure", walked)
    payloads = [m.payload for d in FIXTURES.iterdir() if d.is_dir() for m in read_capture(d)]
    assert len([wire.decode_batch(p) for p in payloads if p]) >= 20


def test_prompt_embedding_digests_take_the_lenient_path() -> None:
    digest = bytes(range(32))
    (stored,) = wire.decode_batch(payload([stored_map(extra_keys=[[digest], None])])).events
    assert isinstance(stored, ev.BlockStored)
    assert stored.block_extras is not None and stored.block_extras[0] is not None


def test_encoder_omits_defaults_and_puts_type_first() -> None:
    event = wire.BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0)
    raw = wire.encode_batch(2.0, [event], 0)
    decoded = msgspec.msgpack.decode(raw)
    assert decoded[1][0] == {
        "type": "BlockRemoved",
        "block_hashes": [5],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert next(iter(decoded[1][0])) == "type"


def test_a_hybrid_models_full_attention_group_is_indexed_whatever_its_number() -> None:
    """A model whose first layer is sliding-window (Gemma 3, gpt-oss) has group 0 sliding:
    its blocks go as the window moves, while the full-attention group still holds the
    prefix. The stream's decoder learns the full group from the stores and keeps to it,
    for removals too (which do not name their kind)."""
    tokens = list(range(3 * BS))
    hashes: list[wire.WireHash] = [21, 22, 23]

    def group(idx: int, kind: str) -> wire.BlockStored:
        s = wire_stored(hashes, tokens, BS, "GPU")
        return msgspec.structs.replace(s, group_idx=idx, kv_cache_spec_kind=kind)

    index = PrefixIndex()
    index.add_worker("w")
    ingest = WorkerIngest("w", index, wire.StreamDecoder(), FakeClock())
    stores = [group(0, "sliding_window"), group(1, "full_attention")]
    ingest.on_live(0, wire.encode_batch(1.0, stores))
    slid = wire.BlockRemoved(block_hashes=hashes[:2], medium="GPU", group_idx=0)
    ingest.on_live(1, wire.encode_batch(2.0, [slid]))  # the window moved on
    request = hash_request(tokens, BS, Namespace())
    assert index.find_matches(request)["w"].blocks == 3
    evicted = wire.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=1)
    ingest.on_live(2, wire.encode_batch(3.0, [evicted]))
    assert "w" not in index.find_matches(request)
    assert ingest.counters.skipped_events == 2
