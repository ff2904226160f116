"""Child processes of the conformance suite: each runs in its own process group, which is
signalled as a whole (SIGTERM, then SIGKILL after a grace period), so no engine worker or
tokenizer helper outlives the suite on any exit path."""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# Health checks go straight to loopback even when http_proxy is set.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_CHILDREN: set[subprocess.Popen[bytes]] = set()  # started by spawn(), not yet stopped


_GIVEN: collections.deque[int] = collections.deque(maxlen=1024)  # ports handed out lately


def free_port() -> int:
    """A loopback port free at this instant, and not one this process handed out lately.
    A port is free again once its probe socket closes, so without the memory two calls a
    moment apart can name the same port before either child binds it: measured in the
    routing bench, a replica's HTTP port came back equal to its own placement link's, and
    the server then failed to bind. Another process can still take a port first; callers
    that must not fail retry."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.append(port)
            return port


def free_ports(n: int) -> tuple[int, ...]:
    """`n` distinct free ports (`free_port`)."""
    return tuple(free_port() for _ in range(n))


def spawn(
    cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new process group, stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,  # own process group: one signal reaches every child
        )
    _CHILDREN.add(proc)
    return proc


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after `grace_s`."""
    _CHILDREN.discard(proc)
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # A parent can exit before its children do.
    if group_alive(proc.pid, grace_s if proc.returncode is not None else 0.0):
        signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_alive(pgid: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if not group_members(pgid):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a group, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@atexit.register
def _stop_children() -> None:
    """Last resort (interpreter exit, including after SIGTERM turned into KeyboardInterrupt):
    no child group outlives the suite."""
    for proc in list(_CHILDREN):
        stop_group(proc, 5.0)
