"""vLLM KV-event wire format (vLLM 0.32, `vllm/distributed/kv_events.py`), both directions.

The structs mirror vLLM's exactly (field order, defaults, map layout with the "type" tag
first, defaults omitted) so that the simulator's frames are byte-compatible and decoding
real frames needs no guessing. Older vLLM sent events as arrays with the tag first; both
layouts decode. `decode_batch` turns a payload into engine-neutral `indexer.events`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer import events as ev
from indexer.hashing import EngineBlockHash

WireHash = int | bytes


class MalformedPayload(ValueError):
    """A payload that is not a vLLM KV event batch. Counted and dropped by the caller."""


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# The older layout: each event an array whose first element is the tag.
class _ArrStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_ArrEvent = _ArrStored | _ArrRemoved | _ArrCleared

_fast = msgspec.msgpack.Decoder(WireBatch)
_raw = msgspec.msgpack.Decoder(_RawBatch)
_encoder = msgspec.msgpack.Encoder()
_KNOWN = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def encode_batch(ts: float, events: list[WireEvent], dp_rank: int | None = 0) -> bytes:
    """Encode exactly as vLLM's publisher does (msgspec, map events, defaults omitted)."""
    return _encoder.encode(WireBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def decode_wire(payload: bytes) -> tuple[WireBatch, int]:
    """Decode to the mirrored wire structs; returns (batch, events skipped as unknown)."""
    try:
        return _fast.decode(payload), 0
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        raw = _raw.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedPayload(f"not a KV event batch: {exc}") from None
    known: list[WireEvent] = []
    skipped = 0
    for item in raw.events:
        event = _convert_one(item)
        if event is None:
            skipped += 1
        else:
            known.append(event)
    return WireBatch(raw.ts, known, raw.data_parallel_rank), skipped


def _convert_one(item: Any) -> WireEvent | None:
    """One event of either layout; None for a well-formed event of an unknown type."""
    try:
        if isinstance(item, dict):
            if item.get("type") not in _KNOWN:
                return None if isinstance(item.get("type"), str) else _bad(item)
            event: WireEvent = msgspec.convert(item, WireEvent)
            return event
        if isinstance(item, list) and item:
            if item[0] not in _KNOWN:
                return None if isinstance(item[0], str) else _bad(item)
            arr: _ArrStored | _ArrRemoved | _ArrCleared = msgspec.convert(item, _ArrEvent)
            return _from_array(arr)
    except msgspec.ValidationError as exc:
        raise MalformedPayload(f"bad event {str(item)[:120]}: {exc}") from None
    return _bad(item)


def _bad(item: Any) -> WireEvent:
    raise MalformedPayload(f"not a KV event: {str(item)[:120]}")


def _from_array(arr: _ArrStored | _ArrRemoved | _ArrCleared) -> WireEvent:
    if isinstance(arr, _ArrStored):
        return BlockStored(**msgspec.structs.asdict(arr))
    if isinstance(arr, _ArrRemoved):
        return BlockRemoved(**msgspec.structs.asdict(arr))
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> ev.EventBatch:
    """Decode a vLLM payload into engine-neutral events the index applies."""
    wire, skipped = decode_wire(payload)
    out: list[ev.KvEvent] = []
    for event in wire.events:
        if isinstance(event, BlockStored):
            if not _indexed_group(event.group_idx):
                skipped += 1
                continue
            out.append(_stored(event))
        elif isinstance(event, BlockRemoved):
            if not _indexed_group(event.group_idx):
                skipped += 1
                continue
            out.append(ev.BlockRemoved(_hashes(event.block_hashes), event.medium or "GPU"))
        else:
            out.append(ev.AllBlocksCleared())
    return ev.EventBatch(wire.ts, out, wire.data_parallel_rank, skipped)


def _indexed_group(group_idx: int | None) -> bool:
    # Hybrid models publish one chain per KV-cache group; the router matches prefixes on the
    # first (full-attention) group only.
    return group_idx is None or group_idx == 0


def _hashes(raw: list[WireHash]) -> list[EngineBlockHash]:
    return [h if type(h) is int else _bytes_hash(h) for h in raw]  # type: ignore[misc]


def _one_hash(h: WireHash) -> EngineBlockHash:
    return EngineBlockHash(h) if isinstance(h, int) else _bytes_hash(h)


def _bytes_hash(h: WireHash) -> EngineBlockHash:
    if not isinstance(h, bytes):
        raise MalformedPayload(f"block hash must be int or bytes, got {type(h).__name__}")
    return EngineBlockHash(int.from_bytes(h, "big"))


def _stored(event: BlockStored) -> ev.BlockStored:
    n = len(event.block_hashes)
    if n == 0 or event.block_size <= 0 or len(event.token_ids) != n * event.block_size:
        raise MalformedPayload(
            f"BlockStored with {n} hashes, block_size {event.block_size} and "
            f"{len(event.token_ids)} token ids (expected hashes * block_size)"
        )
    parent = None if event.parent_block_hash is None else _one_hash(event.parent_block_hash)
    salt, extras = _split_extra_keys(event.extra_keys, event.lora_name, parent is None)
    return ev.BlockStored(
        engine_hashes=_hashes(event.block_hashes),
        parent=parent,
        token_ids=event.token_ids,
        block_size=event.block_size,
        tier=event.medium or ev.DEFAULT_TIER,
        lora_name=event.lora_name,
        cache_salt=salt,
        block_extras=extras,
    )


def _split_extra_keys(
    extra_keys: list[list[Any] | None] | None, lora_name: str | None, starts_chain: bool
) -> tuple[str | None, list[str | None] | None]:
    """Pull cache_salt out of vLLM's per-block extra keys; keep what the router cannot
    reproduce from text (multimodal ids, prompt-embedding digests) as opaque per-block
    extras, so such blocks never match a text-only request.

    Per block vLLM lists, in order: the LoRA name (when set), (mm_id, offset) pairs, the
    cache_salt string (first block of a request only), prompt-embedding digests.
    """
    if not extra_keys:
        return None, None
    salt: str | None = None
    extras: list[str | None] = []
    opaque_seen = False
    for i, keys in enumerate(extra_keys):
        rest = list(keys or ())
        if lora_name is not None and rest and rest[0] == lora_name:
            rest = rest[1:]
        if i == 0 and starts_chain:
            strings = [k for k in rest if isinstance(k, str)]
            if strings:
                salt = strings[-1]
                rest.remove(salt)
        if rest:
            opaque_seen = True
            extras.append(repr(rest))
        else:
            extras.append(None)
    return salt, (extras if opaque_seen else None)
