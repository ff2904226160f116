"""Child processes for the demo, benchmarks and tests: a simulated fleet and a router, each
started on free loopback ports, waited for, and stopped by PID on every exit path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from conformance.procs import free_port as free_port  # the one port picker, re-exported
from engines.sim.fleet import FleetProcess as _SimFleet
from engines.sim.fleet import drop_scratch, scratch_dir, start_fleet_process, stop_process


class _Stoppable:
    """Context-manager protocol for child processes: leaving the block stops the child."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class FleetProcess(_Stoppable):
    """`kvroute fleet` in a child process."""

    def __init__(
        self,
        workers: int = 2,
        *,
        block_size: int = 16,
        kv_blocks: int = 926,
        extra: Sequence[str] = (),
    ) -> None:
        args = ["--block-size", str(block_size), "--kv-blocks", str(kv_blocks), *extra]
        self._fleet: _SimFleet = start_fleet_process(workers, args)

    @property
    def workers(self) -> list[dict[str, Any]]:
        return self._fleet.workers

    @property
    def urls(self) -> list[str]:
        return [str(w["url"]) for w in self.workers]

    def stop(self) -> None:
        self._fleet.stop()


class RouterProcess(_Stoppable):
    """`kvroute serve` in a child process, on a free port, waited for until /ready."""

    def __init__(
        self,
        workers: Sequence[str],
        *,
        policy: str = "kv",
        tokenizer: str | Path | None = None,
        extra: Sequence[str] = (),
        ready_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        """`log_dir`: keep the log there (a report names it); by default it goes to a
        scratch folder that `stop()` removes unless the router failed."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # /admin and /debug are off without a token: each router gets its own (callers
        # pass it to router-check and kvroute explain), unless the caller's environment
        # names one (a diagnosis that asks routers it did not start for explanations)
        self.admin_token = os.environ.get("KVROUTE_ADMIN_TOKEN") or secrets.token_hex(16)
        cmd = [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--port",
            str(self.port),
            "--policy",
            policy,
        ]
        for w in workers:
            cmd += ["--worker", w]
        if tokenizer is not None:
            cmd += ["--tokenizer", str(tokenizer)]
        cmd += list(extra)
        self._scratch: Path | None = None
        if log_dir is None:
            log_dir = self._scratch = scratch_dir("kvroute-router-")
        else:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "router.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KVROUTE_ADMIN_TOKEN": self.admin_token, **(env or {})},
            )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            stop_process(self.proc)  # its log stays: the error quotes it
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvroute serve exited {self.proc.returncode} (log {self.log_path}): "
                    f"{self.log()}"
                )
            try:
                ready = httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
                if ready and self._every_process_answers():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"kvroute serve not ready in {timeout} s (log {self.log_path}): {self.log()}"
        )

    def _every_process_answers(self) -> bool:
        """With --processes N, all N: one still starting gets no connection opened now, and
        a benchmark's keep-alive connections would never reach it."""
        seen: set[int] = set()
        of = 1
        for _ in range(40):  # each on a new connection: the kernel picks the process
            doc = httpx.get(f"{self.url}/health", timeout=1).json()
            process = doc.get("process") or {"index": 1, "of": 1}
            seen.add(int(process["index"]))
            of = int(process["of"])
            if len(seen) == of:
                return True
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 10.0) -> None:
        drop_scratch(self._scratch, stop_process(self.proc, timeout))


def _quiet_server_class() -> Any:
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # signals belong to the host process (pytest), not to this server

    return Quiet


_QuietServer = _quiet_server_class()


@contextlib.asynccontextmanager
async def serve_in_process(app: Any, port: int | None = None) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn in this event loop (tests); yields its base URL."""
    from router.server import server_config

    port = port or free_port()
    cfg = getattr(app, "config", None)  # a router's own timeouts; server_config's otherwise
    timeouts = {}
    if cfg is not None:
        timeouts = {
            "header_timeout_s": cfg.header_timeout_s,
            "keep_alive_timeout_s": cfg.keep_alive_timeout_s,
        }
    config = server_config(app, "127.0.0.1", port, loop="asyncio", **timeouts)
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
