"""workers_dns on a dual-stack headless Service: each pod answers an A and an AAAA record,
and is one worker, not two (one of them, on a vLLM listening on IPv4 only, never healthy)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER
from router.workers import one_family

pytestmark = pytest.mark.timeout(60)

SERVICE = "vllm-workers.test"


def v4(ip: str, port: int = 8000) -> tuple[Any, ...]:
    return (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))


def v6(ip: str, port: int = 8000) -> tuple[Any, ...]:
    return (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0))


@pytest.mark.parametrize(
    ("answers", "ips", "said"),
    [
        ([v4("10.1.0.8"), v4("10.1.0.7")], ["10.1.0.7", "10.1.0.8"], ""),
        (
            [v6("fd00::7"), v4("10.1.0.7"), v6("fd00::8"), v4("10.1.0.8")],
            ["10.1.0.7", "10.1.0.8"],
            "IPv4 and IPv6",
        ),
        ([v6("fd00::8"), v6("fd00::7")], ["fd00::7", "fd00::8"], "IPv6 addresses only"),
        ([v4("10.1.0.7"), v4("10.1.0.7")], ["10.1.0.7"], ""),
        ([], [], ""),
    ],
    ids=["ipv4-only", "dual-stack-takes-ipv4", "ipv6-only", "one-address-twice", "none"],
)
def test_one_address_family_per_service(
    answers: list[tuple[Any, ...]], ips: list[str], said: str
) -> None:
    got, why = one_family(answers)
    assert got == ips
    assert (said in why) if said else why == ""


async def test_a_dual_stack_pod_is_one_worker(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.workers")
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def resolve(host: Any, port: Any, *args: Any, **kw: Any) -> list[tuple[Any, ...]]:
        if host != SERVICE:
            return await real(host, port, *args, **kw)
        return [v6("::1", int(port)), v4("127.0.0.1", int(port))]  # the pod's AAAA and A

    monkeypatch.setattr(loop, "getaddrinfo", resolve)
    sim = SimConfig(block_size=16, kv_blocks=256, topic="kv-events")
    async with run_fleet(1, sim) as fleet:
        port = fleet.workers[0].port
        config = Config(
            workers_dns=f"{SERVICE}:{port}",
            dns_interval_s=0.05,
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
        )
        app = RouterApp(config.validate())
        async with serve_in_process(app):
            await asyncio.sleep(0.3)  # resolved again a few times
            assert sorted(app.pool.handles) == [f"127.0.0.1:{port}"]
    said = [r.message for r in caplog.records if "IPv4 and IPv6" in r.message]
    assert len(said) == 1 and SERVICE in said[0]


async def test_a_dual_stack_worker_name_is_addressed_by_its_ipv4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker given by a name with AAAA and A records: the address a gateway is told to
    send to (override_host) is the IPv4 one, where vLLM's default --host 0.0.0.0 listens,
    though getaddrinfo ranks the IPv6 one first."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def resolve(host: Any, port: Any, *args: Any, **kw: Any) -> list[tuple[Any, ...]]:
        if host != SERVICE:
            return await real(host, port, *args, **kw)
        return [v6("::1", int(port)), v4("127.0.0.1", int(port))]

    monkeypatch.setattr(loop, "getaddrinfo", resolve)
    sim = SimConfig(block_size=16, kv_blocks=256, topic="kv-events")
    async with run_fleet(1, sim) as fleet:
        port = fleet.workers[0].port
        config = Config(
            workers=(WorkerConfig(url=f"http://{SERVICE}:{port}"),),
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
        )
        app = RouterApp(config.validate())
        async with serve_in_process(app):
            (handle,) = app.pool.handles.values()
            assert handle.address == f"127.0.0.1:{port}"
            assert {s.address for s in handle.states} == {f"127.0.0.1:{port}"}
