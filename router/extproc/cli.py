"""`kvroute serve` flags for the ext_proc picker. serve_cli calls `add_arguments(parser)` when
it builds its parser and `server_from_args(args, svc)` once the decision service exists:

    --ext-proc-port P            also serve Envoy's ExternalProcessor (gRPC) on P
    --ext-proc-host H            its listen address (default: the proxy's --host)
    --no-proxy                   the picker alone: the HTTP port serves only the probes and metrics
    --ext-proc-tls-cert F --ext-proc-tls-key F [--ext-proc-tls-ca F]   TLS, mTLS with a CA
    --ext-proc-tls-self-signed   TLS with a certificate made at start (gateways that do not verify)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.core.errors import ConfigError

if TYPE_CHECKING:  # grpc is an extra (kvroute[grpc]): imported only when the picker runs
    from router.extproc.server import ExtProcServer
    from router.routing import DecisionService

DEFAULT_MAX_BODY = 32 * 1024 * 1024
GRPC_HINT = "pip install 'kvroute[grpc]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Envoy ext_proc endpoint picker")
    g.add_argument(
        "--ext-proc-port",
        type=int,
        metavar="P",
        help="also serve Envoy's ext_proc ExternalProcessor (GIE endpoint picker) on gRPC "
        "port P; `kvroute envoy-config` writes the matching Envoy bootstrap",
    )
    g.add_argument(
        "--ext-proc-host", metavar="H", help="listen address of the picker (default: --host)"
    )
    g.add_argument(
        "--no-proxy",
        action="store_true",
        help="run the picker alone: the HTTP port serves only /live, /ready, /health and "
        "/metrics (needs --ext-proc-port)",
    )
    g.add_argument("--ext-proc-tls-cert", type=Path, metavar="F", help="server certificate (PEM)")
    g.add_argument("--ext-proc-tls-key", type=Path, metavar="F", help="its private key (PEM)")
    g.add_argument(
        "--ext-proc-tls-ca",
        type=Path,
        metavar="F",
        help="CA (PEM) that client certificates must chain to: mutual TLS",
    )
    g.add_argument(
        "--ext-proc-tls-self-signed",
        action="store_true",
        help="serve TLS with a certificate made at start, as GIE's reference picker does by "
        "default: for gateways that connect with TLS and skip verification (Istio's "
        "DestinationRule insecureSkipVerify, NGINX Gateway Fabric's default). Encrypted, not "
        "authenticated; give --ext-proc-tls-cert/--ext-proc-tls-key where the gateway verifies",
    )


def tls_from_args(args: argparse.Namespace) -> Any:
    cert, key, ca = args.ext_proc_tls_cert, args.ext_proc_tls_key, args.ext_proc_tls_ca
    if getattr(args, "ext_proc_tls_self_signed", False):
        if cert is not None or key is not None or ca is not None:
            raise ConfigError(
                "--ext-proc-tls-self-signed makes its own certificate: drop --ext-proc-tls-cert, "
                "--ext-proc-tls-key and --ext-proc-tls-ca, or drop --ext-proc-tls-self-signed"
            )
        from router.extproc.server import SelfSigned

        return SelfSigned()
    if cert is None and key is None:
        if ca is not None:
            raise ConfigError("--ext-proc-tls-ca needs --ext-proc-tls-cert and --ext-proc-tls-key")
        return None
    if cert is None or key is None:
        raise ConfigError("--ext-proc-tls-cert and --ext-proc-tls-key go together")
    from router.extproc.server import TlsFiles

    return TlsFiles(cert, key, ca)


def server_from_args(
    args: argparse.Namespace,
    svc: DecisionService,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    default_host: str = "127.0.0.1",
) -> ExtProcServer | None:
    """The picker the flags ask for (None without --ext-proc-port); bad combinations stop
    start-up with a ConfigError naming the flag. `max_body_bytes`: the proxy's limit
    (config.max_body_bytes), enforced by the picker on FULL_DUPLEX_STREAMED bodies."""
    port = args.ext_proc_port
    if port is None:
        if args.no_proxy:
            raise ConfigError("--no-proxy runs the ext_proc picker alone: add --ext-proc-port")
        tls_flags = (args.ext_proc_tls_cert, args.ext_proc_tls_key, args.ext_proc_tls_ca)
        if any(f is not None for f in tls_flags) or getattr(
            args, "ext_proc_tls_self_signed", False
        ):
            raise ConfigError("--ext-proc-tls-* given without --ext-proc-port")
        return None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--ext-proc-port {port}: a TCP port is 0..65535")
    host = args.ext_proc_host or default_host
    try:
        from router.extproc.server import ExtProcServer
    except ImportError as exc:
        raise ConfigError(
            f"--ext-proc-port needs gRPC, which is not installed ({exc}): {GRPC_HINT}"
        ) from None
    return ExtProcServer(svc, host, port, tls=tls_from_args(args), max_body_bytes=max_body_bytes)
