"""The KV-event fuzz as a fault check: 10,000 frames, real vLLM frames the project captured
(tests/fixtures) interleaved with junk (hostile shapes, random bytes, mutations, old
sequence numbers), through the real decoder, ingest and index."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from conformance.registry import Findings, check
from conformance.session import Context
from engines.vllm.fuzz import fuzz_stream, hostile_payloads, run_stream
from indexer.capture import read_capture

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm-0.32.0"
FRAMES = 10_000


def real_payloads() -> list[bytes]:
    out: list[bytes] = []
    for folder in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        by_seq = {m.seq: m.payload for m in read_capture(folder) if m.seq >= 0}
        out += [by_seq[s] for s in sorted(by_seq)]
    return out


@check(
    "fault-events-fuzz",
    f"{FRAMES:,} KV event frames, junk among real vLLM frames: nothing escapes the ingest, "
    "no real frame is lost, the index equals the one built from the accepted frames alone",
    targets=("sim",),
    timeout_s=300.0,
    default=False,
)
async def events_fuzz(ctx: Context, f: Findings) -> None:
    real = real_payloads()
    f.require(len(real) > 20, f"only {len(real)} captured frames under {FIXTURES}")
    hostile = [p for _, p, _ in hostile_payloads()]
    frames = fuzz_stream(random.Random(11), real, FRAMES, hostile=hostile)
    report = await asyncio.to_thread(run_stream, frames)
    f.note("report", report.__dict__ | {"seconds": round(report.seconds, 2)})
    f.require(not report.crashed, f"escaped the ingest: {report.crashed}")
    f.require(report.lost_valid == 0, f"{report.lost_valid} real frames lost")
    f.require(report.equal, "the index differs from the one built from accepted frames")
    f.require(report.restarts == 0, f"{report.restarts} restarts seen in junk")
