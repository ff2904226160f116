"""Capture folders: raw KV-event frames on disk, in the layout of vLLM reference captures.

For the n-th message (from 0001): `frames_NNNN_topic.bin`, `frames_NNNN_seq.bin` (8 bytes,
big-endian), `frames_NNNN_payload.bin` (msgpack), listed in `frames_index.json` (a JSON array,
one object a line) with the decoded topic and sequence. Replay answers use the prefix
`replay_fromS_` and kind "replay".
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_FILE = "frames_index.json"
_CLOSE = b"\n]\n"  # how the index ends; an appended entry overwrites it and ends the same way


@dataclass(frozen=True)
class CapturedMessage:
    n: int
    kind: str  # "pub" or "replay"
    topic: str
    seq: int
    payload: bytes


class CaptureWriter:
    """Writes a capture folder message by message.

    The index appears at `open_index()`: readers of a running capture take its existence to
    mean the capture hears live batches. From then on each message is appended to the index
    in place, in one write, so the index is a whole JSON array after every message and a
    message costs the same however long the capture runs (rewriting the index per message
    made a 10,000-batch replay history take minutes). `close()` writes the index if it was
    never opened, so a capture stopped early still lists everything it received."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()  # messages by kind
        self._pending: list[dict[str, Any]] = []  # received before the index was opened
        self._index_fd: int | None = None
        self._end = 0  # offset of the index's closing bracket: where the next entry goes
        self._closed = False

    def add(self, kind: str, frames: list[bytes], prefix: str = "frames") -> None:
        n = len(self) + 1
        names = [f"{prefix}_{n:04d}_{part}.bin" for part in ("topic", "seq", "payload")]
        for name, frame in zip(names, frames, strict=True):
            (self.out / name).write_bytes(frame)
        entry = _entry(n, kind, names, frames)
        self.counts[kind] += 1
        if self._index_fd is None:
            self._pending.append(entry)
        else:
            self._append(entry, first=n == 1)  # n == 1: the index is still empty

    def open_index(self) -> None:
        """Write the index of every message so far; later messages are appended to it."""
        if self._index_fd is not None:
            return
        lines = [json.dumps(e).encode() for e in self._pending]
        text = b"[\n" + b",\n".join(lines) + _CLOSE
        path = self.out / INDEX_FILE
        tmp = path.with_name(INDEX_FILE + ".tmp")
        tmp.write_bytes(text)
        os.replace(tmp, path)  # a reader never sees half an index
        self._index_fd = os.open(path, os.O_WRONLY)
        self._end = len(text) - len(_CLOSE)
        self._pending = []

    def close(self) -> None:
        if self._closed:
            return
        self.open_index()
        assert self._index_fd is not None
        os.close(self._index_fd)
        self._closed = True

    def _append(self, entry: dict[str, Any], first: bool) -> None:
        assert self._index_fd is not None
        line = json.dumps(entry).encode()
        data = (b"" if first else b",\n") + line + _CLOSE
        # one write: a stop signal lands before or after it, never inside an entry
        os.pwrite(self._index_fd, data, self._end)
        self._end += len(data) - len(_CLOSE)

    def __len__(self) -> int:
        return sum(self.counts.values())


def _entry(n: int, kind: str, names: list[str], frames: list[bytes]) -> dict[str, Any]:
    seq = int.from_bytes(frames[1], "big", signed=frames[1] == b"\xff" * 8)
    return {
        "n": n,
        "kind": kind,
        "recv_time": time.time(),
        "files": names,
        "frame_lengths": [len(f) for f in frames],
        "topic": frames[0].decode("utf-8", "replace"),
        "seq": seq,
        "seq_hex": frames[1].hex(),
    }


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
