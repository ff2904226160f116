"""Capture folders: raw KV-event frames on disk, in the layout of vLLM reference captures.

For the n-th message (from 0001): `frames_NNNN_topic.bin`, `frames_NNNN_seq.bin` (8 bytes,
big-endian), `frames_NNNN_payload.bin` (msgpack), listed in `frames_index.json` with the
decoded topic and sequence. Replay answers use the prefix `replay_fromS_` and kind "replay".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "frames_index.json"


@dataclass(frozen=True)
class CapturedMessage:
    n: int
    kind: str  # "pub" or "replay"
    topic: str
    seq: int
    payload: bytes


class CaptureWriter:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self._entries: list[dict[str, object]] = []

    def add(self, kind: str, frames: list[bytes], prefix: str = "frames") -> None:
        n = len(self._entries) + 1
        names = [f"{prefix}_{n:04d}_{part}.bin" for part in ("topic", "seq", "payload")]
        for name, frame in zip(names, frames, strict=True):
            (self.out / name).write_bytes(frame)
        seq = int.from_bytes(frames[1], "big", signed=frames[1] == b"\xff" * 8)
        self._entries.append(
            {
                "n": n,
                "kind": kind,
                "recv_time": time.time(),
                "files": names,
                "frame_lengths": [len(f) for f in frames],
                "topic": frames[0].decode("utf-8", "replace"),
                "seq": seq,
                "seq_hex": frames[1].hex(),
            }
        )
        self.flush()

    def flush(self) -> None:
        (self.out / INDEX_FILE).write_text(json.dumps(self._entries, indent=1))

    def __len__(self) -> int:
        return len(self._entries)


def read_capture(folder: Path) -> Iterator[CapturedMessage]:
    """Messages of a capture folder in the order they were received."""
    index_path = folder / INDEX_FILE
    if not index_path.exists():
        raise FileNotFoundError(f"{index_path} not found: not a capture folder")
    for entry in json.loads(index_path.read_text()):
        topic_f, seq_f, payload_f = (folder / name for name in entry["files"])
        seq_raw = seq_f.read_bytes()
        yield CapturedMessage(
            n=int(entry["n"]),
            kind=str(entry.get("kind", "pub")),
            topic=topic_f.read_bytes().decode("utf-8", "replace"),
            seq=int.from_bytes(seq_raw, "big", signed=seq_raw == b"\xff" * 8),
            payload=payload_f.read_bytes(),
        )
