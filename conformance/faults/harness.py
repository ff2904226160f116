"""What the fault checks share: simulated workers in child processes (so a test can kill,
stop or restart one), a router in a child process, and a load generator that classifies
every request's fate.

A request's fate:
    ok            200, the stream ended with [DONE] (or a complete JSON answer)
    cut           the stream had started and ended with kvroute's error event, then [DONE]
    refused       the router answered 4xx/5xx before any byte of an answer (a lost request)
    broken        the connection failed before an answer started (a lost request)
    truncated     a stream that ended without [DONE]: the client cannot tell (never allowed)
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.sim.fleet import drop_scratch, scratch_dir, stop_process
from router.procs import RouterProcess, free_port

SIM_ARGS = ("--block-size", "16", "--kv-blocks", "1024", "--topic", "kv-events")
WORDS = [
    "cache",
    "route",
    "prefix",
    "block",
    "worker",
    "token",
    "stream",
    "event",
    "index",
    "replay",
    "drain",
    "fault",
]


class SimProcess:
    """`kvroute sim` in a child process on a port of ours (a restart can reuse it)."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = SIM_ARGS) -> None:
        self.port = port or free_port()
        self.args = args
        self.log = scratch_dir("kvroute-fault-sim-") / "sim.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False  # by a fault: its SIGKILL is no failure of its own
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.killed = False
        cmd = [sys.executable, "-m", "router.cli", "--log-level", "WARNING", "sim"]
        cmd += ["--port", str(self.port), *self.args]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"kvroute sim on port {self.port} did not start: {self.tail()}")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()
        self.killed = True

    def stop(self) -> None:
        """SIGTERM (after SIGCONT: a fault may have paused it); its log's folder goes
        unless it failed on its own."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)
            code = stop_process(self.proc, 5)
            drop_scratch(self.log.parent, 0 if self.killed and code == -signal.SIGKILL else code)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""


def router_for(sims: list[SimProcess], *extra: str) -> RouterProcess:
    """kvroute serve over the sims, probing them every 0.5 s with a 1 s probe timeout."""
    from router.tokenize import PACKAGED_TOKENIZER

    return RouterProcess(
        [s.url for s in sims],
        tokenizer=PACKAGED_TOKENIZER,
        extra=["--health-timeout", "1", *extra],
        ready_timeout=60.0,
        env={"KVROUTE_HEALTH_CHECK_INTERVAL_S": "0.5", "KVROUTE_SCRAPE_INTERVAL_S": "0.5"},
    )


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompt(rng: random.Random, words: int = 300) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Load:
    """c concurrent clients sending streaming completions to `urls` (round robin over them,
    retrying a request whose connection was refused on the next one, as a load balancer
    does) until `stop` is set."""

    urls: list[str]
    concurrency: int = 32
    max_tokens: int = 24
    seed: int = 1
    fates: Counter[str] = field(default_factory=Counter)
    first_failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _turn: int = 0

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self.stop.is_set():
            fate = await self.one(client, prompt(rng))
            if fate.startswith("refused:"):
                self._note(f"answered {fate[len('refused:') :]} at {time.monotonic():.1f}")
                fate = "refused"
            self.fates[fate] += 1

    async def one(self, client: httpx.AsyncClient, text: str) -> str:
        body = {"model": "kvroute-sim", "prompt": text, "max_tokens": self.max_tokens}
        body |= {"stream": True}
        start = self._turn
        self._turn += 1
        for k in range(len(self.urls)):
            url = self.urls[(start + k) % len(self.urls)]
            try:
                return await _stream(client, f"{url}/v1/completions", body)
            except httpx.ConnectError:
                continue  # a replica that is gone: the balancer tries the next
            except httpx.HTTPError as exc:
                self._note(f"{type(exc).__name__} from {url} at {time.monotonic():.1f}: {exc}")
                return "broken"
        self._note(f"every replica refused the connection at {time.monotonic():.1f}")
        return "broken"

    def _note(self, what: str) -> None:
        if len(self.first_failures) < 5:
            self.first_failures.append(what)

    def lost(self) -> int:
        return self.fates["refused"] + self.fates["broken"] + self.fates["truncated"]


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            answer = (await resp.aread())[:300].decode(errors="replace")
            return f"refused:{resp.status_code} {answer}"
        last = ""
        error = False
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                last = line
                if line.startswith('data: {"error"'):
                    error = True
    if last != "data: [DONE]":
        return "truncated"
    return "cut" if error else "ok"


async def timed(coro: Any, label: str, out: dict[str, float]) -> Any:
    t0 = time.monotonic()
    try:
        return await coro
    finally:
        out[label] = round(time.monotonic() - t0, 2)


def figures(load: Load) -> dict[str, Any]:
    return {
        "requests": sum(load.fates.values()),
        "fates": dict(load.fates),
        "lost": load.lost(),
        "first_failures": load.first_failures,
    }


async def until(predicate: Any, timeout_s: float, every_s: float = 0.05) -> float | None:
    """Seconds until the async `predicate()` held, or None if it never did in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await predicate():
            return round(time.monotonic() - t0, 2)
        await asyncio.sleep(every_s)
    return None


async def unavailable(router_url: str, worker: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as client:
        doc = (await client.get(f"{router_url}/health")).json()
    return any(w["name"] == worker and not w["available"] for w in doc.get("workers", []))
