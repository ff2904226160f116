"""KV-event wire format, compared three ways: kvroute's adapter (`engines.vllm.events`),
vLLM's own msgspec `KVEventBatch` decoder (run inside the vLLM venv), and a plain msgpack
decode that knows nothing about either (what each map really holds on the wire).

Batches are compared as normalized JSON: every declared field of every event (defaults
included), bytes as hex, tuples as lists, the event's class name as "type".
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from conformance.vllm_decode import norm  # one view for both sides of the comparison
from conformance.vllm_server import vllm_python
from engines.vllm import events as wire
from indexer.capture import read_capture

Payload = tuple[str, bytes]  # (label, msgpack payload)
_DECODER_SCRIPT = Path(__file__).with_name("vllm_decode.py")


def kvroute_view(payload: bytes) -> dict[str, Any]:
    batch, skipped = wire.decode_wire(payload)
    return {
        "ts": batch.ts,
        "events": [norm(e) for e in batch.events],
        "data_parallel_rank": batch.data_parallel_rank,
        "skipped": skipped,
    }


def raw_problems(payload: bytes) -> list[str]:
    """Hold kvroute's decode against the bare msgpack: every key on the wire is a field
    kvroute models with the same value, every absent field is at its default, keys come
    in declaration order after "type", and re-encoding gives the same bytes."""
    raw = msgspec.msgpack.decode(payload)
    batch, _ = wire.decode_wire(payload)
    problems = []
    if not (isinstance(raw, list) and len(raw) in (2, 3)):
        return [f"payload is not [ts, events, dp_rank]: {str(raw)[:80]}"]
    for i, (item, event) in enumerate(zip(raw[1], batch.events, strict=False)):
        problems += [f"event {i}: {p}" for p in _event_problems(item, event)]
    if len(raw[1]) != len(batch.events):
        problems.append(f"{len(raw[1])} events on the wire, {len(batch.events)} decoded")
    if wire.encode_batch(batch.ts, batch.events, batch.data_parallel_rank) != payload:
        problems.append("re-encoding the decoded batch does not give the same bytes")
    return problems


def _event_problems(item: Any, event: msgspec.Struct) -> list[str]:
    if not isinstance(item, dict):
        return [f"not a map: {str(item)[:60]}"]
    keys = list(item)
    declared = ["type", *event.__struct_fields__]
    out = []
    if item.get("type") != type(event).__name__:
        out.append(f"type {item.get('type')!r} decoded as {type(event).__name__}")
    unknown = [k for k in keys if k not in declared]
    if unknown:
        out.append(f"fields kvroute does not model: {unknown}")
    if keys != [k for k in declared if k in item]:
        out.append(f"key order {keys} is not type-first declaration order")
    defaults = dict(zip(event.__struct_fields__, _defaults(event), strict=True))
    for f in event.__struct_fields__:
        want = norm(item[f]) if f in item else norm(defaults[f])
        if norm(getattr(event, f)) != want:
            out.append(f"{f}: wire {want!r} decoded as {norm(getattr(event, f))!r}")
    return out


def _defaults(event: msgspec.Struct) -> list[Any]:
    info = msgspec.structs.fields(type(event))
    return [None if f.default is msgspec.NODEFAULT else f.default for f in info]


def vllm_views(payloads: Sequence[Payload], timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Decode with vLLM's `KVEventBatch` in the vLLM venv; one view (or error) per payload."""
    lines = [
        json.dumps({"id": i, "payload": base64.b64encode(p).decode()})
        for i, (_, p) in enumerate(payloads)
    ]
    done = subprocess.run(
        [str(vllm_python()), str(_DECODER_SCRIPT)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_vllm_env(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM decoder exited {done.returncode}: {done.stderr[-800:]}")
    out = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(out, key=lambda d: int(d["id"]))


def _vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return env | {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_verdicts(payloads: Sequence[Payload]) -> list[str]:
    """Per payload: "" when kvroute's decode agrees field by field with vLLM's, else why not.
    One vLLM decoder process for all of them (importing vLLM takes ~10 s)."""
    out = []
    for (_, payload), theirs in zip(payloads, vllm_views(payloads), strict=True):
        if "error" in theirs:
            out.append(f"vLLM's decoder rejects it: {theirs['error']}")
        else:
            out.append(_diff(kvroute_view(payload), theirs["batch"]))
    return out


def _diff(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    if mine["skipped"]:
        return f"kvroute skipped {mine['skipped']} events vLLM decodes"
    for key in ("ts", "data_parallel_rank"):
        if mine[key] != theirs[key]:
            return f"{key}: kvroute {mine[key]!r}, vLLM {theirs[key]!r}"
    if len(mine["events"]) != len(theirs["events"]):
        return f"{len(mine['events'])} events in kvroute, {len(theirs['events'])} in vLLM"
    for i, (a, b) in enumerate(zip(mine["events"], theirs["events"], strict=True)):
        if a != b:
            fields = sorted(
                k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>")
            )
            return f"event {i} differs in {fields}: kvroute {a} vs vLLM {b}"[:600]
    return ""


def event_counts(payloads: Iterable[bytes]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for p in payloads:
        batch, _ = wire.decode_wire(p)
        counts.update(type(e).__name__ for e in batch.events)
    return dict(counts)


def hash_kinds(payloads: Iterable[bytes]) -> list[str]:
    kinds = set()
    for p in payloads:
        for e in wire.decode_wire(p)[0].events:
            for h in getattr(e, "block_hashes", ()):
                kinds.add("int" if isinstance(h, int) else f"{len(h)}-byte")
    return sorted(kinds)


def capture_summary(folder: Path) -> dict[str, Any]:
    msgs = [m for m in read_capture(folder) if m.seq >= 0]
    payloads = [m.payload for m in msgs]
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return {
        "messages": len(msgs),
        "replayed": sum(m.kind == "replay" for m in msgs),
        "events": event_counts(payloads),
        "hash_kinds": hash_kinds(payloads),
        "bytes_on_disk": size,
    }
