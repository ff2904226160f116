"""The vLLM adapter on hand-built payloads of every documented shape."""

from __future__ import annotations

import msgspec
import pytest

from engines.vllm import events as wire
from indexer import events as ev

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
