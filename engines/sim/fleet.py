"""A fleet of simulated vLLM workers on free loopback ports, in one process and one event loop.

Command line:

    kvroute fleet --workers 2 [--kv-blocks 926] [--no-events-on 1] [--json fleet.json]

prints (and writes, atomically) `{"pid", "workers": [{"name", "url", "events_endpoint",
"replay_endpoint", "topic", "block_size", ...}]}` once every worker serves, then runs until
SIGINT/SIGTERM.

Python, in-process (tests, benchmarks):

    async with run_fleet(2, SimConfig(kv_blocks=926)) as fleet:
        fleet.urls, fleet.info(), fleet.workers[0].engine ...

Python, as a subprocess (the demo; it must survive the caller's event loop):

    with start_fleet_process(2, ["--kv-blocks", "926"]) as proc:
        proc.info["workers"][0]["url"]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from engines.sim.cli import add_engine_args, config_from_args, wait_for_signal
from engines.sim.config import ConfigError, SimConfig
from engines.sim.dp import sim_worker
from engines.sim.worker import SimWorker

FLEET_TOPIC = "kv-events"

DESCRIPTION = """\
Start N simulated vLLM workers (see `kvroute sim --help`) on free loopback ports, each with
its own KV cache, event publisher and replay socket. Prints their URLs and endpoints as JSON
(and writes them to --json PATH), then serves until Ctrl-C / SIGTERM."""


class Fleet:
    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self.workers = list(workers)

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "workers": [w.info() for w in self.workers]}


def fleet_configs(
    n: int, base: SimConfig | None = None, no_events_on: Sequence[int] = ()
) -> list[SimConfig]:
    """N worker configs from one template: names sim-0.., free ports, events off where asked."""
    if n < 1:
        raise ConfigError(f"workers={n}: a fleet needs at least one worker")
    bad = [i for i in no_events_on if not 0 <= i < n]
    if bad:
        raise ConfigError(f"--no-events-on {bad}: worker indexes run 0..{n - 1}")
    base = base or SimConfig(topic=FLEET_TOPIC)
    return [
        base.replace(name=f"sim-{i}", port=0, events=base.events and i not in no_events_on)
        for i in range(n)
    ]


@asynccontextmanager
async def run_fleet(
    n: int = 2,
    base: SimConfig | None = None,
    *,
    no_events_on: Sequence[int] = (),
    configs: Sequence[SimConfig] | None = None,
    make_worker: Callable[[SimConfig], SimWorker] | None = None,
) -> AsyncIterator[Fleet]:
    """Run workers in this event loop for the duration of the block."""
    configs = list(configs) if configs is not None else fleet_configs(n, base, no_events_on)
    workers: list[SimWorker] = []
    try:
        for config in configs:
            worker = (make_worker or sim_worker)(config)
            workers.append(worker)
            await worker.start()
        yield Fleet(workers)
    finally:
        for worker in reversed(workers):
            await worker.stop()


# ---- command line --------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "fleet",
        help="run N simulated vLLM workers on free loopback ports",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="how many workers (default 2)")
    p.add_argument(
        "--no-events-on",
        type=int,
        action="append",
        default=[],
        metavar="I",
        help="worker index (0-based) that publishes no KV events; repeatable",
    )
    p.add_argument("--no-replay", action="store_true", help="workers run no replay socket")
    p.add_argument("--json", type=Path, default=None, help="also write the fleet JSON here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        base = config_from_args(args, default_topic=FLEET_TOPIC)
        if args.no_replay:
            base = base.replace(replay_endpoint=None)
        configs = fleet_configs(args.workers, base, args.no_events_on)
    except ConfigError as exc:
        print(f"kvroute fleet: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(configs, args.json))


async def _serve(configs: list[SimConfig], json_path: Path | None) -> int:
    try:
        async with run_fleet(configs=configs) as fleet:
            doc = json.dumps(fleet.info(), indent=2)
            if json_path is not None:
                _write_atomic(json_path, doc)
            print(doc, flush=True)
            await wait_for_signal()
    except (RuntimeError, OSError) as exc:
        print(f"kvroute fleet: {exc}", file=sys.stderr)
        return 1
    return 0


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


# ---- as a subprocess -----------------------------------------------------------------------


KEEP_LOGS_ENV = "KVROUTE_KEEP_LOGS"
# how a child we stopped ends: it exits 0 on SIGTERM, or dies of it (-15; 143 via a shell)
STOPPED_CODES = frozenset({0, -signal.SIGTERM, 128 + signal.SIGTERM})


# the folders `scratch_dir` made in this process: the only ones `drop_scratch` may remove, so
# a caller that hands it a folder of its own (a log dir, /tmp) never loses it
_SCRATCH: set[Path] = set()


def scratch_dir(prefix: str) -> Path:
    """A private folder for a child process's log and files; `drop_scratch` removes it."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _SCRATCH.add(folder)
    return folder


def drop_scratch(folder: Path | None, *codes: int | None) -> None:
    """Remove a stopped child's folder when every exit code says it was simply stopped. A
    child that failed or had to be killed keeps its log for whoever reads the error that
    quoted it (benchmarks and test runs would otherwise leave a folder per child behind);
    KVROUTE_KEEP_LOGS=1 keeps every one. A folder `scratch_dir` did not make is never
    removed, whatever the codes."""
    if folder is None or folder not in _SCRATCH:
        return
    if os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0"):
        return
    if all(code in STOPPED_CODES for code in codes):
        _SCRATCH.discard(folder)
        shutil.rmtree(folder, ignore_errors=True)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """End a child we started, by its PID: SIGTERM, then SIGKILL after `timeout`."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


class FleetProcess:
    """A `kvroute fleet` child process; `info` is its JSON, `stop()` ends it by PID."""

    def __init__(self, proc: subprocess.Popen[bytes], info: dict[str, Any], log: Path) -> None:
        self.proc = proc
        self.info = info
        self.log = log
        atexit.register(self.stop)  # never leave a fleet behind the interpreter

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = self.info["workers"]
        return workers

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status. The folder with
        its JSON and log goes too, unless the fleet failed (`drop_scratch`)."""
        atexit.unregister(self.stop)
        code = stop_process(self.proc, timeout)
        drop_scratch(self.log.parent, code)
        return code

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_fleet_process(
    workers: int = 2, args: Sequence[str] = (), timeout: float = 60.0
) -> FleetProcess:
    """Start `kvroute fleet --workers N ARGS...` and wait until every worker serves."""
    tmp = scratch_dir("kvroute-fleet-")
    json_path, log_path = tmp / "fleet.json", tmp / "fleet.log"
    cmd = [sys.executable, "-m", "router.cli", "fleet", "--workers", str(workers)]
    cmd += ["--json", str(json_path), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + timeout
    while not json_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, timeout=2)  # its folder stays: the error names its log
            raise RuntimeError(
                f"kvroute fleet did not start (exit {proc.returncode}; log {log_path}): "
                f"{log_path.read_text(errors='replace')[-2000:]}"
            )
        time.sleep(0.05)
    return FleetProcess(proc, json.loads(json_path.read_text()), log_path)
