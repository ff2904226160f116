"""`kvroute events capture` stops cleanly on SIGTERM, even where SIGINT is ignored (a shell's
background job), against a real ZMQ publisher on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from indexer.capture import INDEX_FILE
from router.procs import free_port


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_capture_stops_on_sigterm_with_its_frames_written(tmp_path: Path) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    out = tmp_path / "cap"
    cmd = [sys.executable, "-m", "router.cli", "--log-level", "WARNING", "events", "capture"]
    cmd += ["--endpoint", f"tcp://127.0.0.1:{port}", "--topic", "kv", "--out", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_ignore_sigint
    )
    try:
        deadline = time.monotonic() + 30
        while not (out / INDEX_FILE).exists():  # written once the capture is live
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.05)
        seen: list[int] = []
        seq = 0
        while len(seen) < 3:  # publish until three batches are on disk
            assert time.monotonic() < deadline, f"capture wrote {seen}"
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"payload-%d" % seq])
            seq += 1
            time.sleep(0.05)
            try:
                seen = [e["seq"] for e in json.loads((out / INDEX_FILE).read_text())]
            except ValueError:
                continue  # caught mid-write
        proc.send_signal(signal.SIGINT)  # ignored, as in a background job
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
        ctx.term()
    assert proc.returncode == 0, text
    written = json.loads((out / INDEX_FILE).read_text())
    assert f"captured {len(written)} live batches".encode() in text
    assert [e["seq"] for e in written] == list(range(written[0]["seq"], written[-1]["seq"] + 1))
    first = written[0]
    assert (out / first["files"][2]).read_bytes() == b"payload-%d" % first["seq"]
