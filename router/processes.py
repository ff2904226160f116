"""`kvroute serve --processes N`: N router processes behind one port, one fleet view each.

One event loop's Python is the ceiling of one process (measured on 2 cores, shared-prefix
prompts at 32 connections: one process 2,332 req/s, two 3,971, vllm-router 3,816; distinct
prompts 1,241 -> 2,112), so `--processes N` runs N full routers:

- every process binds the port itself with SO_REUSEPORT, so the kernel spreads connections
  over them (a shared accept socket lets one process take a whole burst of connections);
- every process consumes every worker's KV events (the same index in each: memory x N);
- the processes share placements and in-flight load over the placement link
  (router/peers.py) on unix sockets in a private directory, so they count each other's
  requests once, exactly as replicas do;
- /metrics adds up the processes' counters, histograms and in-flight gauges (Prometheus'
  multiprocess files, in the same directory); the fleet's gauges (index, health) are the
  answering process's, the same in every one; what every process sees alike (the workers'
  KV event counters, the decode workers' KV bytes and failed pulls) only the first process
  counts (`counts_worker_totals`): a dead process's counter file stays, so a restarted
  first process adds to what its predecessor counted and the sum never goes back;
- an admin change (POST /admin/workers, drain, undrain) is applied by the process that got it
  and passed on to the others over their private sockets before it answers.

This process (the supervisor) starts them, restarts one that dies, passes SIGTERM and SIGINT
on (each drains as a single router does) and exits once they have; it serves nothing itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

log = logging.getLogger("kvroute.processes")

ENV_INDEX = "KVROUTE_PROCESS_INDEX"  # set by the supervisor for its children only
ENV_DIR = "KVROUTE_PROCESS_DIR"
ENV_COUNT = "KVROUTE_PROCESS_COUNT"
RESTART_BACKOFF_S = 1.0  # a child that died is started again after this long
PR_SET_PDEATHSIG = 1  # prctl(2)
QUICK_DEATH_S = 5.0  # a child dying this soon after its start failed to start
QUICK_DEATHS = 3  # ... this many times in a row (or every child at once): give up


@dataclass(frozen=True)
class ProcessRole:
    """Which of the N processes this one is, and where its siblings listen."""

    index: int
    count: int
    directory: Path

    def link(self, i: int) -> str:
        return f"ipc://{self.directory / f'peer-{i}.sock'}"

    def admin_socket(self, i: int) -> Path:
        return self.directory / f"admin-{i}.sock"

    @property
    def admin_state(self) -> Path:
        """The admin API's changes (worker list, drains) as the processes last applied
        them: a child the supervisor restarts starts from these, not from its command
        line, or it would route to removed and drained workers its siblings avoid."""
        return self.directory / "admin-state.json"

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    @property
    def metrics_dir(self) -> Path:
        return self.directory / "metrics"


def role_from_env(environ: dict[str, str] | None = None) -> ProcessRole | None:
    env = os.environ if environ is None else environ
    if ENV_INDEX not in env:
        return None
    return ProcessRole(int(env[ENV_INDEX]), int(env[ENV_COUNT]), Path(env[ENV_DIR]))


def counts_worker_totals(environ: dict[str, str] | None = None) -> bool:
    """Whether this process counts what every process sees alike (the workers' KV event
    counters, the decode workers' KV bytes and failed pulls): one that is not one of
    `--processes`, or the first of them. Counted by each, their sum over the processes'
    metrics files would multiply them."""
    role = role_from_env(environ)
    return role is None or role.index == 0


def _tcp_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def listen_sockets(role: ProcessRole, host: str, port: int) -> list[socket.socket]:
    """The shared port (SO_REUSEPORT) and this process's private admin socket."""
    shared = _tcp_socket(host)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind((host, port))
    shared.listen(2048)
    path = role.admin_socket(role.index)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private.bind(str(path))
    os.chmod(path, 0o600)
    private.listen(64)
    return [shared, private]


def bind_port(host: str, port: int) -> socket.socket | str:
    """A listening socket on host:port, or why there can be none (the one-process router).
    A name binds the first address it resolves to (IPv6 too)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}; check --host"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        return (
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; another process holds "
            "it, or the address is not this host's: choose another --port or --host"
        )
    return sock


def check_port(host: str, port: int) -> str | None:
    """Why the children should not bind host:port, or None: checked once, up front, without
    SO_REUSEPORT, so that a router already listening there (another `--processes`
    instance, whose sockets would otherwise quietly share the connections) is refused."""
    probe = bind_port(host, port)
    if isinstance(probe, str):
        return probe
    probe.close()
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it (a drain) if the supervisor dies, even killed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's own exit path only
        pass


class Supervisor:
    """Starts N `kvroute serve` children with the same arguments; see the module doc."""

    def __init__(self, argv: list[str], count: int, drain_s: float) -> None:
        self.argv = argv
        self.count = count
        self.drain_s = drain_s  # drain delay + timeout: how long children may take to exit
        self.directory = Path(tempfile.mkdtemp(prefix="kvroute-processes-"))
        self.metrics_dir = ProcessRole(0, count, self.directory).metrics_dir
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.stopping = False
        self.stopped_at: float | None = None  # when the supervisor first saw the stop
        self.killed = False  # a child outlived its drain and was killed

    def _spawn(self, i: int) -> None:
        env = dict(os.environ)
        env[ENV_INDEX], env[ENV_COUNT], env[ENV_DIR] = str(i), str(self.count), str(self.directory)
        # prometheus_client reads it at import: each child's metrics go to files here
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        cmd = [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]
        self.children[i] = child = subprocess.Popen(
            [*cmd, *self.argv], env=env, preexec_fn=_die_with_parent
        )
        if self.stopping:  # a signal forwarded while it started passed it by
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        self.started[i] = time.monotonic()
        log.info("process %d/%d started (pid %d)", i + 1, self.count, self.children[i].pid)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping and sig == signal.SIGINT:
            sig = signal.SIGKILL  # a second Ctrl-C: now
        self.stopping = True
        self.stopped_at = self.stopped_at or time.monotonic()
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)

    def run(self) -> int:
        self.metrics_dir.mkdir()
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        try:
            for i in range(self.count):
                if self.stopping:  # a signal came while the first ones started
                    break
                self._spawn(i)
            code = self._watch()
        finally:
            self._stop_all()
            shutil.rmtree(self.directory, ignore_errors=True)
        return code or int(self.killed)  # a child that had to be killed: not a clean stop

    def _watch(self) -> int:
        from prometheus_client import multiprocess

        codes: dict[int, int] = {}
        quick: dict[int, int] = {}  # deaths in a row within QUICK_DEATH_S of a start
        while len(codes) < len(self.children):
            time.sleep(0.2)
            if self.stopping:
                self.stopped_at = self.stopped_at or time.monotonic()
                if time.monotonic() - self.stopped_at > self.drain_s + 5:
                    break  # a child still up past its drain: `_stop_all` ends it
            for i, child in list(self.children.items()):
                code = child.poll()
                if code is None or i in codes:
                    continue
                # its live gauges (in flight) must stop counting in the sums
                multiprocess.mark_process_dead(child.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
                if self.stopping:
                    codes[i] = code
                    continue
                lived = time.monotonic() - self.started[i]
                log.error("process %d/%d exited %d after %.1f s", i + 1, self.count, code, lived)
                quick[i] = quick.get(i, 0) + 1 if lived < QUICK_DEATH_S else 0
                all_down = all(c.poll() is not None for c in self.children.values())
                if (all_down and lived < QUICK_DEATH_S) or quick[i] >= QUICK_DEATHS:
                    log.error("the processes fail at start: see the errors above")
                    self.stopping = True
                    self._forward(signal.SIGTERM, None)
                    return code or 1
                time.sleep(RESTART_BACKOFF_S)
                if self.stopping:  # stopped during the back-off: a new child would miss it
                    codes[i] = code
                    continue
                self._spawn(i)
        return max(codes.values(), default=0)

    def _stop_all(self) -> None:
        # one drain's time from the stop, not another from here: the pod's grace period
        # covers one
        deadline = (self.stopped_at or time.monotonic()) + self.drain_s + 5
        for child in self.children.values():
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        for child in self.children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                self.killed = True
