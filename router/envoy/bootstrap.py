"""An Envoy 1.40 bootstrap that puts kvroute's ext_proc picker in front of a vLLM fleet.

What it wires, and why:
- `override_host` load balancing on the worker cluster, reading the pick from the dynamic
  metadata `envoy.lb / x-gateway-destination-endpoint` (never from a request header, so a
  client cannot steer even if a header slipped through): only cluster members are reachable
  (no ORIGINAL_DST SSRF hole), the comma-separated fallbacks are tried in order on connect
  failures (the route's retries), and round robin serves when there is no pick.
- The client's routing headers are removed before ext_proc runs (header_mutation filter).
- failure mode open: `failure_mode_allow` plus a gRPC-health-checked picker cluster with a 0 %
  panic threshold, so that a dead or unready picker is skipped at once (round robin) instead
  of costing each request a timeout. It needs BUFFERED bodies: a FULL_DUPLEX_STREAMED body
  already sent to a dead picker cannot be recovered (DESIGN.md section 5).
- Response bodies go to the picker for load accounting (`response_body="read"`: first token,
  usage.cached_tokens), or not at all (`"skip"`: one gRPC round trip less per response
  chunk; the picker then takes the first token at the response headers and the end at the
  stream's close, which Envoy holds open until the response is done).
- Envoy's access log goes to the picker over gRPC, one entry per request at once: the
  ext_proc stream closes alike for a completed response, a client hang-up and a worker that
  broke off, and the log's response flags tell the picker which (router/extproc/endings.py).
- The served endpoint goes back to the picker as the response header
  `x-gateway-destination-endpoint-served` (%UPSTREAM_HOST%), which it reads for load
  accounting.
- Body-size limit = the connection buffer limit (Envoy answers 413 above it, in the same
  OpenAI-shaped JSON the picker answers it with in full duplex: `local_reply_config`); no
  overall route timeout (generations take minutes) but an idle timeout per stream.
- Workers that join later: a hostname worker (a headless Service) makes the cluster
  STRICT_DNS, re-resolved every 5 s; with `eds_path` the cluster reads its members from a
  file Envoy watches (rewrite it with `write_eds`, atomically) -- no restart either way.
  A name is resolved to its IPv4 addresses where it has any (`V4_PREFERRED`), as kvroute
  resolves it: the picker's `ip:port` must be a cluster member, and vLLM's default
  `--host 0.0.0.0` listens on IPv4 only.
- Circuit breakers far above any load (`IN_FLIGHT_CAP`) instead of Envoy's defaults (1,024
  requests and 3 retries in flight per cluster): every request in flight holds a picker
  stream for its whole life, and every one may be on its fallback at once. How much a
  worker takes is the picker's decision (it sheds with 429), not a breaker's.
- `stats_port`: a listener that serves Envoy's `/stats/prometheus` and nothing else of the
  admin (which stays on loopback: it can drain or stop Envoy), so Prometheus sees what the
  picker cannot report itself, e.g. requests that failed open past a dead picker.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from router.core.errors import (
    ConfigError,
    KvrouteError,
    NoWorkerAvailable,
    PayloadTooLarge,
    UpstreamTimeout,
)

WORKERS = "kvroute_workers"
PICKER = "kvroute_picker"
ADMIN = "envoy_admin"
STATS = "envoy_stats"
STATS_PATH = "/stats/prometheus"
DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# the client's own: the picker sets the destination and, for a data-parallel rank, its
# header; a client's rank header left in place would pick another rank than the decision
CLIENT_ROUTING_HEADERS = (
    DEST,
    "x-gateway-destination-endpoint-subset",
    SERVED,
    "x-data-parallel-rank",
)
# Set on every request before ext_proc, removed before the worker: this gateway sends its
# access log to the picker, so a request's end is worth waiting for even before Envoy has
# opened that log's stream (it does at its first entry)
ACCESS_LOG_MARK = "x-kvroute-access-log"
# the route's retries on connect failures: the picker lists one endpoint per attempt
FALLBACK_RETRIES = 3
# Each cluster's circuit breakers (requests, pending requests, connections, retries in flight).
# Envoy's defaults would cap the whole gateway: past 1,024 requests in flight the picker's
# streams overflow (503 failing closed, round robin without KV awareness failing open), and
# past 3 concurrent retries a dead first choice's requests get a 503, not their fallback. As
# high as the picker's own stream limit (router/extproc/server.py); file descriptors run out
# well before it.
IN_FLIGHT_CAP = 1 << 20
PICKER_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# A dual-stack name's IPv4 addresses, IPv6 only where it has no A record (Envoy's AUTO is the
# reverse): kvroute resolves workers alike (router/workers.py one_family), so the picker's
# ip:port is a member of the cluster; vLLM (by default) and the picker (deploy/k8s) listen
# on 0.0.0.0, IPv4 only
DNS_FAMILY = "V4_PREFERRED"
# Envoy's response code details for its own 413, a request body over the buffer limit
ENVOY_BODY_TOO_LARGE = "request_payload_too_large"
T = "type.googleapis.com/"
HCM = T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def address(self) -> dict[str, Any]:
        return {"socket_address": {"address": self.host, "port_value": self.port}}


def parse_worker(url: str) -> Endpoint:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"--worker {url!r}: give http://HOST:PORT (TLS to workers: not yet)")
    return Endpoint(parts.hostname, parts.port or 80)


def parse_hostport(value: str, flag: str) -> Endpoint:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{flag} {value!r}: give HOST:PORT")
    return Endpoint(host.strip("[]"), int(port))


@dataclass(frozen=True)
class GatewayConfig:
    listen_port: int
    ext_proc: Endpoint | None  # None: Envoy alone, round robin (the benchmark's baseline)
    workers: tuple[Endpoint, ...]
    body_mode: str = "buffered"  # buffered | full-duplex
    failure_mode: str = "close"  # open | close
    # read: response bodies go to the picker (first token, usage.cached_tokens), a gRPC round
    # trip per chunk; skip: only response headers (first token taken there, end = stream end)
    response_body: str = "read"
    admin_port: int | None = None
    listen_host: str = "0.0.0.0"
    max_body_bytes: int = 32 * 1024 * 1024
    message_timeout_s: float = 5.0
    stream_idle_timeout_s: int = 300
    picker_health_interval_s: float = 1.0
    fallback_retries: int = FALLBACK_RETRIES
    eds_path: Path | None = None
    # more picker replicas behind the same cluster (each request's stream goes to one)
    more_pickers: tuple[Endpoint, ...] = ()
    # a listener on listen_host:stats_port serving only the admin's /stats/prometheus
    stats_port: int | None = None
    # TLS to the picker without verifying it (a picker with --ext-proc-tls-self-signed)
    picker_tls: bool = False

    def validate(self) -> GatewayConfig:
        if self.body_mode not in ("buffered", "full-duplex"):
            raise ConfigError(f"--body-mode {self.body_mode!r}: buffered or full-duplex")
        if self.response_body not in ("read", "skip"):
            raise ConfigError(f"--response-body {self.response_body!r}: read or skip")
        if self.failure_mode not in ("open", "close"):
            raise ConfigError(f"--failure-mode {self.failure_mode!r}: open or close")
        if self.failure_mode == "open" and self.body_mode != "buffered":
            raise ConfigError(
                "--failure-mode open needs --body-mode buffered: with full-duplex bodies a "
                "request whose body went to a dead picker cannot fail open (DESIGN.md 5)"
            )
        if not self.workers and self.eds_path is None:
            raise ConfigError("give at least one --worker (or --eds-file)")
        if self.stats_port is not None and self.admin_port is None:
            raise ConfigError(
                "--stats-port serves the admin's /stats/prometheus: give --admin-port"
            )
        if self.stats_port is not None and self.stats_port in (self.listen_port, self.admin_port):
            raise ConfigError(f"--stats-port {self.stats_port}: already the listen or admin port")
        return self


def bootstrap(cfg: GatewayConfig) -> dict[str, Any]:
    cfg.validate()
    listeners, clusters = [_listener(cfg)], [_workers_cluster(cfg)]
    if cfg.ext_proc is not None:
        clusters.append(_picker_cluster(cfg, cfg.ext_proc))
    if cfg.stats_port is not None and cfg.admin_port is not None:
        listeners.append(_stats_listener(cfg.listen_host, cfg.stats_port))
        clusters.append(_admin_cluster(cfg.admin_port))
    doc: dict[str, Any] = {
        "node": {"id": "kvroute-gateway", "cluster": "kvroute"},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    if cfg.admin_port is not None:
        doc["admin"] = {"address": Endpoint("127.0.0.1", cfg.admin_port).address()}
    return doc


def render(cfg: GatewayConfig) -> str:
    return yaml.safe_dump(bootstrap(cfg), sort_keys=False)


def _listener(cfg: GatewayConfig) -> dict[str, Any]:
    hcm = {
        "@type": HCM,
        "stat_prefix": "kvroute",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{cfg.stream_idle_timeout_s}s",
        "request_timeout": "0s",
        "route_config": _routes(cfg),
        "local_reply_config": _local_replies(cfg),
        **({"access_log": [_picker_access_log()]} if cfg.ext_proc is not None else {}),
        "http_filters": [
            _strip_filter(),
            *([_ext_proc_filter(cfg)] if cfg.ext_proc is not None else []),
            _router_filter(),
        ],
    }
    at = Endpoint(cfg.listen_host, cfg.listen_port)
    return _http_listener("kvroute_gateway", at, hcm, cfg.max_body_bytes)


def _http_listener(
    name: str, at: Endpoint, hcm: dict[str, Any], buffer_limit: int | None = None
) -> dict[str, Any]:
    limit = {} if buffer_limit is None else {"per_connection_buffer_limit_bytes": buffer_limit}
    manager = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    return {
        "name": name,
        "address": at.address(),
        **limit,
        "filter_chains": [{"filters": [manager]}],
    }


def _stats_listener(host: str, port: int) -> dict[str, Any]:
    """GET /stats/prometheus, proxied to the admin; any other path or method is a 404, so
    the admin's /quitquitquit, /drain_listeners and /config_dump stay on loopback."""
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    route = {"match": {"path": STATS_PATH, "headers": get}, "route": {"cluster": ADMIN}}
    hcm = {
        "@type": HCM,
        "stat_prefix": STATS,
        "codec_type": "AUTO",
        "route_config": {
            "name": STATS,
            "virtual_hosts": [{"name": STATS, "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [_router_filter()],
    }
    return _http_listener(STATS, Endpoint(host, port), hcm)


def _admin_cluster(admin_port: int) -> dict[str, Any]:
    return {
        "name": ADMIN,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": load_assignment(ADMIN, (Endpoint("127.0.0.1", admin_port),)),
    }


def _routes(cfg: GatewayConfig) -> dict[str, Any]:
    route = {
        "cluster": WORKERS,
        "timeout": "0s",  # a long generation is not an error
        "idle_timeout": f"{cfg.stream_idle_timeout_s}s",  # a stalled one is
        "retry_policy": {
            # each retry takes the next endpoint of the picker's ordered fallback list
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": cfg.fallback_retries,
            "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        },
    }
    served = {
        "header": {"key": SERVED, "value": "%UPSTREAM_HOST%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    return {
        "name": "kvroute",
        "virtual_hosts": [
            {
                "name": "fleet",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": route}],
                "request_headers_to_remove": [ACCESS_LOG_MARK],
                "response_headers_to_add": [served],
            }
        ],
    }


# Envoy's own replies, by their response code details, answered in kvroute's error shape:
# (CEL condition, the error, whose status the reply takes). The picker's immediate
# responses are local replies too, with details of their own, so they keep their bodies; a
# worker's reply is not a local one.
def _envoys_errors(cfg: GatewayConfig) -> list[tuple[str, KvrouteError]]:
    d = "response.code_details"
    return [
        (
            f"{d} == '{ENVOY_BODY_TOO_LARGE}'",
            PayloadTooLarge(f"request body over {cfg.max_body_bytes} bytes"),
        ),
        (
            f"{d} == 'ext_proc_error_per-message_timeout_exceeded'",
            UpstreamTimeout(
                "the endpoint picker did not decide in time (the gateway's ext_proc "
                "message_timeout); see the picker's logs and kvroute_route_decision_seconds"
            ),
        ),
        (
            f"{d}.startsWith('ext_proc_error')",
            NoWorkerAvailable(
                "the endpoint picker could not be reached and the gateway fails closed; "
                "check the kvroute picker is running and reachable from the gateway"
            ),
        ),
        (
            f"{d}.startsWith('upstream_reset_before_response_started') "
            f"|| {d} == 'no_healthy_upstream'",
            NoWorkerAvailable(
                "no worker could take the request: the picked worker and its fallbacks "
                "refused or reset the connection"
            ),
        ),
    ]


def _local_replies(cfg: GatewayConfig) -> dict[str, Any]:
    """Envoy's own error replies answered as kvroute answers them: OpenAI-shaped JSON (the
    body the picker sends for an oversized body in full duplex, the proxy door's for a worker
    that cannot be reached), never an empty or plain-text body an SDK cannot read. Matched
    on Envoy's response code details, not on the status (`_envoys_errors`)."""
    mappers = []
    for condition, error in _envoys_errors(cfg):
        only = {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": condition,
            },
        }
        body = json.dumps(error.body())  # no "%" in these: Envoy substitutes nothing
        mappers.append(
            {
                "filter": {"extension_filter": only},
                "status_code": error.status,
                "body_format_override": {"text_format": body, "content_type": "application/json"},
            }
        )
    return {"mappers": mappers}


def _picker_access_log() -> dict[str, Any]:
    """Each request's access-log entry, sent to the picker at once: it is how the picker
    tells a client hang-up from a worker that broke off its response (and, response bodies
    skipped, from a completed one), which the ext_proc stream's close does not say."""
    common = {
        "log_name": "kvroute",
        "transport_api_version": "V3",
        "grpc_service": {"envoy_grpc": {"cluster_name": PICKER}},
        "buffer_size_bytes": 0,
    }
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": common,
        },
    }


def _strip_filter() -> dict[str, Any]:
    return {
        "name": "kvroute.strip_client_routing_headers",
        "typed_config": {
            "@type": T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {
                "request_mutations": [
                    *({"remove": h} for h in CLIENT_ROUTING_HEADERS),
                    {
                        "append": {
                            "header": {"key": ACCESS_LOG_MARK, "value": "1"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    },
                ]
            },
        },
    }


def _ext_proc_filter(cfg: GatewayConfig) -> dict[str, Any]:
    duplex = cfg.body_mode == "full-duplex"
    response_body = "FULL_DUPLEX_STREAMED" if duplex else "STREAMED"
    mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
        # response bodies are only read (first token, usage), never changed
        "response_body_mode": response_body if cfg.response_body == "read" else "NONE",
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        "response_trailer_mode": "SEND" if duplex else "SKIP",
    }
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER}},
            "failure_mode_allow": cfg.failure_mode == "open",
            "message_timeout": f"{cfg.message_timeout_s}s",
            "processing_mode": mode,
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            },
        },
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": T + "envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True,
        },
    }


