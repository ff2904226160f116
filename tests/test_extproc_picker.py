"""kvroute's ext_proc picker over real gRPC on loopback, driven by the black-box conformance
kit (python -m conformance.extproc): every GIE case passes against kvroute, and the kit fails
a picker that does not honour the protocol (the bench's do-nothing reference picker). Plus
the serve flags and TLS / mutual TLS on the gRPC port."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import extproc_standin
import gateway_harness  # noqa: F401  (the stand-in answers every call the picker makes)
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.core.errors import ConfigError
from router.procs import FleetProcess, free_port

extproc_standin.install()

from conformance.extproc.__main__ import run as run_kit  # noqa: E402
from conformance.extproc.cases import CASES  # noqa: E402
from router.extproc.cli import add_arguments, server_from_args  # noqa: E402
from router.extproc.server import ExtProcServer, TlsFiles  # noqa: E402

ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"]
REF_PICKER = [sys.executable, "-m", "router.bench.extproc_ref"]
KIT = [sys.executable, "-m", "conformance.extproc"]


@pytest.fixture
async def picker() -> AsyncIterator[tuple[ExtProcServer, Any]]:
    svc = extproc_standin.DecisionService(list(ENDPOINTS))
    server = ExtProcServer(svc, "127.0.0.1", 0)
    await server.start()
    try:
        yield server, svc
    finally:
        await server.stop(0)


async def test_every_conformance_case_passes_against_kvroute(picker: Any) -> None:
    server, svc = picker
    cases = await run_kit(f"127.0.0.1:{server.port}", ENDPOINTS)
    assert [c["name"] for c in cases] == list(CASES)
    failed = [c for c in cases if c["status"] != "pass"]
    assert not failed, failed
    assert svc.inflight() == 0  # every stream's load was released, aborted ones included


async def test_accounting_follows_the_response(picker: Any) -> None:
    server, svc = picker
    await run_kit(f"127.0.0.1:{server.port}", ENDPOINTS, only=["served-endpoint-readback"])
    (ticket,) = svc.tickets
    picked = ticket.events[0][1]
    served = svc.decisions[0][1][-1]  # the kit reports the last fallback as the served one
    assert [e[0] for e in ticket.events] == ["start", "reassign", "first_token", "finish"]
    assert ticket.events[1] == ("reassign", served) and picked != served
    assert ticket.events[-1] == ("finish", (200, None))
    # the gateway went past the first choice: it could not send there
    assert picked in svc.passed_over_told and served not in svc.passed_over_told


async def test_health_follows_readiness(picker: Any) -> None:
    server, svc = picker
    svc.ready = False
    await server._publish_health()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status(name: str) -> int:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            return int(resp.status)

        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        assert await status("") == serving and await status("liveness") == serving
        assert await status("readiness") == not_serving
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == not_serving


def test_the_kit_fails_a_picker_that_breaks_the_protocol(tmp_path: Path) -> None:
    """The bench's reference picker only picks at random: no /v1/models, no subset hint, no
    OpenAI errors. The kit must say so, case by case, and exit 1."""
    port = free_port()
    ref = subprocess.Popen(
        [*REF_PICKER, "--port", str(port), "--endpoints", ",".join(ENDPOINTS)],
        stdout=subprocess.PIPE,
    )
    try:
        assert ref.stdout is not None
        ref.stdout.readline()
        report = tmp_path / "kit.json"
        argv = ["--picker", f"127.0.0.1:{port}", "--endpoints", ",".join(ENDPOINTS)]
        argv += ["--report", str(report), "--timeout", "2"]
        out = subprocess.run(
            [*KIT, *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        ref.terminate()
        ref.wait(5)
        if ref.stdout is not None:
            ref.stdout.close()
    assert out.returncode == 1, out.stdout + out.stderr
    status = {c["name"]: c["status"] for c in json.loads(report.read_text())["cases"]}
    for must_fail in ("health", "models-200", "subset-hint", "empty-subset-503"):
        assert status[must_fail] == "fail", (must_fail, out.stdout)
    assert status["buffered-completion"] == "pass"  # it does pick, in the right shape
    assert "FAIL  models-200" in out.stdout


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--no-proxy"], "--no-proxy"),
        (["--ext-proc-port", "9002", "--ext-proc-tls-cert", "c.pem"], "go together"),
        (["--ext-proc-tls-cert", "c", "--ext-proc-tls-key", "k"], "without --ext-proc-port"),
        (["--ext-proc-port", "9002", "--ext-proc-tls-ca", "ca.pem"], "--ext-proc-tls-ca"),
        (["--ext-proc-port", "70000"], "0..65535"),
    ],
)
def test_bad_flag_combinations_stop_start_up(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        server_from_args(_args(*argv), extproc_standin.DecisionService([]))


def test_flags_build_the_server() -> None:
    svc = extproc_standin.DecisionService([])
    assert server_from_args(_args(), svc) is None
    server = server_from_args(_args("--ext-proc-port", "9002"), svc)
    assert server is not None and (server.host, server.port, server.tls) == (
        "127.0.0.1",
        9002,
        None,
    )
    tls = server_from_args(
        _args("--ext-proc-port", "0", "--ext-proc-tls-cert", "c", "--ext-proc-tls-key", "k"), svc
    )
    assert tls is not None and tls.tls == TlsFiles(Path("c"), Path("k"), None)


def _pki(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl CLI)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=kvroute-test-ca")  # fmt: skip
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
            "-extfile", "san.cnf")  # fmt: skip
    return {
        n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


async def _health(port: int, creds: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        req = health_pb2.HealthCheckRequest(service="readiness")
        resp = await health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
        return int(resp.status)


async def test_mutual_tls_admits_only_clients_the_ca_signed(tmp_path: Path) -> None:
    f = _pki(tmp_path)
    tls = TlsFiles(f["server.pem"], f["server.key"], f["ca.pem"])
    server = ExtProcServer(extproc_standin.DecisionService(ENDPOINTS), "127.0.0.1", 0, tls=tls)
    await server.start()
    try:
        ca = f["ca.pem"].read_bytes()
        good = grpc.ssl_channel_credentials(
            ca, f["client.key"].read_bytes(), f["client.pem"].read_bytes()
        )
        assert await _health(server.port, good) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await _health(server.port, grpc.ssl_channel_credentials(ca))  # no client cert
    finally:
        await server.stop(0)


async def test_unreadable_tls_files_are_a_config_error(tmp_path: Path) -> None:
    tls = TlsFiles(tmp_path / "missing.pem", tmp_path / "missing.key")
    server = ExtProcServer(extproc_standin.DecisionService([]), "127.0.0.1", 0, tls=tls)
    with pytest.raises(ConfigError, match="missing"):
        await server.start()


async def test_every_conformance_case_passes_against_the_real_decision_service() -> None:
    """The kit against kvroute's own DecisionService over a simulated fleet."""
    from gateway_harness import FAST, real_service

    with FleetProcess(3, extra=FAST) as fleet:
        endpoints = [u.removeprefix("http://") for u in fleet.urls]
        async with real_service(endpoints) as svc:
            server = ExtProcServer(svc, "127.0.0.1", 0)
            await server.start()
            try:
                cases = await run_kit(f"127.0.0.1:{server.port}", endpoints)
            finally:
                await server.stop(0)
    failed = [c for c in cases if c["status"] != "pass"]
    assert not failed, failed
