"""`kvroute events capture` and `kvroute events replay` driven as child processes, the way an
operator runs them, plus the one edit fixtures get: dropping replayed history older than the
scenario (the capture asks the replay socket for everything from sequence 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conformance.procs import log_tail, spawn, stop_group
from indexer.capture import INDEX_FILE

KVROUTE = [sys.executable, "-m", "router.cli", "--log-level", "WARNING"]


class CaptureError(RuntimeError):
    """The capture did not start, or did not see the batches it was waiting for."""


class CaptureProcess:
    """`kvroute events capture --replay-endpoint ...` into `out`, until told to stop."""

    def __init__(
        self, endpoint: str, replay_endpoint: str, topic: str, out: Path, log_dir: Path
    ) -> None:
        self.out = out
        self.log_path = log_dir / f"{out.name}.capture.log"
        self.cmd = [*KVROUTE, "events", "capture", "--endpoint", endpoint]
        self.cmd += ["--replay-endpoint", replay_endpoint, "--topic", topic, "--out", str(out)]
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start and wait until its replay answer is written: from then on it hears live."""
        self._proc = spawn(self.cmd, self.log_path)
        deadline = time.monotonic() + timeout_s
        while not (self.out / INDEX_FILE).exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise CaptureError(f"capture did not start: {log_tail(self.log_path)}")
            await asyncio.sleep(0.05)

    def seqs(self) -> list[int]:
        try:
            return [int(e["seq"]) for e in json.loads((self.out / INDEX_FILE).read_text())]
        except (OSError, ValueError):
            return []  # caught mid-write; the next poll reads it whole

    async def stop_after(self, last_seq: int | None, timeout_s: float = 10.0) -> None:
        """Wait until batch `last_seq` is on disk, then stop the capture. SIGTERM, not SIGINT:
        a suite started as a shell's background job passes SIGINT on ignored to its children."""
        deadline = time.monotonic() + timeout_s
        while last_seq is not None and max(self.seqs(), default=-1) < last_seq:
            if time.monotonic() > deadline:
                self.kill()
                raise CaptureError(f"capture never saw batch {last_seq}: {self.seqs()[-5:]}")
            await asyncio.sleep(0.05)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 10.0)
        except subprocess.TimeoutExpired:
            stop_group(proc, 2.0)
        if proc.returncode != 0:
            raise CaptureError(f"capture exited {proc.returncode}: {log_tail(self.log_path)}")

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc, 2.0)


def trim_capture(folder: Path, first_seq: int) -> int:
    """Keep only batches with seq >= `first_seq` (and the replay end marker), renumbered in
    the capture layout. Returns how many messages were dropped."""
    entries = json.loads((folder / INDEX_FILE).read_text())
    kept = [e for e in entries if e["seq"] >= first_seq or e["seq"] == -1]
    frames = [[(folder / name).read_bytes() for name in e["files"]] for e in kept]
    for path in folder.glob("*.bin"):
        path.unlink()
    out: list[dict[str, Any]] = []
    for n, (entry, parts) in enumerate(zip(kept, frames, strict=True), 1):
        prefix = "frames" if entry["kind"] == "pub" else f"replay_from{first_seq}"
        names = [f"{prefix}_{n:04d}_{part}.bin" for part in ("topic", "seq", "payload")]
        for name, data in zip(names, parts, strict=True):
            (folder / name).write_bytes(data)
        out.append({**entry, "n": n, "files": names})
    (folder / INDEX_FILE).write_text(json.dumps(out, indent=1))
    return len(entries) - len(kept)


def replay_queries(folder: Path, queries: Path) -> list[dict[str, Any]]:
    """`kvroute events replay FOLDER --query QUERIES`: one JSON object per query."""
    cmd = [*KVROUTE, "events", "replay", str(folder), "--query", str(queries)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise CaptureError(f"kvroute events replay exited {done.returncode}: {done.stderr[-500:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