def _override_host_policy() -> dict[str, Any]:
    round_robin = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {
                "@type": T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
            },
        }
    }
    override = {
        "@type": T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"metadata": {"key": "envoy.lb", "path": [{"key": DEST}]}}],
        "fallback_policy": {"policies": [round_robin]},
    }
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": override,
                }
            }
        ]
    }


def _workers_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": WORKERS,
        "connect_timeout": "2s",
        "per_connection_buffer_limit_bytes": cfg.max_body_bytes,
        "circuit_breakers": _circuit_breakers(retries=True),
        "load_balancing_policy": _override_host_policy(),
    }
    if cfg.eds_path is not None:
        folder = str(cfg.eds_path.resolve().parent)
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {
            "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": str(cfg.eds_path.resolve()),
                    "watched_directory": {"path": folder},
                },
            }
        }
        return cluster
    dns = not all(w.is_ip for w in cfg.workers)
    cluster["type"] = "STRICT_DNS" if dns else "STATIC"
    if dns:
        cluster["dns_refresh_rate"] = "5s"
        cluster["respect_dns_ttl"] = False
        cluster["dns_lookup_family"] = DNS_FAMILY
    cluster["load_assignment"] = load_assignment(WORKERS, cfg.workers)
    return cluster


def _circuit_breakers(*, retries: bool) -> dict[str, Any]:
    """Limits no gateway reaches (`IN_FLIGHT_CAP`); `retries` for a cluster the route
    retries on: every request in flight may be on its fallback at the same time."""
    limits = {
        "max_connections": IN_FLIGHT_CAP,
        "max_pending_requests": IN_FLIGHT_CAP,
        "max_requests": IN_FLIGHT_CAP,
        **({"max_retries": IN_FLIGHT_CAP} if retries else {}),
    }
    return {"thresholds": [{"priority": "DEFAULT", **limits}]}


