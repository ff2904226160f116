"""The peer routers the benchmarks compare kvroute with: sglang-router and vllm-router (both
Rust, from PyPI), launched on loopback in front of the same workers.

They live in their own virtualenv outside the tree (`~/.cache/kvroute/bench-peers`, or
`$KVROUTE_PEERS_VENV`), created and filled by `ensure_peers()` the first time a benchmark
needs them (tried once per invocation; a failure says what to do), so one command gives
the whole table. Versions are pinned to the ones DESIGN.md's figures were measured with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import httpx

from engines.sim.fleet import drop_scratch, scratch_dir
from router.procs import free_port

PEERS_VENV = Path(os.environ.get("KVROUTE_PEERS_VENV", Path.home() / ".cache/kvroute/bench-peers"))
PEER_PACKAGES = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
_TRIED: set[str] = set()  # peers this process already tried to install


def peer_bin(name: str) -> str | None:
    """The peer's executable: the bench venv first, then this interpreter's, then PATH."""
    for folder in (PEERS_VENV / "bin", Path(sys.executable).parent):
        candidate = folder / name
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)


def ensure_peers(names: Sequence[str], install: bool = True) -> dict[str, str | None]:
    """Binary per peer; missing ones are pip-installed into PEERS_VENV first (and we say
    so), at most once per process: a failed install is not retried by a later call. A
    peer still missing is None, which the bench reports as a skipped row with `remedy()`."""
    missing = [n for n in names if peer_bin(n) is None and n not in _TRIED]
    if missing and install:
        _TRIED.update(missing)
        _install([PEER_PACKAGES[n] for n in missing])
    return {n: peer_bin(n) for n in names}


def remedy(name: str) -> str:
    """What a user can do about a peer that is not installed (no network, --no-install)."""
    return (
        f"check the network and the proxy pip uses (PIP_INDEX_URL, HTTPS_PROXY) and rerun; "
        f"or `pip install {PEER_PACKAGES[name]}` into $KVROUTE_PEERS_VENV ({PEERS_VENV}); "
        f"or put {name} on PATH; or leave its routers out of --routers"
    )


def _install(specs: list[str]) -> None:
    print(f"installing {' '.join(specs)} into {PEERS_VENV}", file=sys.stderr, flush=True)
    try:
        if not (PEERS_VENV / "bin" / "pip").exists():
            venv = [sys.executable, "-m", "venv", str(PEERS_VENV)]
            subprocess.run(venv, check=True, capture_output=True, text=True)
        pip = [str(PEERS_VENV / "bin" / "pip"), "install", "-q", *specs]
        subprocess.run(pip, check=True, capture_output=True, text=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"could not install {' '.join(specs)}: {_why(exc)}", file=sys.stderr)
        names = [n for n, spec in PEER_PACKAGES.items() if spec in specs]
        for name in names:
            print(f"  {name} is skipped: {remedy(name)}", file=sys.stderr)


def _why(exc: BaseException) -> str:
    """pip's own last error line, and whether it could not reach its index (its retries'
    warnings, which say so, come long before it)."""
    out = str(getattr(exc, "stderr", None) or "")
    errors = [x for x in out.splitlines() if x.startswith("ERROR:")]
    why = errors[-1].removeprefix("ERROR: ") if errors else str(exc)
    return f"{why} (pip could not reach its index)" if "Retrying" in out else why


def peer_args(port: int, workers: Sequence[str], policy: str = "cache_aware") -> list[str]:
    """Both peers: a policy, on loopback, periodic health checks out of the benchmark's
    way, their Prometheus endpoint (neither can turn it off) on loopback too."""
    return [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--policy", policy, "--health-check-interval-secs", "3600",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def sglang_command(binary: str, port: int, workers: Sequence[str], policy: str) -> list[str]:
    return [binary, "launch", *peer_args(port, workers, policy), "--log-level", "warn"]


def vllm_router_command(
    binary: str, port: int, workers: Sequence[str], policy: str, extra: Sequence[str] = ()
) -> list[str]:
    return [binary, *peer_args(port, workers, policy), "--log-level", "warning", *extra]


class Peer(NamedTuple):
    url: str
    pid: int  # the peer's process (its CPU time is read from /proc)


@contextlib.contextmanager
def child(cmd: list[str], url: str, ready_path: str, timeout: float = 60) -> Iterator[Peer]:
    """Run a peer in its own session until the block ends; yields it once `ready_path`
    answers 200. Its output goes to a log file quoted when it dies early."""
    log_path = scratch_dir("kvroute-peer-") / "peer.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ready = False
    try:
        _wait_ready(proc, cmd[0], url + ready_path, log_path, timeout)
        ready = True
        yield Peer(url, proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if ready:  # a peer that never served keeps its log (the error quoted it)
            drop_scratch(log_path.parent, proc.returncode)


def _wait_ready(
    proc: subprocess.Popen[bytes], name: str, url: str, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log_path.read_text()[-1500:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready in {timeout} s (log {log_path})")
        time.sleep(0.2)
