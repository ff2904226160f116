"""`kvroute events capture` against the simulator's publisher on loopback, with a replay
history of thousands of batches (vLLM keeps 10,000): every batch lands in the capture, in
either replay reply shape vLLM sent and when a first answer has holes, live batches after
it, and a capture stopped while it writes the history still leaves a folder `read_capture`
reads."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from replay_shapes import TopiclessReplay

from engines.sim.events_pub import EventPublisher, PublisherConfig
from engines.vllm import events as wire
from indexer import capture
from indexer.capture import INDEX_FILE, CaptureWriter, read_capture
from indexer.subscriber import seq_bytes
from router import events_cli

pytestmark = pytest.mark.timeout(240)
HISTORY = 4000
TOPIC = "kv-events"
KVROUTE = [sys.executable, "-m", "router.cli", "--log-level", "WARNING", "events", "capture"]


TopiclessReplayPublisher = TopiclessReplay  # the older 3-frame replies


class HoleyReplayPublisher(EventPublisher):
    """Its first replay answer lacks 200 batches, as vLLM's does when its ROUTER's queue to
    the capture overflows (it drops without a word); later answers are whole."""

    answers = 0

    def buffered(self, start_seq: int = 0) -> list[tuple[int, bytes]]:
        self.answers += 1
        whole = super().buffered(start_seq)
        return whole if self.answers > 1 else [b for b in whole if not 1500 <= b[0] < 1700]


async def publish(pub: EventPublisher, n: int) -> None:
    """`n` batches of one BlockStored each, so that every payload differs."""
    for _ in range(n):
        tokens = [pub.seq * 4 + i for i in range(4)]
        event = wire.BlockStored(
            block_hashes=[pub.seq],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        await pub.publish(float(pub.seq), [event])


@pytest.fixture
async def history() -> AsyncIterator[EventPublisher]:
    """The simulator's publisher with `HISTORY` batches published before anyone listened."""
    pub = EventPublisher(PublisherConfig(topic=TOPIC))
    await pub.start()
    try:
        await publish(pub, HISTORY)
        yield pub
    finally:
        await pub.stop()


