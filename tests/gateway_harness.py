"""A real Envoy in front of simulated vLLM workers, with kvroute's ext_proc picker deciding:
everything on loopback, started and stopped per test.

The picker's decision service is a parameter (`make_service`): today the stand-in of
tests/extproc_standin.py, which ranks workers in a seeded random order and records every
accounting call; switching the tests to the real `router.routing.DecisionService` means
passing a factory that builds it for the fleet -- nothing else changes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import extproc_standin
from engines.sim.config import SimConfig
from engines.sim.fleet import Fleet, run_fleet
from engines.sim.latency import LatencyModel
from router.envoy.bootstrap import Endpoint, GatewayConfig, parse_worker
from router.envoy.process import EnvoyProcess
from router.procs import free_port

extproc_standin.install()

from router.extproc.server import ExtProcServer  # noqa: E402  (after the stand-in)

FAST = LatencyModel(ttft_base_ms=1.0, decode_ms_per_step=1.0)
MODEL = SimConfig().model
MakeService = Callable[[list[str]], Any]


def standin_service(addresses: list[str]) -> Any:
    return extproc_standin.DecisionService(addresses, models=(MODEL,))


@dataclass
class Gateway:
    fleet: Fleet
    svc: Any
    picker: ExtProcServer | None
    envoy: EnvoyProcess
    client: httpx.AsyncClient

    @property
    def addresses(self) -> list[str]:
        return [address(u) for u in self.fleet.urls]

    def fingerprints(self) -> dict[str, str]:
        """system_fingerprint -> worker address: where a response really came from."""
        return {w.fingerprint: address(w.url) for w in self.fleet.workers}

    async def complete(self, prompt: str, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        return await self.client.post("/v1/completions", json=body)


def address(url: str) -> str:
    e = parse_worker(url)
    return f"{e.host}:{e.port}"


def served_by(gw: Gateway, resp: httpx.Response) -> str | None:
    """The worker whose engine produced this response (JSON or SSE)."""
    fps = gw.fingerprints()
    text = resp.text
    if text.startswith("data:") or "\ndata:" in text:
        for line in text.splitlines():
            if line.startswith("data: {") and "system_fingerprint" in line:
                return fps.get(json.loads(line[6:]).get("system_fingerprint"))
        return None
    return fps.get(resp.json().get("system_fingerprint"))


@contextlib.asynccontextmanager
async def gateway(
    *,
    workers: int = 2,
    body_mode: str = "buffered",
    failure_mode: str = "close",
    make_service: MakeService = standin_service,
    extra_endpoints: tuple[Endpoint, ...] = (),
    eds_path: Path | None = None,
    timeout_s: float = 30.0,
) -> AsyncIterator[Gateway]:
    """Fleet + picker + Envoy; `extra_endpoints` are cluster members that are not in the
    fleet (e.g. a port nobody listens on, for the fallback test)."""
    async with run_fleet(workers, SimConfig(latency=FAST, model=MODEL)) as fleet:
        members = tuple(parse_worker(u) for u in fleet.urls) + extra_endpoints
        svc = make_service([f"{e.host}:{e.port}" for e in members])
        picker = ExtProcServer(svc, "127.0.0.1", 0)
        await picker.start()
        try:
            cfg = GatewayConfig(
                listen_port=free_port(),
                ext_proc=Endpoint("127.0.0.1", picker.port),
                workers=() if eds_path else members,
                body_mode=body_mode,
                failure_mode=failure_mode,
                admin_port=free_port(),
                listen_host="127.0.0.1",
                eds_path=eds_path,
                picker_health_interval_s=0.5,
            )
            with EnvoyProcess(cfg) as envoy:
                limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
                async with httpx.AsyncClient(
                    base_url=envoy.url, timeout=timeout_s, limits=limits
                ) as client:
                    await _wait_picker_healthy(envoy)
                    yield Gateway(fleet, svc, picker, envoy, client)
        finally:
            await picker.stop(0.5)


async def _wait_picker_healthy(envoy: EnvoyProcess, timeout_s: float = 10.0) -> None:
    """The picker cluster's first health check must pass before requests count."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as admin:
        while loop.time() < deadline:
            text = (await admin.get(f"{envoy.admin}/clusters")).text
            if "kvroute_picker::" in text and _healthy(text, "kvroute_picker"):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError("the picker cluster never became healthy in Envoy")


def _healthy(clusters_text: str, cluster: str) -> bool:
    lines = [ln for ln in clusters_text.splitlines() if ln.startswith(cluster + "::")]
    flags = [ln for ln in lines if "::health_flags::" in ln]
    return bool(flags) and all(ln.endswith("::healthy") for ln in flags)
