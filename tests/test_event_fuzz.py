"""10,000 frames of junk and real vLLM frames through the real decoder, ingest and index.

The real frames are the ones this project captured from vLLM 0.32 (`tests/fixtures`). Junk:
the hostile shapes of `engines.vllm.fuzz.hostile_payloads`, random bytes, mutations of the
real frames, msgpack values hypothesis draws (as a payload, an event, or a field of a real
event), and old sequence numbers sent again. Nothing may escape the ingest, no real frame
may be lost, and the index must equal the one built from the frames it accepted, alone.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.vllm.fuzz import FuzzReport, fuzz_stream, hostile_payloads, run_stream
from indexer.capture import read_capture
from indexer.events import BlockRemoved, BlockStored, EventBatch
from indexer.index import PrefixIndex, available_backends

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32.0"
EXAMPLES = 100
FRAMES_PER_EXAMPLE = 100  # EXAMPLES * FRAMES_PER_EXAMPLE = 10,000 frames

pytestmark = pytest.mark.timeout(120)


def real_payloads() -> list[bytes]:
    """Each scenario's batches in sequence order, scenario after scenario."""
    out: list[bytes] = []
    for folder in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        by_seq = {m.seq: m.payload for m in read_capture(folder) if m.seq >= 0}
        out += [by_seq[s] for s in sorted(by_seq)]
    return out


REAL = real_payloads()
HOSTILE = [p for _, p, _ in hostile_payloads()]
TOTALS = FuzzReport()

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def add(report: FuzzReport) -> None:
    for name in ("frames", "valid", "junk", "repeats", "accepted_junk", "out_of_order"):
        setattr(TOTALS, name, getattr(TOTALS, name) + getattr(report, name))
    for reason, n in report.by_reason.items():
        TOTALS.by_reason[reason] = TOTALS.by_reason.get(reason, 0) + n
    TOTALS.seconds += report.seconds


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1), drawn=st.lists(values, max_size=6))
def test_junk_interleaved_with_real_frames_changes_nothing(seed: int, drawn: list[Any]) -> None:
    stream = fuzz_stream(random.Random(seed), REAL, FRAMES_PER_EXAMPLE, drawn, HOSTILE)
    report = run_stream(stream)
    assert report.crashed == ""
    assert report.lost_valid == 0
    assert report.equal
    assert report.restarts == 0 and report.out_of_order == report.repeats
    assert "apply" not in report.by_reason  # the decoder refuses what the index cannot take
    assert sum(report.by_reason.values()) == report.junk - report.accepted_junk
    # mutated frames that still decode can reuse an engine hash for other tokens
    assert report.index_consistent
    add(report)


def test_the_fuzz_ran_its_frames() -> None:
    """Runs after the fuzz (file order): it really pushed 10,000 frames, junk of every kind
    among them."""
    if TOTALS.frames == 0:
        pytest.skip("optional: the fuzz test was deselected")
    assert TOTALS.frames >= EXAMPLES * FRAMES_PER_EXAMPLE
    assert TOTALS.junk > TOTALS.frames // 3 and TOTALS.valid > TOTALS.frames // 3
    assert {"decode", "too_deep", "bad_type", "bad_event", "bad_extra_keys"} <= set(
        TOTALS.by_reason
    )
    print(
        f"\nevent fuzz: {TOTALS.frames} frames ({TOTALS.valid} real, {TOTALS.junk} junk, "
        f"{TOTALS.repeats} repeated seqs) in {TOTALS.seconds:.1f} s of ingest; "
        f"refused by reason {dict(sorted(TOTALS.by_reason.items()))}"
    )


@pytest.mark.parametrize("backend", available_backends())
def test_an_engine_hash_stored_again_for_other_tokens_leaves_nothing_stale(backend: str) -> None:
    """Found by the fuzz above: the old block of a reused id was kept, out of every
    BlockRemoved's reach. Block 1 (same tokens, again from the root) is held already: no
    second copy (vLLM re-reporting a cached prefix sends it so)."""
    index = PrefixIndex(backend=backend)
    index.add_worker("w")
    index.apply("w", EventBatch(0.0, [BlockStored([1, 2], None, [0] * 4 + [1] * 4, 4)]))
    first, old = index.router_hash_of("w", 1), index.router_hash_of("w", 2)
    index.apply("w", EventBatch(0.0, [BlockStored([1, 2], None, [0] * 4 + [2] * 4, 4)]))
    new = index.router_hash_of("w", 2)
    assert new not in (None, old)
    assert index.holds("w") == {first, new} and index.entries_of("w") == 2
    index.verify()
    index.apply("w", EventBatch(0.0, [BlockRemoved([1])]))
    assert index.holds("w") == {new}
    index.apply("w", EventBatch(0.0, [BlockRemoved([2])]))
    assert index.holds("w") == set() and index.entries_of("w") == 0
    index.verify()


def test_the_fixtures_hold_real_frames() -> None:
    assert len(REAL) >= 20
