"""Shared by the checks that look at frames: kvroute's decode against the bare msgpack and
(where the target has it) against vLLM's own decoder."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from conformance.registry import Findings
from conformance.session import Context
from conformance.targets import VLLM_DECODER
from conformance.wire import Payload, event_counts, hash_kinds, raw_problems, vllm_verdicts
from engines.vllm.events import MalformedPayload, decode_batch

MAX_LISTED = 20


async def compare_payloads(
    ctx: Context, f: Findings, sets: Mapping[str, Sequence[Payload]]
) -> None:
    """Every payload against the bare msgpack, and (one vLLM process for all sets) against
    vLLM's decoder when the target has it. Evidence per set under `<label>_frames`."""
    verdicts: dict[str, str] | None = None
    if ctx.target.features().get(VLLM_DECODER) is None:
        flat = [item for payloads in sets.values() for item in payloads]
        found = await asyncio.to_thread(vllm_verdicts, flat)
        verdicts = {name: v for (name, _), v in zip(flat, found, strict=True)}
    for label, payloads in sets.items():
        _judge_set(f, label, payloads, verdicts)


def _judge_set(
    f: Findings, label: str, payloads: Sequence[Payload], verdicts: dict[str, str] | None
) -> None:
    f.require(bool(payloads), f"{label}: no frames to compare")
    raw_bad = _raw(payloads)
    evidence: dict[str, object] = {
        "batches": len(payloads),
        "events": event_counts(p for _, p in payloads),
        "hash_kinds": hash_kinds(p for _, p in payloads),
        "kvroute_vs_msgpack_problems": raw_bad[:MAX_LISTED],
    }
    f.require(
        not raw_bad, f"{label}: {len(raw_bad)} batch(es) decode wrong or re-encode differently"
    )
    if verdicts is not None:
        diffs = [f"{name}: {verdicts[name]}" for name, _ in payloads if verdicts[name]]
        evidence["agree_with_vllm_decoder"] = len(payloads) - len(diffs)
        evidence["vllm_decoder_diffs"] = diffs[:MAX_LISTED]
        f.require(not diffs, f"{label}: {len(diffs)} batch(es) differ from vLLM's decoder")
    f.note(f"{label}_frames", evidence)


def _raw(payloads: Sequence[Payload]) -> list[str]:
    out = []
    for name, payload in payloads:
        try:
            problems = raw_problems(payload)
            batch = decode_batch(payload)
            if batch.skipped:
                problems.append(f"the adapter skipped {batch.skipped} event(s)")
        except (MalformedPayload, ValueError) as exc:
            problems = [f"does not decode: {exc}"]
        out += [f"{name}: {p}" for p in problems]
    return out
