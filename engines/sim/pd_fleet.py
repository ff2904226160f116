"""A prefill/decode fleet of simulated workers that hand KV over with real NIXL transfers.

As child processes, one `kvroute sim` each (what tests, `kvroute demo --pd` and
`kvroute bench pd` want: transfers cross processes as they do between pods):

    with start_pd_fleet(prefill=1, decode=1, args=["--kv-bytes-per-token", "8192"],
                        decode_args=["--link-mb-s", "104"]) as fleet:
        fleet.prefill_urls, fleet.decode_urls, fleet.workers[0]["kv_transfer"]

In this process and event loop (cheaper; NIXL then moves bytes between two agents of one
process):

    async with run_pd_fleet(prefill=1, decode=1) as fleet:
        fleet.prefill[0].url, fleet.decode[0].connector.counters

Workers are named prefill-I and decode-I, with roles kv_producer / kv_consumer, their own
engine id and a free side-channel port each.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from engines.sim.config import SimConfig
from engines.sim.fleet import Fleet, drop_scratch, run_fleet, scratch_dir, stop_process
from engines.sim.pd_config import PORT_ENV, ROLES, KVTransferConfig

PD_TOPIC = "kv-events"


@dataclass
class PDFleet:
    """In-process workers, by role."""

    prefill: list[Any]  # SimWorker
    decode: list[Any]

    @property
    def workers(self) -> list[Any]:
        return [*self.prefill, *self.decode]


def pd_configs(
    prefill: int, decode: int, base: SimConfig | None = None, kv: KVTransferConfig | None = None
) -> list[SimConfig]:
    """Configs for `prefill` producers then `decode` consumers from one template."""
    base = base or SimConfig(topic=PD_TOPIC)
    kv = kv or base.kv_transfer or KVTransferConfig()
    out = []
    for role, n in (("prefill", prefill), ("decode", decode)):
        kv_role = ROLES["producer" if role == "prefill" else "consumer"]
        for i in range(n):
            worker_kv = kv.replace(role=kv_role, engine_id="", side_channel_port=0)
            out.append(base.replace(name=f"{role}-{i}", port=0, kv_transfer=worker_kv))
    return out


@asynccontextmanager
async def run_pd_fleet(
    prefill: int = 1,
    decode: int = 1,
    base: SimConfig | None = None,
    kv: KVTransferConfig | None = None,
) -> AsyncIterator[PDFleet]:
    """Run P/D workers in this event loop for the duration of the block."""
    fleet: Fleet
    async with run_fleet(configs=pd_configs(prefill, decode, base, kv)) as fleet:
        yield PDFleet(fleet.workers[:prefill], fleet.workers[prefill:])


# ---- as child processes --------------------------------------------------------------------


class PDFleetProcess:
    """`kvroute sim` children by role; `stop()` ends them by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill: list[dict[str, Any]] = []
        self.decode: list[dict[str, Any]] = []
        self.failed = False  # a worker did not start: its log stays where the error named it
        atexit.register(self.stop)  # never leave workers behind the interpreter

    @property
    def workers(self) -> list[dict[str, Any]]:
        return [*self.prefill, *self.decode]

    @property
    def prefill_urls(self) -> list[str]:
        return [w["url"] for w in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [w["url"] for w in self.decode]

    @property
    def router_args(self) -> list[str]:
        """`kvroute serve` flags naming every worker by its role."""
        return [
            *(a for u in self.prefill_urls for a in ("--prefill-worker", u)),
            *(a for u in self.decode_urls for a in ("--decode-worker", u)),
        ]

    def stop(self, timeout: float = 10.0) -> None:
        """Every worker by PID; their logs' folder goes too, unless one of them failed."""
        atexit.unregister(self.stop)
        codes = []
        for proc in reversed(self.procs):
            codes.append(stop_process(proc, timeout))
            if proc.stdout is not None:
                proc.stdout.close()
        if not self.failed:
            drop_scratch(self.log_dir, *codes)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_pd_fleet(
    prefill: int = 1,
    decode: int = 1,
    args: Sequence[str] = (),
    *,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    timeout: float = 60.0,
) -> PDFleetProcess:
    """Start `prefill` producers and `decode` consumers, each `kvroute sim ARGS ROLE_ARGS`,
    and wait until every one serves. Raises RuntimeError (with the log tail) otherwise."""
    fleet = PDFleetProcess(scratch_dir("kvroute-pd-"))
    try:
        for role, n, extra in (("prefill", prefill, prefill_args), ("decode", decode, decode_args)):
            kv_role = "producer" if role == "prefill" else "consumer"
            for i in range(n):
                name = f"{role}-{i}"
                cmd = ["--name", name, "--kv-role", kv_role, "--topic", PD_TOPIC, *args, *extra]
                info = _start_worker(fleet, name, cmd, timeout)
                (fleet.prefill if role == "prefill" else fleet.decode).append(info)
    except BaseException:
        fleet.failed = True
        fleet.stop(timeout=2)
        raise
    return fleet


def _start_worker(
    fleet: PDFleetProcess, name: str, args: Sequence[str], timeout: float
) -> dict[str, Any]:
    log_path = fleet.log_dir / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if k != PORT_ENV}  # one free port each
    cmd = [sys.executable, "-m", "router.cli", "sim", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
    fleet.procs.append(proc)
    line = _first_line(proc, timeout)
    if line is None:
        raise RuntimeError(
            f"kvroute sim {name} did not start (exit {proc.poll()}; log {log_path}): "
            f"{log_path.read_text(errors='replace')[-2000:]}"
        )
    info: dict[str, Any] = json.loads(line)
    info["pid"] = proc.pid
    info["log"] = str(log_path)
    return info


def _first_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes | None:
    """The worker's JSON line, or None if it exits or stays silent for `timeout`."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                line = proc.stdout.readline()
                return line if line.strip() else None
            if proc.poll() is not None:
                return None
    return None
