"""`kvroute serve`: the drop-in KV-aware reverse proxy."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from router.core.config import (
    CONTENT_FORMATS,
    ENV_PREFIX,
    MODES,
    POLICIES,
    REMOTE,
    Config,
    env_notes,
    env_read,
    env_var,
    from_env,
    from_mapping,
    shown,
)
from router.core.errors import ConfigError

log = logging.getLogger("kvroute.serve")

_EPILOG = """Configuration comes from --config (YAML), then KVROUTE_* environment variables,
then flags; flags win. Every worker's KV event endpoints are discovered from its
GET /kv_event_sources unless given in the YAML (workers: [{url, events, replay, topic,
mode, block_size, api_key, role}]).

Several models: each worker's served names (base model and LoRA adapters, from its
/v1/models) form the model's pool; a request only goes to workers serving its `model`, and
an unknown model is a 404 listing the served ones. Give each model its tokenizer with
--tokenizer MODEL=PATH (a LoRA adapter uses its base model's). Workers that load adapters
on demand (vLLM's LoRA resolver): --lora-resolver BASE_MODEL.

examples:
  kvroute serve --worker http://10.0.0.5:8000 --worker http://10.0.0.6:8000 \\
      --tokenizer /models/llama-3-8b
  kvroute serve --config kvroute.yaml --port 8080
  kvroute serve --worker http://vllm-0:8000 --tokenizer remote --mode approx
  kvroute serve --worker http://a:8000 --worker http://b:8000 \\
      --tokenizer llama-3-8b=/models/llama-3-8b --tokenizer qwen-7b=remote
  kvroute serve --workers-dns vllm-workers.default.svc:8000 --worker-api-key "$VLLM_API_KEY"

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, the rest of vLLM's API passed
through by model; /health (503 names each broken worker and the fix), /ready, /live,
/metrics; with --admin-token: /admin/workers (+ /admin/workers/NAME/drain|undrain) and
/debug/route (see `kvroute explain`).
"""

# (flag, config field, type, help) for the operational knobs; their defaults are Config's
_TUNING: tuple[tuple[str, str, type, str], ...] = (
    ("--request-timeout", "request_timeout_s", float, "a non-streaming answer, whole"),
    ("--first-byte-timeout", "first_byte_timeout_s", float, "a stream's first chunk"),
    ("--inter-chunk-timeout", "inter_chunk_timeout_s", float, "between a stream's chunks"),
    ("--connect-timeout", "connect_timeout_s", float, "connecting to a worker"),
    ("--warm-connections", "warm_connections", int, "idle connections kept per worker"),
    ("--health-timeout", "health_timeout_s", float, "a worker's /health probe"),
    ("--eject-after-timeouts", "eject_after_timeouts", int, "timeouts in a row that eject"),
    ("--timeout-hold", "timeout_hold_s", float, "held out at a 2nd timeout ejection in a row"),
    ("--header-timeout", "header_timeout_s", float, "a client's request head"),
    ("--keep-alive-timeout", "keep_alive_timeout_s", float, "an idle client connection"),
    ("--body-timeout", "body_timeout_s", float, "a client's whole request body"),
    ("--drain-delay", "drain_delay_s", float, "SIGTERM: serve on, not ready, this long"),
    ("--drain-timeout", "drain_timeout_s", float, "SIGTERM: then in-flight requests finish"),
    ("--max-body-bytes", "max_body_bytes", int, "413 above this request size"),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the KV-aware OpenAI-compatible reverse proxy",
        description="Route each request to the vLLM worker that already holds its prompt "
        "prefix in KV cache, unless that worker is overloaded.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _fleet_args(p)
    _routing_args(p)
    _overload_args(p)
    _replica_args(p)
    _pd_args(p)
    _operator_args(p)
    from router.extproc.cli import add_arguments as ext_proc_arguments

    ext_proc_arguments(p)
    t = p.add_argument_group("timeouts and limits")
    for flag, field_name, kind, what in _TUNING:
        default = getattr(Config(), field_name)
        metavar = "SECONDS" if kind is float else "N"
        t.add_argument(
            flag, dest=field_name, type=kind, metavar=metavar, help=f"{what} (default {default})"
        )
    p.set_defaults(func=run)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="kvroute.yaml")
    p.add_argument("--worker", action="append", metavar="URL", help="a vLLM worker, repeatable")
    p.add_argument(
        "--prefill-worker",
        action="append",
        metavar="URL",
        help="a prefill worker (vLLM with NixlConnector, kv_producer), repeatable",
    )
    p.add_argument(
        "--decode-worker",
        action="append",
        metavar="URL",
        help="a decode worker (NixlConnector, kv_consumer), repeatable",
    )
    p.add_argument("--workers-file", help="YAML list of workers, reloaded when it changes")
    p.add_argument(
        "--workers-dns",
        metavar="HOST:PORT",
        help="a headless Service: every A record is a worker (AAAA where it answers none), "
        "re-resolved every few seconds",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="[MODEL=]PATH|remote",
        help="folder with the model's tokenizer.json + tokenizer_config.json (fast), or "
        "'remote' to ask the workers' /tokenize (default: remote); MODEL=... sets one "
        "model's tokenizer (repeatable)",
    )
    p.add_argument(
        "--chat-template",
        action="append",
        metavar="[MODEL=]FILE|TEMPLATE",
        help="the engines' --chat-template, when they run with one: the file (mounted here "
        "too) or the template itself; chats are then rendered with it, not the tokenizer "
        "folder's (MODEL=... for one model, repeatable; with --tokenizer remote the workers "
        "render, and this is not needed)",
    )
    p.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        help="the engines' --chat-template-content-format (default auto: read from the "
        "template, as vLLM does)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        default=None,
        help="the engines run with --trust-request-chat-template: render a request's own "
        "chat_template as they do (otherwise the model's template is used for routing)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        default=None,
        help="the engines run with --exclude-tools-when-tool-choice-none: a chat whose "
        'tool_choice is "none" is rendered without its tools, as they render it',
    )
    p.add_argument(
        "--lora-resolver",
        metavar="BASE_MODEL",
        help="the workers load LoRA adapters at their first request (vLLM with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and a resolver plugin, e.g. "
        "VLLM_LORA_RESOLVER_CACHE_DIR for lora_filesystem_resolver): route a model name no "
        "worker lists as an adapter of BASE_MODEL (its tokenizer, any worker serving it, "
        "so every such worker must be able to load every adapter; metrics count them under "
        "BASE_MODEL); without this such a name is a 404 listing the served models",
    )
    p.add_argument(
        "--worker-api-key",
        help="the workers' --api-key, sent on the router's own calls to them (/tokenize, "
        "/metrics, /v1/models, health); never logged (env KVROUTE_WORKER_API_KEY)",
    )


def _routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=MODES,
        help="events (exact, from KV events), approx "
        "(remember routing decisions for a TTL), auto (events when they flow; default)",
    )
    p.add_argument("--policy", choices=POLICIES, help="kv (default) or a baseline to compare with")
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per KV block, if not learned from the workers' events or metrics",
    )
    p.add_argument("--seed", type=int, help="seed for the random policy and softmax sampling")


def _overload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "overload: busy thresholds and shedding (default: only the engines' learned "
        "batch limits; README: Overload)",
        "A worker at a bound is busy: it gets no new request while another worker can\n"
        "take it, even when it holds the prompt's prefix. When every worker is busy the\n"
        "request still goes to the best of them, unless --shed refuses it. YAML:\n"
        "busy_max_requests, busy_max_kv_usage, busy_learn_batch, shed.",
    )
    g.add_argument(
        "--busy-max-requests",
        type=int,
        metavar="N",
        help="busy at N running+waiting requests (this router's and, from its /metrics, "
        "everyone's); e.g. the engine's --max-num-seqs",
    )
    g.add_argument(
        "--busy-max-kv-usage",
        type=float,
        metavar="F",
        help="busy at this fraction of its KV cache in use, 0..1 (vllm:kv_cache_usage_perc), "
        "e.g. 0.95",
    )
    g.add_argument(
        "--busy-learn-batch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="busy at the engine's batch limit (vLLM's --max-num-seqs, which its /metrics do "
        "not export), learned where a worker's requests wait with KV room and little prefill "
        "ahead of them; logged, and in kvroute_worker_batch_limit (default: on)",
    )
    g.add_argument(
        "--shed",
        action="store_true",
        default=None,
        help="when every worker is busy, answer 429 (OpenAI rate_limit_error, Retry-After: 1) "
        "instead of queueing on a busy worker; counted in kvroute_requests_shed_total",
    )


def _replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "replicas: share placements (README: Several replicas)",
        "Replicas behind one load balancer each see every worker's KV events, but a new\n"
        "prefix reaching two of them within a prefill is placed by each on its own view.\n"
        "Each replica publishes the requests it sends; what a peer sent becomes a short\n"
        "prediction here. Give every replica the same workers. YAML: peer_publish, peers,\n"
        "peers_dns; env KVROUTE_PEER_PUBLISH, KVROUTE_PEERS (comma-separated), KVROUTE_PEERS_DNS.",
    )
    g.add_argument(
        "--peer-publish",
        metavar="tcp://HOST:PORT",
        help="publish this replica's placements here (ZMQ PUB), e.g. tcp://0.0.0.0:5570",
    )
    g.add_argument(
        "--peer",
        dest="peers",
        action="append",
        metavar="tcp://HOST:PORT",
        help="another replica's --peer-publish endpoint to subscribe to; repeatable",
    )
    g.add_argument(
        "--peers-dns",
        metavar="HOST:PORT",
        help="subscribe to every replica behind this headless Service (their --peer-publish "
        "port), re-resolved every dns_interval_s (5 s); this pod's own address ($POD_IP) is "
        "skipped",
    )
    g.add_argument(
        "--peer-wait-ms",
        type=float,
        metavar="MS",
        help="a replica other than the first (lowest id) waits this long before placing a "
        "new prefix, then looks again, so two replicas placing new prefixes at one instant "
        "see each other's choice (5; costs that much TTFT on such requests there; 0: off)",
    )


def _pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "prefill->decode handoff (on when some worker has role prefill; README: P/D)"
    )
    g.add_argument(
        "--pd-threshold",
        metavar="auto|never|TOKENS",
        help="split a request when the cost model says a remote prefill plus the KV transfer "
        "beats prefilling on the decode worker (auto, the default), never, or when at least "
        "TOKENS of its prompt are not cached on the decode worker",
    )
    g.add_argument(
        "--pd-link-mb-s",
        type=float,
        metavar="MB_S",
        help="the prefill->decode link in MB/s until measured (auto splits nothing until the "
        "link is known: from this, or from the probe handoff at start)",
    )
    g.add_argument(
        "--pd-kv-bytes-per-token",
        type=int,
        metavar="BYTES",
        help="KV bytes per token of the model (default: learned from the decode workers' "
        "vllm:nixl_bytes_transferred per pulled token)",
    )
    g.add_argument(
        "--pd-probe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the link with a probe handoff at start (default on)",
    )
    g.add_argument(
        "--pd-max-prefill-inflight",
        type=int,
        metavar="N",
        help="prefill legs in flight at which a prefill worker counts as saturated (default 8)",
    )
    g.add_argument(
        "--pd-fault-strip-params",
        action="store_true",
        default=None,
        help="TEST FAULT, never in production: send decode legs without kv_transfer_params, "
        "so the decode worker silently recomputes (router-check and /health must catch it)",
    )


def _operator_args(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("serving and operations")
    o.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    o.add_argument("--port", type=int, help="port to listen on (default 8000)")
    o.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="router processes on the one port (default 1): one process's event loop is "
        "about one core of requests; N processes share placements and load (and with "
        "--peer-publish, the first publishes for all), /metrics sums them, admin calls reach "
        "all; each holds its own index (memory x N). Env KVROUTE_PROCESSES",
    )
    o.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    o.add_argument("--tls-key", help="... and this private key (PEM)")
    o.add_argument(
        "--admin-token", help="bearer token for /admin and /debug (env KVROUTE_ADMIN_TOKEN)"
    )
    o.add_argument(
        "--admin-insecure",
        action="store_true",
        default=None,
        help="serve /admin and /debug without a token (without either they answer 404)",
    )
    o.add_argument(
        "--health-details",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="/health names workers, problems and fixes (default on; off: counts only)",
    )
    o.add_argument(
        "--health-degraded-ok",
        action="store_true",
        default=None,
        help="answer /health 200 while a worker is served in approximate mode",
    )
    o.add_argument(
        "--metrics", action=argparse.BooleanOptionalAction, default=None, help="serve /metrics"
    )
    o.add_argument(
        "--worker-header",
        help="response header naming the chosen worker (default x-kvroute-worker; '' for none)",
    )
    o.add_argument(
        "--forwarded-headers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add X-Forwarded-For/-Proto/-Host to forwarded requests (default on)",
    )
    o.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="one line per request: model, worker, overlap, status, TTFT",
    )
    o.add_argument("--log-format", choices=("text", "json"), help="log line format (text)")
    o.add_argument(
        "--otel",
        action="store_true",
        default=None,
        help="an OpenTelemetry span per routing decision, exported by OTLP as the "
        "OTEL_EXPORTER_OTLP_* variables say (pip install 'kvroute[otel]')",
    )
    o.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR")


_PLAIN = [
    "host",
    "port",
    "mode",
    "policy",
    "block_size",
    "metrics",
    "admin_token",
    "admin_insecure",
    "health_details",
    "health_degraded_ok",
    "worker_header",
    "seed",
    "processes",
    "peer_publish",
    "peers",
    "peers_dns",
    "peer_wait_ms",
    "busy_max_requests",
    "busy_max_kv_usage",
    "busy_learn_batch",
    "shed",
    "workers_file",
    "workers_dns",
    "worker_api_key",
    "tls_cert",
    "tls_key",
    "forwarded_headers",
    "access_log",
    "log_format",
    "otel",
    "pd_threshold",
    "pd_link_mb_s",
    "pd_kv_bytes_per_token",
    "pd_probe",
    "pd_max_prefill_inflight",
    "pd_fault_strip_params",
    "chat_template_content_format",
    "trust_request_chat_template",
    "exclude_tools_when_tool_choice_none",
    "lora_resolver",
]


def load_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    base = Config()
    if args.config is not None:
        base = from_mapping(_read_yaml(args.config), base)
    base = from_env(base, environ)
    flags: dict[str, Any] = {}
    roles = {
        "both": args.worker,
        "prefill": getattr(args, "prefill_worker", None),
        "decode": getattr(args, "decode_worker", None),
    }
    if any(roles.values()):
        flags["workers"] = [
            {"url": url, "role": role} for role, urls in roles.items() for url in urls or ()
        ]
    if getattr(args, "tokenizer", None):
        default, per_model = split_model_flags(args.tokenizer)
        if default is not None:
            flags["tokenizer"] = default
        if per_model:
            flags["tokenizers"] = {**base.tokenizers, **per_model}
    if getattr(args, "chat_template", None):
        default, per_model = split_model_flags(args.chat_template)
        if default is not None:
            flags["chat_template"] = default
        if per_model:
            flags["chat_templates"] = {**base.chat_templates, **per_model}
    for name in [*_PLAIN, *(t[1] for t in _TUNING)]:
        value = getattr(args, name, None)
        if value is not None:
            flags[name] = value
    merged = from_mapping(flags, base)
    try:
        return merged.validate()
    except ConfigError as err:
        # a value from the environment is fixed there, not in the YAML file the message
        # would send the operator to
        env = os.environ if environ is None else environ
        var = env_var(err)
        field = var.removeprefix(ENV_PREFIX).lower()
        if field and field not in flags and var in env and env_read(var, env[var]):
            raise ConfigError(f"{shown(var, env[var])}: {err.message}", param=err.param) from None
        raise


def split_model_flags(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """`--tokenizer PATH|remote` (the default) and `--tokenizer MODEL=PATH|remote`; the same
    for `--chat-template`, whose value may be a template itself (it holds `{`, and never as
    the first character of a model's name)."""
    default: str | None = None
    per_model: dict[str, str] = {}
    for v in values:
        model, sep, spec = v.partition("=")
        if sep and model and spec and not os.path.exists(v) and not any(c in model for c in "{}\n"):
            per_model[model] = spec
        else:
            default = v
    return default, per_model


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping")
    return doc


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
        from router.logsetup import use_format

        use_format(config.log_format)  # a config file's log_format: logging began before it
        _check_tls(config)
        if config.tokenizer is None:
            config = from_mapping({"tokenizer": REMOTE}, config)
            if not config.tokenizers:
                log.warning(
                    "no --tokenizer given: asking the workers' /tokenize (slower); pass the "
                    "model's tokenizer folder for local tokenization"
                )
        from router.app import RouterApp
        from router.extproc.cli import server_from_args
        from router.processes import role_from_env

        role = role_from_env()
        if config.processes > 1 and role is None:
            if args.ext_proc_port is not None:
                raise ConfigError(
                    "--processes N serves HTTP only: run the Envoy picker (--ext-proc-port) "
                    "with one process per replica"
                )
            return _supervise(args, config)
        if getattr(args, "no_proxy", False):  # the gateway connects to the workers
            config = dataclasses.replace(config, warm_connections=0)
        app = RouterApp(config, role=role)
        picker = server_from_args(
            args, app.routing, max_body_bytes=config.max_body_bytes, default_host=config.host
        )
    except ConfigError as err:
        print(f"kvroute serve: {err.message}", file=sys.stderr)
        return 2
    sockets = None
    if role is None:
        from router.processes import bind_port

        # bound before the start-up line: uvicorn, failing to bind, logged its error after
        # "serving" and then hung, deaf to SIGTERM
        bound = bind_port(config.host, config.port)
        if isinstance(bound, str):
            print(f"kvroute serve: {bound}", file=sys.stderr)
            return 2
        sockets = [bound]
        _announce(config)
    if picker is not None:
        app.doors.append(picker)
        log.warning("Envoy ext_proc picker on %s:%d (gRPC)", picker.host, picker.port)
    from router.app import ProbesOnly
    from router.server import serve, server_config

    asgi: Any = ProbesOnly(app) if getattr(args, "no_proxy", False) else app

    uv = server_config(
        asgi,
        config.host,
        config.port,
        header_timeout_s=config.header_timeout_s,
        keep_alive_timeout_s=config.keep_alive_timeout_s,
        drain_timeout_s=config.drain_timeout_s,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
    )
    if role is not None:
        from router.processes import listen_sockets

        sockets = listen_sockets(role, config.host, config.port)
    serve(uv, app.start_draining, config.drain_delay_s, sockets=sockets, child=role is not None)
    return 0


def _check_tls(config: Config) -> None:
    """Load the certificate pair now: uvicorn would fail on it after the start-up line, with
    a traceback that names neither file."""
    if config.tls_cert is None or config.tls_key is None:
        return
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            config.tls_cert, config.tls_key
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: cannot load them "
            f"({exc}); give a PEM certificate and its private key",
            param="tls_cert",
        ) from None


def _supervise(args: argparse.Namespace, config: Config) -> int:
    """`--processes N`: start N children with these same arguments (router/processes.py)."""
    from router.processes import Supervisor, check_port

    problem = check_port(config.host, config.port)
    if problem is not None:
        print(f"kvroute serve: {problem}", file=sys.stderr)
        return 2
    _announce(config)
    log.warning("%d router processes on port %d", config.processes, config.port)
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    supervisor = Supervisor(argv, config.processes, config.drain_delay_s + config.drain_timeout_s)
    return supervisor.run()


def _announce(config: Config) -> None:
    """The start-up line an operator greps for, and the warnings that matter."""
    from router.metrics import version

    for note in env_notes():
        log.warning("%s", note)

    fleet = [w.name for w in config.workers]
    if config.workers_file:
        fleet.append(f"file {config.workers_file}")
    if config.workers_dns:
        fleet.append(f"dns {config.workers_dns}")
    tokenizers = {"*": config.tokenizer, **config.tokenizers}
    scheme = "https" if config.tls_cert else "http"
    log.warning(
        "kvroute %s serving %s://%s:%d: workers %s, mode %s, policy %s, tokenizer %s",
        version(),
        scheme,
        config.host,
        config.port,
        ", ".join(fleet),
        config.mode,
        config.policy,
        tokenizers,
    )
    from router.server import raise_open_files

    # before any child starts (--processes): they inherit the raised limit
    if (short := raise_open_files()) is not None:
        log.warning("%s", short)
    if config.admin_token is None and not _loopback(config.host):
        if config.admin_insecure:
            log.warning(
                "admin and debug endpoints are open to anyone reaching %s:%d "
                "(--admin-insecure): set --admin-token instead",
                config.host,
                config.port,
            )
        else:
            log.warning(
                "listening on %s without --admin-token: /admin and /debug are off (404), so "
                "router-check and kvroute explain cannot read them; set --admin-token",
                config.host,
            )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
