"""`kvroute serve`: the drop-in KV-aware reverse proxy."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from router.core.config import MODES, POLICIES, REMOTE, Config, from_env, from_mapping
from router.core.errors import ConfigError

log = logging.getLogger("kvroute.serve")

_EPILOG = """Configuration comes from --config (YAML), then KVROUTE_* environment variables,
then flags; flags win. Every worker's KV event endpoints are discovered from its
GET /kv_event_sources unless given in the YAML (workers: [{url, events, replay, topic,
mode, block_size, api_key, role}]).

Several models: each worker's served names (base model and LoRA adapters, from its
/v1/models) form the model's pool; a request only goes to workers serving its `model`, and
an unknown model is a 404 listing the served ones. Give each model its tokenizer with
--tokenizer MODEL=PATH (a LoRA adapter uses its base model's).

examples:
  kvroute serve --worker http://10.0.0.5:8000 --worker http://10.0.0.6:8000 \\
      --tokenizer /models/llama-3-8b
  kvroute serve --config kvroute.yaml --port 8080
  kvroute serve --worker http://vllm-0:8000 --tokenizer remote --mode approx
  kvroute serve --worker http://a:8000 --worker http://b:8000 \\
      --tokenizer llama-3-8b=/models/llama-3-8b --tokenizer qwen-7b=remote
  kvroute serve --workers-dns vllm-workers.default.svc:8000 --worker-api-key "$VLLM_API_KEY"

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health (503 names each broken
worker and the fix), /ready, /metrics, /admin/workers, /debug/route (see `kvroute explain`).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the KV-aware OpenAI-compatible reverse proxy",
        description="Route each request to the vLLM worker that already holds its prompt "
        "prefix in KV cache, unless that worker is overloaded.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="kvroute.yaml")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--worker", action="append", metavar="URL", help="a vLLM worker, repeatable")
    p.add_argument("--workers-file", help="YAML list of workers, reloaded when it changes")
    p.add_argument(
        "--workers-dns",
        metavar="HOST:PORT",
        help="a headless Service: every A "
        "record is a worker, re-resolved every few seconds (Kubernetes)",
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
        "--worker-api-key",
        help="the workers' --api-key, sent on the router's own calls to them (/tokenize, "
        "/metrics, /v1/models, health); never logged (env KVROUTE_WORKER_API_KEY)",
    )
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
        help="tokens per KV block, if not learned from "
        "the workers' events or vllm:cache_config_info",
    )
    p.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve /metrics (default on)",
    )
    p.add_argument(
        "--admin-token", help="bearer token for /admin and /debug (env KVROUTE_ADMIN_TOKEN)"
    )
    p.add_argument(
        "--health-degraded-ok",
        action="store_true",
        default=None,
        help="answer /health 200 while a worker is served in approximate mode",
    )
    p.add_argument(
        "--worker-header",
        help="response header naming the chosen worker (default x-kvroute-worker)",
    )
    p.add_argument("--seed", type=int, help="seed for the random policy and softmax sampling")
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    base = Config()
    if args.config is not None:
        base = from_mapping(_read_yaml(args.config), base)
    base = from_env(base, environ)
    flags: dict[str, Any] = {}
    if args.worker:
        flags["workers"] = list(args.worker)
    if getattr(args, "tokenizer", None):
        default, per_model = split_tokenizer_flags(args.tokenizer)
        if default is not None:
            flags["tokenizer"] = default
        if per_model:
            flags["tokenizers"] = {**base.tokenizers, **per_model}
    for name in (
        "host",
        "port",
        "mode",
        "policy",
        "block_size",
        "metrics",
        "admin_token",
        "health_degraded_ok",
        "worker_header",
        "seed",
        "workers_file",
        "workers_dns",
        "worker_api_key",
    ):
        value = getattr(args, name, None)
        if value is not None:
            flags[name] = value
    return from_mapping(flags, base).validate()


def split_tokenizer_flags(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """`--tokenizer PATH|remote` (the default) and `--tokenizer MODEL=PATH|remote`."""
    default: str | None = None
    per_model: dict[str, str] = {}
    for v in values:
        model, sep, spec = v.partition("=")
        if sep and model and spec and not os.path.exists(v):
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
        if config.tokenizer is None:
            config = from_mapping({"tokenizer": REMOTE}, config)
            log.warning(
                "no --tokenizer given: asking the workers' /tokenize (slower); pass the "
                "model's tokenizer folder for local tokenization"
            )
        from router.app import RouterApp

        app = RouterApp(config)
    except ConfigError as err:
        print(f"kvroute serve: {err.message}", file=sys.stderr)
        return 2
    serve(app, config.host, config.port)
    return 0


def serve(app: Any, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )
