"""`router-check`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from router.check.checks_gateway import GATEWAY_NAMES, GatewayOptions, run_gateway_checks
from router.check.context import WORKER_HEADER, Options, UsageError
from router.check.model import Report
from router.check.render import as_json, human
from router.check.runner import CHECKS, NAMES, run_checks

DESCRIPTION = """\
Prove that a running kvroute router really routes by KV cache, and say what to fix when it
does not. router-check reads the router's worker list (GET /admin/workers) unless --worker
is given, then, for each worker, subscribes to its KV event stream itself, sends it a fresh
probe prompt and waits for the matching BlockStored; compares block sizes and token ids
between router and engine; and finally sends long prompts twice through the router and
times the first token. It sends a few dozen small requests in all, each bounded by
--timeout; the probe prompts are fresh, so they do not disturb what is cached. Run it where
the router runs (same network): it dials the workers and their ZMQ event sockets itself."""


def _epilog() -> str:
    checks = "\n".join(f"  {c.name:<16}{c.what}" for c in CHECKS)
    return f"""\
checks, in order (skip any with --skip NAME):
{checks}
  with --gateway: {", ".join(GATEWAY_NAMES)}

Every line says PASS, WARN (could not run, or works with a caveat) or FAIL, with the
evidence in numbers; every FAIL says what to change.

exit status: 0 every check passed (warnings allowed), 1 a check failed,
             2 bad usage, or the router or the gateway is unreachable

examples:
  router-check --router http://127.0.0.1:8000
  router-check --router http://kvroute:8000 --admin-token "$TOKEN" --json > check.json
  router-check --router http://127.0.0.1:8000 --worker http://10.0.0.5:8000 \\
      --skip repeat-prefix --skip load-spread       # only the engine-side checks
  router-check --router http://127.0.0.1:8000 --prompt-tokens 4000 --margin 2
  router-check --gateway http://envoy:8080 --gateway-admin http://envoy:9901
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router-check",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--router", metavar="URL", help="the router's base URL")
    p.add_argument(
        "--gateway",
        metavar="URL",
        help="an Envoy / GIE gateway listener in front of kvroute's ext_proc picker: probe that "
        "it honours the picker (with or without --router)",
    )
    p.add_argument(
        "--gateway-admin", metavar="URL", help="the gateway's Envoy admin, to read its config"
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="a worker to check (repeatable); default: every worker the router lists",
    )
    p.add_argument("--json", action="store_true", help='print {"checks": [...], "ok": bool}')
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds each call or probe may take (default %(default)s)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="NAME",
        help="a check not to run (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("KVROUTE_ADMIN_TOKEN"),
        metavar="T",
        help="the router's admin token, for /admin and /debug (env KVROUTE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVROUTE_WORKER_API_KEY"),
        metavar="KEY",
        help="the workers' vLLM --api-key, sent on every call but /admin and /debug (the "
        "workers, and the router's /v1/models, ask for it; env KVROUTE_WORKER_API_KEY)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=1.5,
        metavar="X",
        help="repeat-prefix: the cached repeat's median time to first token must be X "
        "times faster than the cold one's (default %(default)s)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=1500,
        metavar="N",
        help="repeat-prefix prompt length in tokens (default %(default)s; capped by the "
        "model's max_model_len)",
    )
    p.add_argument("--pairs", type=int, default=3, help="repeat-prefix pairs (default 3)")
    p.add_argument("--burst", type=int, default=8, help="load-spread burst size (default 8)")
    p.add_argument(
        "--worker-header",
        default=WORKER_HEADER,
        help="response header naming the chosen worker (default %(default)s)",
    )
    return p


def options(args: argparse.Namespace) -> Options:
    """Every option, judged the same way whichever checks run (--router, --gateway or both):
    a bad value is a usage error before anything is dialled."""
    skip = {s.strip() for raw in args.skip for s in raw.split(",") if s.strip()}
    known = (*NAMES, *GATEWAY_NAMES)
    unknown = sorted(skip - set(known))
    if unknown:
        raise UsageError(f"--skip {', '.join(unknown)}: unknown; checks are {', '.join(known)}")
    return Options(
        router=args.router,
        workers=tuple(args.worker),
        timeout_s=args.timeout,
        skip=frozenset(skip),
        admin_token=args.admin_token,
        api_key=args.api_key or None,
        margin=args.margin,
        pairs=args.pairs,
        burst=args.burst,
        prompt_tokens=args.prompt_tokens,
        worker_header=args.worker_header.lower(),
        gateway=args.gateway,
        gateway_admin=args.gateway_admin,
    ).validate()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on bad usage
    if args.router is None and args.gateway is None:
        parser.error("give --router URL, --gateway URL, or both")
    try:
        opts = options(args)
    except UsageError as exc:
        print(f"router-check: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_all(opts))
    print(as_json(report) if args.json else human(report), flush=True)
    if report.fatal is not None and args.json:
        print(f"router-check: {report.fatal}", file=sys.stderr)
    return report.exit_code


async def run_all(opts: Options) -> Report:
    """The router's checks, then the gateway's, as far as `opts` names each."""
    report = await run_checks(opts) if opts.router else Report(opts.gateway or "")
    if opts.gateway:
        gateway = await run_gateway_checks(_gateway_options(opts), opts.skip)
        report.results += gateway.results
        report.fatal = report.fatal or gateway.fatal
    return report


def _gateway_options(opts: Options) -> GatewayOptions:
    assert opts.gateway is not None
    return GatewayOptions(
        opts.gateway, opts.gateway_admin, opts.timeout_s, opts.pairs, api_key=opts.api_key
    )


if __name__ == "__main__":
    raise SystemExit(main())
