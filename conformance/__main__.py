"""python -m conformance --target vllm|sim [--report PATH] [--only NAME ...]

Runs the registered checks against real vLLM (needs conformance/setup_vllm.sh) or the
simulator, writes a JSON report, and exits 0 only when every check that applies ran and
passed (a skipped check fails the run). --list prints the checks and what they need."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from conformance import report
from conformance.checks import registry
from conformance.registry import SelectionError, exit_code, plan
from conformance.session import Context, Session, run_checks
from conformance.targets import make_target


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", choices=("vllm", "sim"), required=True)
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME", help="run just these checks")
    p.add_argument("--workdir", type=Path, help="captures and logs (default: a temp folder)")
    p.add_argument("--fixtures-out", type=Path, help="write scenario captures here (fixtures)")
    p.add_argument("--model-dir", type=Path, help="tiny model folder for --target vllm")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    return p.parse_args(argv)


def list_checks(target: str) -> str:
    rows = []
    for c in registry().values():
        where = "" if target in c.targets else f"  (not for {target})"
        rows.append(
            f"{c.name:<16} needs {', '.join(sorted(c.needs)) or '-'}{where}\n    {c.description}"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.list:
        print(list_checks(args.target))
        return 0
    try:
        checks = plan(args.target, args.only, registry())
    except SelectionError as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    target = make_target(args.target, args.model_dir.resolve() if args.model_dir else None)
    # absolute: child processes (captures, engines) run in other folders
    workdir = (
        args.workdir or Path(tempfile.mkdtemp(prefix=f"kvroute-conformance-{args.target}-"))
    ).resolve()
    fixtures_out = args.fixtures_out.resolve() if args.fixtures_out else None
    ctx = Context(target, Session(target, checks), workdir, fixtures_out)
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so every engine and child is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = asyncio.run(run_checks(ctx, checks))
    except KeyboardInterrupt:
        print("conformance: interrupted; engines stopped", file=sys.stderr)
        return 130
    doc = report.build(
        args.target,
        target.versions(),
        results,
        ctx.session.engine_log,
        started,
        time.monotonic() - t0,
        sys.argv,
    )
    doc["workdir"] = str(workdir)
    if args.report:
        report.write(doc, args.report)
    print(report.summary(doc), file=sys.stderr)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
