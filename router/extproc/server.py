"""The ext_proc gRPC server: Envoy's ExternalProcessor service plus gRPC health, on one port,
inside `kvroute serve`'s process (same index, same load, same decision service as the proxy).

    server = ExtProcServer(svc, "0.0.0.0", 9002, tls=TlsFiles(cert, key, ca))
    await server.start()      # binds; server.port is the real port (0 picks a free one)
    ...
    await server.stop()

Health answers for "" and "liveness" (the process can decide at all: svc.live) and for
"readiness" and the ExternalProcessor service name (a worker can take traffic: svc.ready);
Envoy health-checks the latter so that failure-mode open skips a picker that is not ready.

The same port takes Envoy's gRPC access log (AccessLogService), optional: with it the picker
tells a client hang-up from a worker that broke off its response and, response bodies
skipped, from a completed response (router/extproc/endings.py). Envoy side, on the HTTP
connection manager:

    access_log:
    - name: envoy.access_loggers.http_grpc
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
        common_config:
          log_name: kvroute
          transport_api_version: V3
          grpc_service: {envoy_grpc: {cluster_name: kvroute_picker}}
          buffer_size_bytes: 0
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from router.core.errors import ConfigError
from router.extproc import gie
from router.extproc.cli import DEFAULT_MAX_BODY
from router.extproc.endings import Endings, log_entries
from router.extproc.exchange import Exchange
from router.routing import DecisionService

log = logging.getLogger("kvroute.extproc")

LIVENESS = ("", "liveness")
READINESS = ("readiness", gie.SERVICE_NAME)
HEALTH_POLL_S = 0.5
# Every in-flight HTTP request holds one ext_proc stream until its response ends (minutes for
# a long generation): the per-connection stream limit must not queue new requests behind them.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", 1 << 20),
]
# A BUFFERED body comes in one message, and a FULL_DUPLEX_STREAMED one may go back in one:
# gRPC's default 4 MiB cap would fail (or, failing open, skip the decision for) any body
# between it and the body limit. Room beyond the limit for the message's headers and framing.
MESSAGE_HEADROOM = 1 << 20


GRPC_MAX_MESSAGE = (1 << 31) - 1  # gRPC takes a C int


def server_options(max_body_bytes: int) -> list[tuple[str, int]]:
    cap = min(max_body_bytes + MESSAGE_HEADROOM, GRPC_MAX_MESSAGE)
    return [
        *SERVER_OPTIONS,
        ("grpc.max_receive_message_length", cap),
        ("grpc.max_send_message_length", cap),
    ]


@dataclass(frozen=True)
class TlsFiles:
    """Server certificate and key (PEM); with `ca`, clients must present a certificate
    signed by it (mutual TLS, as gateways run ext_proc)."""

    cert: Path
    key: Path
    ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        try:
            pair = (self.key.read_bytes(), self.cert.read_bytes())
            ca = self.ca.read_bytes() if self.ca is not None else None
        except OSError as exc:
            raise ConfigError(
                f"--ext-proc-tls-*: cannot read {exc.filename}: {exc.strerror}"
            ) from None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=bool(ca)
        )


@dataclass(frozen=True)
class SelfSigned:
    """TLS with a certificate made at start, for gateways that connect to their endpoint
    picker with TLS and do not verify it: the GIE reference picker's default, which Istio's,
    NGINX Gateway Fabric's and others' settings expect. Encrypted, not authenticated: give
    a certificate (`TlsFiles`) where the gateway verifies one."""

    names: tuple[str, ...] = ("kvroute-epp", "localhost")
    days: int = 3650

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = self_signed_pem(self.names, self.days)
        return grpc.ssl_server_credentials([(key, cert)])


def self_signed_pem(names: tuple[str, ...], days: int) -> tuple[bytes, bytes]:
    """A private key and a certificate for `names` (PEM), signed by that key."""
    import datetime

    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise ConfigError(
            f"--ext-proc-tls-self-signed needs cryptography, not installed ({exc}): "
            "pip install 'kvroute[grpc]'"
        ) from None
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a gateway's clock a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


class _Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, svc: DecisionService, max_body_bytes: int, endings: Endings) -> None:
        self.svc = svc
        self.max_body_bytes = max_body_bytes
        self.endings = endings

    async def Process(
        self, requests: AsyncIterator[gie.ProcessingRequest], context: Any
    ) -> AsyncIterator[gie.ProcessingResponse]:
        exchange = Exchange(self.svc, self.max_body_bytes, self.endings)
        try:
            async for req in requests:
                for resp in await exchange.handle(req):
                    yield resp
        finally:
            exchange.close()


class _AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access-log stream: each entry's ending goes to the exchange it names."""

    def __init__(self, endings: Endings) -> None:
        self.endings = endings

    async def StreamAccessLogs(self, messages: AsyncIterator[Any], context: Any) -> Any:
        self.endings.opened()
        try:
            async for message in messages:
                for rid, ending in log_entries(message):
                    try:
                        self.endings.tell(rid, ending)
                    except Exception:  # one bad conclusion must not stop the log
                        log.exception("ext_proc: concluding request %s failed", rid)
        finally:
            self.endings.closed()
        return als_pb2.StreamAccessLogsResponse()


class ExtProcServer:
    """Owns the gRPC server and the task that mirrors svc.live / svc.ready into health."""

    def __init__(
        self,
        svc: DecisionService,
        host: str = "0.0.0.0",
        port: int = 9002,
        *,
        tls: TlsFiles | SelfSigned | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY,
    ) -> None:
        self.svc = svc
        self.max_body_bytes = max_body_bytes
        self.host = host
        self.port = port
        self.tls = tls
        self.endings = Endings()
        self.health = health_aio.HealthServicer()
        self._published: dict[str, int] = {}
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        server = grpc.aio.server(options=server_options(self.max_body_bytes))
        pb_grpc.add_ExternalProcessorServicer_to_server(
            _Processor(self.svc, self.max_body_bytes, self.endings), server
        )
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(_AccessLog(self.endings), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        address = f"{host}:{self.port}"
        try:
            if self.tls is not None:
                bound = server.add_secure_port(address, self.tls.credentials())
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:  # grpc raises where older versions answered 0 (it logs why)
            bound = 0
        if not bound:
            raise ConfigError(
                f"--ext-proc-port: cannot listen on {address} (in use, or not an address of "
                "this host: see --ext-proc-host)"
            )
        self.port = bound
        await self._publish_health()
        await server.start()
        self._server = server
        self._health_task = asyncio.create_task(self._health_loop(), name="extproc-health")
        log.info("ext_proc picker on %s:%d%s", self.host, bound, " (TLS)" if self.tls else "")

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._server is not None:
            await self.health.enter_graceful_shutdown()
            await self._server.stop(grace_s)
            self._server = None
        self.endings.close()  # requests still waiting for their verdict: the guess

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self._publish_health()
            except Exception:  # the loop must outlive a bad moment of the service
                log.exception("ext_proc health update failed")

    async def _publish_health(self) -> None:
        for names, ok in ((LIVENESS, self.svc.live), (READINESS, self.svc.ready)):
            status = health_pb2.HealthCheckResponse.SERVING if ok else _NOT_SERVING
            for name in names:
                if self._published.get(name) != status:
                    self._published[name] = status
                    await self.health.set(name, status)


_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
