"""The picker's own TLS (`--ext-proc-tls-self-signed`): what GIE's reference picker serves by
default, and what gateways set up for it expect (they connect with TLS and do not verify).
A real Envoy 1.40 dialling the picker so routes through it; a plaintext client is refused."""

from __future__ import annotations

import argparse
import ssl
from typing import Any

import extproc_standin
import grpc
import pytest
from gateway_harness import gateway
from grpc_health.v1 import health_pb2, health_pb2_grpc

extproc_standin.install()

from router.core.errors import ConfigError  # noqa: E402
from router.extproc.cli import add_arguments, server_from_args  # noqa: E402
from router.extproc.server import ExtProcServer, SelfSigned  # noqa: E402

pytestmark = pytest.mark.timeout(120)


async def readiness(port: int, creds: grpc.ChannelCredentials | None, **opts: Any) -> int:
    target = f"127.0.0.1:{port}"
    options = list(opts.items())
    channel = (
        grpc.aio.secure_channel(target, creds, options=options)
        if creds is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel as ch:
        req = health_pb2.HealthCheckRequest(service="")
        resp = await health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
        return int(resp.status)


async def test_a_self_signed_picker_serves_tls_only() -> None:
    server = ExtProcServer(extproc_standin.DecisionService([]), "127.0.0.1", 0, tls=SelfSigned())
    await server.start()
    try:
        pem = ssl.get_server_certificate(("127.0.0.1", server.port)).encode()
        creds = grpc.ssl_channel_credentials(root_certificates=pem)
        override = {"grpc.ssl_target_name_override": "kvroute-epp"}
        assert await readiness(server.port, creds, **override) == 1  # SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await readiness(server.port, None)  # plaintext
    finally:
        await server.stop(0)


def picker_over_tls(doc: dict[str, Any]) -> None:
    """Envoy dials the picker with TLS and no validation context: it verifies nothing, as
    gateways set up for GIE's self-signed picker do."""
    (picker,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "kvroute_picker"]
    picker["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "sni": "kvroute-epp",
        },
    }


@pytest.mark.slow
async def test_envoy_routes_through_a_self_signed_picker() -> None:
    async with gateway(picker_tls=SelfSigned(), tweak=picker_over_tls) as gw:
        for i in range(3):
            resp = await gw.complete(f"over tls {i} " * 20)
            assert resp.status_code == 200, resp.text[:300]
            assert resp.headers["x-kvroute-worker"] in gw.addresses
        assert len(gw.svc.decisions) == 3


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_self_signed_goes_alone_and_with_a_port() -> None:
    svc: Any = extproc_standin.DecisionService([])
    server = server_from_args(args("--ext-proc-port", "0", "--ext-proc-tls-self-signed"), svc)
    assert server is not None and isinstance(server.tls, SelfSigned)
    with pytest.raises(ConfigError, match="makes its own certificate"):
        server_from_args(
            args(
                "--ext-proc-port", "0", "--ext-proc-tls-self-signed",
                "--ext-proc-tls-cert", "c", "--ext-proc-tls-key", "k",
            ),
            svc,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="without --ext-proc-port"):
        server_from_args(args("--ext-proc-tls-self-signed"), svc)


@pytest.mark.slow
async def test_envoy_config_ext_proc_tls_dials_a_self_signed_picker() -> None:
    """`kvroute envoy-config --ext-proc-tls`, as deploy/envoy/standalone.yaml dials the
    gateway overlay's picker."""
    from router.envoy.bootstrap import Endpoint as EnvoyEndpoint
    from router.envoy.bootstrap import GatewayConfig, _picker_cluster

    made = _picker_cluster(
        GatewayConfig(8080, EnvoyEndpoint("127.0.0.1", 1), (), picker_tls=True),
        EnvoyEndpoint("127.0.0.1", 1),
    )

    def same_as_envoy_config(doc: dict[str, Any]) -> None:
        (picker,) = [
            c for c in doc["static_resources"]["clusters"] if c["name"] == "kvroute_picker"
        ]
        picker["transport_socket"] = made["transport_socket"]

    async with gateway(picker_tls=SelfSigned(), tweak=same_as_envoy_config) as gw:
        resp = await gw.complete("over tls " * 20)
        assert resp.status_code == 200, resp.text[:300]
        assert resp.headers["x-kvroute-worker"] in gw.addresses