class CountingJson(SimpleNamespace):
    """`json` as indexer.capture sees it, stopping a capture once writing its index has
    cost more than `budget` characters: an index rewritten per message costs the square of
    the message count, one appended to costs its own size."""

    def __init__(self, budget: int) -> None:
        super().__init__(loads=json.loads, written=0, budget=budget)

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        text = json.dumps(obj, **kwargs)
        self.written += len(text)
        if self.written > self.budget:
            raise AssertionError(f"the index cost {self.written} characters to write so far")
        return text


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(EventPublisher, id="4-frame-replies-vllm-0.32"),
        pytest.param(TopiclessReplayPublisher, id="3-frame-replies-older-vllm"),
        pytest.param(HoleyReplayPublisher, id="first-reply-with-holes"),
    ],
)
async def test_history_of_thousands_of_batches_is_captured_whole(
    kind: type[EventPublisher], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = kind(PublisherConfig(topic=TOPIC))
    await pub.start()
    spy = CountingJson(budget=1000 * (HISTORY + 1))  # an entry is ~250 characters
    monkeypatch.setattr(capture, "json", spy)
    writer = CaptureWriter(tmp_path / "cap")
    try:
        await publish(pub, HISTORY)
        assert pub.replay_endpoint is not None
        answered = await asyncio.to_thread(events_cli._capture_history, pub.replay_endpoint, writer)
        assert answered
        writer.close()
        messages = list(read_capture(tmp_path / "cap"))
        assert {m.kind for m in messages} == {"replay"}
        assert [(m.seq, m.payload) for m in messages] == [*pub.buffered(), (-1, b"")]
        topic = "" if kind is TopiclessReplayPublisher else TOPIC  # that shape has no topic
        assert {m.topic for m in messages[:-1]} == {topic}
        assert spy.written <= (tmp_path / "cap" / INDEX_FILE).stat().st_size
    finally:
        await pub.stop()


def test_an_open_index_is_whole_after_every_message_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = CountingJson(budget=1000 * 300)
    monkeypatch.setattr(capture, "json", spy)
    writer = CaptureWriter(tmp_path)
    writer.add("replay", [b"kv", seq_bytes(0), b"history"], prefix="replay_from0")
    writer.open_index()
    for seq in range(1, 300):
        writer.add("pub", [b"kv", seq_bytes(seq), b"live-%d" % seq])
        on_disk = json.loads((tmp_path / INDEX_FILE).read_text())
        assert [e["seq"] for e in on_disk] == list(range(seq + 1))
    writer.close()
    writer.close()  # a second close changes nothing
    messages = list(read_capture(tmp_path))
    assert [(m.kind, m.seq) for m in messages[:2]] == [("replay", 0), ("pub", 1)]
    assert [m.payload for m in messages[1:]] == [b"live-%d" % s for s in range(1, 300)]
    assert spy.written <= (tmp_path / INDEX_FILE).stat().st_size


def start_capture(pub: EventPublisher, out: Path) -> subprocess.Popen[bytes]:
    """`kvroute events capture` into `out`, its output into `out`.log."""
    assert pub.endpoint is not None and pub.replay_endpoint is not None
    cmd = [*KVROUTE, "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint]
    cmd += ["--topic", TOPIC, "--out", str(out)]
    with log_path(out).open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def log_path(out: Path) -> Path:
    return out.with_name(out.name + ".log")


async def wait_for(proc: subprocess.Popen[bytes], out: Path, done: Any, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard: a loaded 2-core machine is slow
    while not done():
        log = log_path(out).read_text()
        assert proc.poll() is None, f"capture exited before {what}: {log}"
        assert time.monotonic() < deadline, f"capture never got to {what}: {log}"
        await asyncio.sleep(0.01)


def stop(proc: subprocess.Popen[bytes], out: Path) -> str:
    """SIGTERM, as containers and `timeout` stop it; its output once it exited cleanly."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path(out).read_text()
    assert proc.returncode == 0, log
    return log


def indexed_seqs(out: Path) -> list[int]:
    try:
        return [e["seq"] for e in json.loads((out / INDEX_FILE).read_text())]
    except (OSError, ValueError):
        return []  # not written yet, or caught mid-write


async def test_capture_holds_the_history_then_live_batches(
    history: EventPublisher, tmp_path: Path
) -> None:
    out = tmp_path / "cap"
    proc = start_capture(history, out)
    try:
        await wait_for(proc, out, (out / INDEX_FILE).exists, "the live stream")
        await publish(history, 5)
        last = HISTORY + 4
        await wait_for(proc, out, lambda: last in indexed_seqs(out), "the last live batch")
    finally:
        text = stop(proc, out)
    messages = list(read_capture(out))
    replayed = [(m.seq, m.payload) for m in messages if m.kind == "replay"]
    live = [(m.seq, m.payload) for m in messages if m.kind == "pub"]
    assert [s for s, _ in replayed] == [*range(HISTORY), -1], text
    assert replayed == [*history.buffered(0)[:HISTORY], (-1, b"")]
    assert live == history.buffered(HISTORY), text
    assert f"captured 5 live batches ({HISTORY + 6} messages)" in text


async def test_capture_stopped_while_writing_history_leaves_what_it_wrote(
    history: EventPublisher, tmp_path: Path
) -> None:
    out = tmp_path / "cap"
    proc = start_capture(history, out)
    try:
        first = out / "replay_from0_0001_payload.bin"
        await wait_for(proc, out, first.exists, "writing the history")
    finally:
        text = stop(proc, out)
    messages = list(read_capture(out))
    held = [(m.seq, m.payload) for m in messages if m.seq >= 0]  # the end marker if it came
    assert held, text
    assert held == history.buffered()[: len(held)]
    assert f"captured 0 live batches ({len(messages)} messages)" in text
