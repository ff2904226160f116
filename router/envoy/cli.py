"""`kvroute envoy-config`: print a runnable Envoy bootstrap for a fleet behind kvroute's
ext_proc picker (see router/envoy/bootstrap.py for what it wires and why)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from router.core.errors import ConfigError
from router.envoy.bootstrap import (
    GatewayConfig,
    parse_hostport,
    parse_worker,
    render,
    write_eds,
)

DESCRIPTION = """\
Print an Envoy 1.40 bootstrap (YAML) that listens on --listen-port, asks kvroute's ext_proc
picker (kvroute serve --ext-proc-port P) where each request goes, and forwards it there with
the override_host load-balancing policy: only the listed workers are reachable, the picker's
ordered fallbacks are tried on connect failures, round robin serves when the picker gives no
answer. Run it with:  envoy -c envoy.yaml

Workers that join later: give a DNS name that resolves to every worker (a headless Service,
re-resolved every 5 s), or --eds-file F: Envoy then watches F for the worker list; rewrite it
with `kvroute envoy-config --eds-file F --write-eds --worker ...` (no Envoy restart)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap for kvroute's ext_proc picker",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen-port", type=int, metavar="L", help="Envoy's HTTP port (required)")
    p.add_argument("--listen-host", default="0.0.0.0", metavar="H")
    p.add_argument("--ext-proc", metavar="HOST:P", help="kvroute's picker (required)")
    p.add_argument(
        "--worker", action="append", default=[], metavar="URL", help="http://HOST:PORT, repeatable"
    )
    p.add_argument("--body-mode", choices=("buffered", "full-duplex"), default="buffered")
    p.add_argument(
        "--failure-mode",
        choices=("open", "close"),
        default="close",
        help="picker down: open = round robin (needs buffered), close = 5xx (default)",
    )
    p.add_argument(
        "--response-body",
        choices=("read", "skip"),
        default="read",
        help="read: the picker sees response bodies (first token, cached tokens; a gRPC round "
        "trip per chunk); skip: only response headers (cheaper, approximate first token)",
    )
    p.add_argument("--admin-port", type=int, metavar="A", help="Envoy admin on 127.0.0.1:A")
    p.add_argument(
        "--stats-port",
        type=int,
        metavar="S",
        help="serve only the admin's /stats/prometheus on --listen-host:S, for Prometheus "
        "(needs --admin-port)",
    )
    p.add_argument(
        "--ext-proc-tls",
        action="store_true",
        help="dial the picker with TLS, not verifying its certificate: a picker started with "
        "--ext-proc-tls-self-signed (deploy/k8s/gateway's kvroute-epp)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=32 * 1024 * 1024, help="413 above (default 32 MiB)"
    )
    p.add_argument("--eds-file", type=Path, metavar="F", help="read the workers from F (watched)")
    p.add_argument(
        "--write-eds",
        action="store_true",
        help="write the --worker list to --eds-file (atomically) instead of printing",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        listen_port=args.listen_port,
        listen_host=args.listen_host,
        ext_proc=parse_hostport(args.ext_proc, "--ext-proc"),
        workers=tuple(parse_worker(w) for w in args.worker),
        body_mode=args.body_mode,
        failure_mode=args.failure_mode,
        response_body=args.response_body,
        admin_port=args.admin_port,
        stats_port=args.stats_port,
        picker_tls=args.ext_proc_tls,
        max_body_bytes=args.max_body_bytes,
        eds_path=args.eds_file,
    ).validate()


def run(args: argparse.Namespace) -> int:
    try:
        if args.write_eds:
            return _write_eds(args)
        if args.listen_port is None or args.ext_proc is None:
            raise ConfigError("--listen-port and --ext-proc are required")
        cfg = config_from_args(args)
        if cfg.eds_path is not None and not cfg.eds_path.exists():
            write_eds(cfg.eds_path, cfg.workers)  # Envoy needs the file at start
        sys.stdout.write(render(cfg))
    except ConfigError as exc:
        print(f"kvroute envoy-config: {exc}", file=sys.stderr)
        return 2
    return 0


def _write_eds(args: argparse.Namespace) -> int:
    if args.eds_file is None:
        raise ConfigError("--write-eds needs --eds-file")
    workers = tuple(parse_worker(w) for w in args.worker)
    write_eds(args.eds_file, workers)
    print(f"wrote {len(workers)} worker(s) to {args.eds_file}", file=sys.stderr)
    return 0