def load_assignment(name: str, endpoints: tuple[Endpoint, ...]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": e.address()}} for e in endpoints]}
        ],
    }


def _picker_cluster(cfg: GatewayConfig, picker: Endpoint) -> dict[str, Any]:
    members = (picker, *cfg.more_pickers)
    dns = not all(p.is_ip for p in members)
    cluster: dict[str, Any] = {
        "name": PICKER,
        "type": "STRICT_DNS" if dns else "STATIC",
        **({"dns_lookup_family": DNS_FAMILY} if dns else {}),
        "connect_timeout": "1s",
        # each HTTP request in flight holds one stream to the picker until its response ends
        "circuit_breakers": _circuit_breakers(retries=False),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": load_assignment(PICKER, members),
    }
    if cfg.picker_tls:
        # no validation context: encrypted, not verified, as gateways dial GIE's self-signed
        # picker; the name the self-signed certificate carries as SNI
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": "kvroute-epp",
            },
        }
    if cfg.failure_mode == "open":
        cluster.update(_picker_health(cfg))
    return cluster


def _picker_health(cfg: GatewayConfig) -> dict[str, Any]:
    """Fail-open only: a picker that fails its readiness twice is skipped at once (round
    robin) instead of costing each request a message timeout. With fail-close a health
    check would only turn one slow answer into rejected traffic, so there is none."""
    interval = f"{cfg.picker_health_interval_s}s"
    return {
        # 0 %: an unhealthy picker is not tried at all ("panic" routing would still try it)
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [
            {
                "timeout": "1s",
                "interval": interval,
                "no_traffic_interval": interval,
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": PICKER_HEALTH_SERVICE},
            }
        ],
    }


def eds_document(endpoints: tuple[Endpoint, ...]) -> dict[str, Any]:
    """The file-based EDS answer Envoy reads for the worker cluster (with eds_path)."""
    assignment = {
        "@type": T + "envoy.config.endpoint.v3.ClusterLoadAssignment",
        **load_assignment(WORKERS, endpoints),
    }
    return {"version_info": str(len(endpoints)), "resources": [assignment]}


def write_eds(path: Path, endpoints: tuple[Endpoint, ...]) -> None:
    """Replace the worker list Envoy watches: write aside, then rename into place (Envoy
    reacts to the move; a file edited in place could be read half-written)."""
    path = path.resolve()
    fd, tmp = tempfile.mkstemp(prefix=".eds-", suffix=".yaml", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(eds_document(endpoints), f, sort_keys=False)
    os.replace(tmp, path)
