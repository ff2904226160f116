"""vLLM KV-event wire format (vLLM 0.32, `vllm/distributed/kv_events.py`), both directions.

The structs mirror vLLM's exactly (field order, defaults, map layout with the "type" tag
first, defaults omitted) so that the simulator's frames are byte-compatible and decoding
real frames needs no guessing. Older vLLM sent events as arrays with the tag first; both
layouts decode. `decode_batch` turns a payload into engine-neutral `indexer.events`.

Payloads are untrusted: whatever arrives on the socket either decodes to events the index
can apply, or raises `MalformedPayload` with a `reason` (the label of the ingest's counter):

    too_large       more bytes than `Limits.max_bytes`
    too_deep        nested deeper than `Limits.max_depth`
    too_long        a list or map with more than `Limits.max_items` items
    decode          not msgpack, or not the `[ts, events, dp_rank]` array
    bad_type        an event that is not a map or an array, or whose type tag is no string
    bad_event       an event whose fields have the wrong types, counts or ranges
    bad_extra_keys  `extra_keys` not one entry per block

Well-formed events the router cannot use are skipped, not refused, and the rest of their
batch applies: other KV-cache groups, unknown event types, and stores without token ids
(what vLLM's offloading connectors publish for blocks they copied to CPU).

Decoding tries a fully typed decoder first: it cannot recurse deeper than the structs do,
so it needs no pre-check and is the path every payload of today's vLLM takes. Anything it
refuses (a field from a newer vLLM, the older array layout, bytes in `extra_keys`, junk)
is first walked by `engines.msgpack_guard` and only then handed to the lenient decoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from engines.msgpack_guard import Limits, StructureError, check_size, check_structure
from indexer import events as ev
from indexer.hashing import EngineBlockHash
from indexer.ingest import MalformedBatch

WireHash = int | bytes
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
LIMITS = Limits()


class MalformedPayload(MalformedBatch):
    """A payload that is not a vLLM KV event batch. Counted (by `reason`) and dropped by
    the caller."""


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[TokenId]
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

# What vLLM puts in `extra_keys`: LoRA names, cache salts, (mm identifier, offset) pairs.
# Prompt-embedding digests (bytes) take the lenient path: a union may hold str or bytes.
_TypedExtraKeys = list[list[str | int | list[str | int]] | None] | None


class _Typed:
    """The same events with every field typed and unknown fields refused: decoding them
    cannot nest deeper than the structs, whatever the bytes say. Same names, same tags."""

    class BlockStored(BlockStored, forbid_unknown_fields=True, tag="BlockStored"):
        extra_keys: _TypedExtraKeys = None

    class BlockRemoved(BlockRemoved, forbid_unknown_fields=True, tag="BlockRemoved"):
        pass

    class AllBlocksCleared(AllBlocksCleared, forbid_unknown_fields=True, tag="AllBlocksCleared"):
        pass

    class Batch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[_Typed.BlockStored | _Typed.BlockRemoved | _Typed.AllBlocksCleared]
        data_parallel_rank: int | None = None


_typed = msgspec.msgpack.Decoder(_Typed.Batch)
_fast = msgspec.msgpack.Decoder(WireBatch)
_raw = msgspec.msgpack.Decoder(_RawBatch)
_encoder = msgspec.msgpack.Encoder()
_KNOWN = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def encode_batch(ts: float, events: list[WireEvent], dp_rank: int | None = 0) -> bytes:
    """Encode exactly as vLLM's publisher does (msgspec, map events, defaults omitted)."""
    return _encoder.encode(WireBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def decode_wire(payload: bytes, limits: Limits = LIMITS) -> tuple[WireBatch, int]:
    """Decode to the mirrored wire structs; returns (batch, events skipped as unknown).
    Raises `MalformedPayload` for anything else, within `limits`."""
    try:
        check_size(payload, limits)
    except StructureError as exc:
        raise MalformedPayload(str(exc), exc.reason) from None
    try:
        typed = _typed.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _decode_checked(payload, limits)
    events: list[WireEvent] = [*typed.events]
    return WireBatch(typed.ts, events, typed.data_parallel_rank), 0


def _decode_checked(payload: bytes, limits: Limits) -> tuple[WireBatch, int]:
    try:
        check_structure(payload, limits)
    except StructureError as exc:
        raise MalformedPayload(str(exc), exc.reason) from None
    return _decode_lenient(payload)


def _decode_lenient(payload: bytes) -> tuple[WireBatch, int]:
    """Unknown fields and event types, the older array layout. Only for payloads
    `check_structure` passed: the decoders below recurse into `Any`."""
    try:
        return _fast.decode(payload), 0
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        raw = _raw.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedPayload(f"not a KV event batch: {exc}", "decode") from None
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
    if isinstance(item, dict):
        tag = item.get("type")
    elif isinstance(item, list) and item:
        tag = item[0]
    else:
        raise MalformedPayload(f"not a KV event: {_clip(item)}", "bad_type")
    if not isinstance(tag, str):
        raise MalformedPayload(f"event type tag is not a string: {_clip(item)}", "bad_type")
    if tag not in _KNOWN:
        return None
    try:
        if isinstance(item, dict):
            event: WireEvent = msgspec.convert(item, WireEvent)
            return event
        return _from_array(msgspec.convert(item, _ArrEvent))
    except msgspec.ValidationError as exc:
        raise MalformedPayload(f"bad {tag} event: {exc}", "bad_event") from None


def _clip(item: Any) -> str:
    return repr(item)[:120]


def _from_array(arr: _ArrStored | _ArrRemoved | _ArrCleared) -> WireEvent:
    if isinstance(arr, _ArrStored):
        return BlockStored(**msgspec.structs.asdict(arr))
    if isinstance(arr, _ArrRemoved):
        return BlockRemoved(**msgspec.structs.asdict(arr))
    return AllBlocksCleared()


def decode_batch(
    payload: bytes, limits: Limits = LIMITS, stream: StreamDecoder | None = None
) -> ev.EventBatch:
    """Decode a vLLM payload into engine-neutral events the index applies. Everything the
    index could choke on is refused here, before any of the batch is applied. `stream`:
    what this worker's earlier batches said of its KV-cache groups (`StreamDecoder`)."""
    wire, skipped = decode_wire(payload, limits)
    full = 0
    if stream is not None:
        full = stream.learn(wire.events)
    out: list[ev.KvEvent] = []
    for event in wire.events:
        if isinstance(event, BlockStored):
            if not _indexed_group(event.group_idx, full) or _tokenless(event):
                skipped += 1
                continue
            out.append(_stored(event))
        elif isinstance(event, BlockRemoved):
            if not _indexed_group(event.group_idx, full):
                skipped += 1
                continue
            out.append(ev.BlockRemoved(_hashes(event.block_hashes), event.medium or "GPU"))
        else:
            out.append(ev.AllBlocksCleared())
    return ev.EventBatch(wire.ts, out, wire.data_parallel_rank, skipped)


class StreamDecoder:
    """`decode_batch` for one worker's stream. Hybrid models publish one chain per
    KV-cache group, and the router matches prefixes on the full-attention group only. vLLM
    numbers the groups by the first layer of each kind it meets, so for a model whose first
    layer is sliding-window (Gemma 3, gpt-oss) group 0 is a sliding-window group, which
    frees its blocks as the window moves: indexed, prefixes the engine still holds in full
    attention would look evicted. `BlockStored` names its group's kind; `BlockRemoved`
    only its group, so the full-attention group is learned from the first and held."""

    def __init__(self, limits: Limits = LIMITS) -> None:
        self.limits = limits
        self.full_group: int | None = None  # None: not told yet (group 0, as vLLM's default)

    def __call__(self, payload: bytes) -> ev.EventBatch:
        return decode_batch(payload, self.limits, self)

    def learn(self, events: Sequence[Any]) -> int:
        """The full-attention group, from this batch's stores if none was learned yet."""
        if self.full_group is None:
            for event in events:
                if isinstance(event, BlockStored) and event.kv_cache_spec_kind == FULL_ATTENTION:
                    self.full_group = event.group_idx or 0
                    break
        return self.full_group or 0


FULL_ATTENTION = "full_attention"


def _indexed_group(group_idx: int | None, full: int) -> bool:
    return group_idx is None or group_idx == full


def _tokenless(event: BlockStored) -> bool:
    # vLLM's offloading connectors store blocks on another tier (medium "CPU") with no
    # token ids when they lack the request's metadata: the router hashes tokens, so such
    # a store gives it nothing to index, while the rest of its batch stays good.
    return bool(event.block_hashes) and not event.token_ids


def _hashes(raw: list[WireHash]) -> list[EngineBlockHash]:
    return [h if type(h) is int else _bytes_hash(h) for h in raw]  # type: ignore[misc]


def _one_hash(h: WireHash) -> EngineBlockHash:
    return EngineBlockHash(h) if isinstance(h, int) else _bytes_hash(h)


def _bytes_hash(h: WireHash) -> EngineBlockHash:
    if not isinstance(h, bytes):
        raise MalformedPayload(
            f"block hash must be int or bytes, got {type(h).__name__}", "bad_event"
        )
    return EngineBlockHash(int.from_bytes(h, "big"))


def _stored(event: BlockStored) -> ev.BlockStored:
    n = len(event.block_hashes)
    if n == 0 or event.block_size <= 0 or len(event.token_ids) != n * event.block_size:
        raise MalformedPayload(
            f"BlockStored with {n} hashes, block_size {event.block_size} and "
            f"{len(event.token_ids)} token ids (expected hashes * block_size)",
            "bad_event",
        )
    if event.extra_keys is not None and len(event.extra_keys) != n:
        raise MalformedPayload(
            f"BlockStored with {n} hashes and {len(event.extra_keys)} extra_keys entries "
            "(expected one per block)",
            "bad_extra_keys",
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
