"""Junk for the vLLM KV event path, and a harness that interleaves it with valid frames
through the real decoder, ingest and index.

`hostile_payloads()` lists the shapes that used to kill a worker's subscriber (an event
whose type is a list or a dict, 50,000-deep arrays, `extra_keys` shorter than the block
list) and their relatives, each with the reason `decode_batch` must give. `fuzz_stream`
mixes real frames with mutated ones, random bytes, hostile shapes and repeated sequence
numbers; `run_stream` feeds them to one ingest, feeds the frames it accepted to a second
one alone, and reports whether the two indexes agree:

    report = run_stream(fuzz_stream(random.Random(1), real_payloads, 10_000))
    assert report.equal and not report.lost_valid and not report.crashed

Used by `tests/test_event_fuzz.py`; a fault suite can print the same report.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engines.vllm.events import LIMITS, decode_batch
from indexer.clock import FakeClock
from indexer.events import EventBatch
from indexer.index import PrefixIndex
from indexer.ingest import WorkerIngest

WORKER = "fuzzed"
DEEP = 50_000
_enc = msgspec.msgpack.Encoder()
_INTERESTING = bytes([0x00, 0x7F, 0x80, 0x90, 0x91, 0x9F, 0xC0, 0xC1, 0xC3, 0xCB, 0xD9])
_INTERESTING += bytes([0xDC, 0xDD, 0xDE, 0xDF, 0xFF])


def _stored(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return doc | over


def _batch(*events: Any) -> bytes:
    return _enc.encode([1.0, list(events), 0])


def _deep(inner: bytes = b"\x00") -> bytes:
    return b"\x91" * DEEP + inner


def _spliced(doc: dict[str, Any], key: str, raw: bytes) -> bytes:
    """A batch of one event whose `key` holds `raw` msgpack bytes (here: too deep to build
    as Python objects)."""
    marker = "\x00splice\x00"
    encoded = _batch(doc | {key: marker})
    return encoded.replace(_enc.encode(marker), raw)


def hostile_payloads() -> list[tuple[str, bytes, str]]:
    """(name, payload, reason `decode_batch` must raise `MalformedPayload` with)."""
    mm = [["img-1", 0]]
    ts = b"\x93\xcb" + bytes(8)  # [1.0-ish, ... : the start of a batch array
    deep_event = _enc.encode([1.0, [0], 0]).replace(b"\x91\x00", b"\x91" + _deep())
    deep_extra = b"\x92" + _deep() + b"\xc0"
    return [
        ("type-is-a-list", _batch(_stored(type=["BlockStored"])), "bad_type"),
        ("type-is-a-dict", _batch(_stored(type={"BlockStored": 1})), "bad_type"),
        ("type-is-an-int", _batch({"type": 5}), "bad_type"),
        ("event-is-an-int", _batch(42), "bad_type"),
        ("array-event-tag-is-a-list", _batch([["BlockRemoved"], [1], "GPU"]), "bad_type"),
        ("deep-array", _deep(), "too_deep"),
        ("deep-event", deep_event, "too_deep"),
        ("deep-unknown-field", _spliced(_stored(), "future", _deep()), "too_deep"),
        ("deep-extra-keys", _spliced(_stored(), "extra_keys", deep_extra), "too_deep"),
        ("deep-map", b"\x81\xa1k" * DEEP + b"\x00", "too_deep"),
        ("extra-keys-short-mm", _batch(_stored(extra_keys=[mm])), "bad_extra_keys"),
        ("extra-keys-short-salt", _batch(_stored(extra_keys=[["salt"]])), "bad_extra_keys"),
        ("extra-keys-long", _batch(_stored(extra_keys=[None, None, mm])), "bad_extra_keys"),
        ("extra-keys-empty", _batch(_stored(extra_keys=[])), "bad_extra_keys"),
        ("negative-token", _batch(_stored(token_ids=[-1] * 8)), "bad_event"),
        ("token-past-uint32", _batch(_stored(token_ids=[2**32] * 8)), "bad_event"),
        ("token-count", _batch(_stored(token_ids=[1, 2, 3])), "bad_event"),
        ("no-hashes", _batch(_stored(block_hashes=[], token_ids=[])), "bad_event"),
        ("str-hash", _batch(_stored(block_hashes=["a", "b"])), "bad_event"),
        ("block-size-zero", _batch(_stored(block_size=0)), "bad_event"),
        ("bool-hash", _batch(_stored(block_hashes=[True, False])), "bad_event"),
        ("huge-array-header", ts + b"\xdd\xff\xff\xff\xff", "too_long"),
        ("array-longer-than-payload", ts + b"\xdd\x00\x01\x00\x00\x00", "decode"),
        ("huge-string-header", ts + b"\x91\xdb\xff\xff\xff\xff", "decode"),
        ("too-large", ts + b"\x90\xc4" + bytes(LIMITS.max_bytes), "too_large"),
        ("not-msgpack", b"\xc1", "decode"),
        ("empty", b"", "decode"),
        ("a-map", _enc.encode({"not": "a batch"}), "decode"),
        ("ts-is-a-string", _enc.encode(["now", [], 0]), "decode"),
        ("trailing-bytes", _batch() + b"\x00", "decode"),
    ]


def mutate(rng: random.Random, real: Sequence[bytes]) -> bytes:
    """One mutation of a real (non-empty) payload: bit flips, odd bytes, cuts, inserts,
    splices, repeats; or plain random bytes. The result may still be a valid batch: the
    harness sorts that out."""
    base = bytearray(rng.choice(real))
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(300))
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
    elif kind == 2:
        for _ in range(rng.randint(1, 4)):
            base[rng.randrange(len(base))] = rng.choice(_INTERESTING)
    elif kind == 3:
        del base[rng.randrange(len(base)) :]
    elif kind == 4:
        pos = rng.randrange(len(base) + 1)
        base[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif kind == 5:
        other = rng.choice(real)
        base = base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1) :]
    else:
        start = rng.randrange(len(base))
        base[start:start] = base[start : start + rng.randint(1, 64)] * rng.randint(1, 50)
    return bytes(base)


def embed(rng: random.Random, value: Any, real: Sequence[bytes]) -> bytes:
    """An arbitrary msgpack value as the whole payload, as an event, or as the value of one
    field of a real event."""
    where = rng.randrange(3)
    if where == 0:
        return _enc.encode(value)
    if where == 1:
        return _batch(value)
    raw = msgspec.msgpack.decode(rng.choice(real))
    events = [e for e in raw[1] if isinstance(e, dict)]
    if not events:
        return _batch(value)
    event = dict(rng.choice(events))
    event[rng.choice(sorted(event))] = value
    return _batch(event)


@dataclass(frozen=True)
class Frame:
    seq: int
    payload: bytes
    kind: str  # "valid" (a real frame), "junk", or "repeat" (an old seq sent again)


def fuzz_stream(
    rng: random.Random,
    real: Sequence[bytes],
    n: int,
    values: Sequence[Any] = (),
    hostile: Sequence[bytes] = (),
) -> list[Frame]:
    """`n` frames: about half the real payloads in order (cycling), the rest junk from
    `mutate`, `embed` (of `values`) and `hostile`, plus now and then an old sequence number
    sent again (never twice in a row: two in a row that count up would be a restart)."""
    frames: list[Frame] = []
    seq = next_real = 0
    while len(frames) < n:
        roll = rng.random()
        repeat_ok = seq > 0 and frames[-1].kind != "repeat" and len(frames) < n - 1
        if roll < 0.05 and repeat_ok:
            frames.append(Frame(rng.randrange(seq), rng.choice(real), "repeat"))
            continue
        if roll < 0.5:
            frames.append(Frame(seq, real[next_real % len(real)], "valid"))
            next_real += 1
        else:
            frames.append(Frame(seq, _junk(rng, real, values, hostile), "junk"))
        seq += 1
    return frames


def _junk(
    rng: random.Random, real: Sequence[bytes], values: Sequence[Any], hostile: Sequence[bytes]
) -> bytes:
    roll = rng.random()
    if values and roll < 0.2:
        return embed(rng, rng.choice(values), real)
    if hostile and roll < 0.3:
        return rng.choice(hostile)
    return mutate(rng, real)


@dataclass
class FuzzReport:
    frames: int = 0
    valid: int = 0
    junk: int = 0
    repeats: int = 0
    accepted_junk: int = 0  # mutations that were still valid batches: applied as such
    lost_valid: int = 0  # real frames the ingest did not apply (must be 0)
    by_reason: dict[str, int] = field(default_factory=dict)
    out_of_order: int = 0
    restarts: int = 0
    crashed: str = ""  # what escaped the ingest, if anything (must be "")
    equal: bool = False  # the index equals the one built from the accepted frames alone
    # PrefixIndex.verify() passed at the end (accepted junk included: an engine hash stored
    # again for other tokens releases the block it named; tests/test_event_fuzz.py)
    index_consistent: bool = False
    seconds: float = 0.0


def _ingest(decode: Any) -> WorkerIngest:
    index = PrefixIndex()
    index.add_worker(WORKER)
    return WorkerIngest(WORKER, index, decode, FakeClock(), has_replay=False)


def run_stream(frames: Sequence[Frame]) -> FuzzReport:
    """Feed `frames` to one ingest; then the payloads it accepted, alone, to another."""
    accepted: list[bytes] = []

    def recording(payload: bytes) -> EventBatch:
        batch = decode_batch(payload)
        accepted.append(payload)
        return batch

    mixed, report = _ingest(recording), FuzzReport(frames=len(frames))
    started = time.perf_counter()
    for frame in frames:
        before = len(accepted)
        try:
            mixed.on_live(frame.seq, frame.payload)
        except Exception as exc:  # the defect this harness hunts: report, don't hide
            report.crashed = f"frame {frame.seq} ({frame.kind}): {type(exc).__name__}: {exc}"
            return report
        _count(report, frame, len(accepted) - before)
    report.seconds = time.perf_counter() - started
    alone = _ingest(decode_batch)
    for seq, payload in enumerate(accepted):
        alone.on_live(seq, payload)
    c = mixed.counters
    report.by_reason = dict(c.malformed_by_reason)
    report.out_of_order, report.restarts = c.out_of_order, c.restarts
    report.equal = mixed.index.holds(WORKER) == alone.index.holds(WORKER)
    report.index_consistent = _consistent(mixed.index)
    return report


def _consistent(index: PrefixIndex) -> bool:
    try:
        index.verify()
    except AssertionError:
        return False
    return True


def _count(report: FuzzReport, frame: Frame, applied: int) -> None:
    if frame.kind == "valid":
        report.valid += 1
        report.lost_valid += applied != 1
    elif frame.kind == "junk":
        report.junk += 1
        report.accepted_junk += applied
    else:
        report.repeats += 1
