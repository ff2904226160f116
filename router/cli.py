"""The `kvroute` command: one binary, a subcommand per job.

Each subcommand lives with the code it drives and registers itself here through a
`register(subparsers)` function that adds its parser and sets `func` (argv namespace -> exit
code). Imports are lazy so that `kvroute --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable
from types import FrameType

# Commands that start engines and routers as child processes and stop them on the way out:
# a SIGTERM (a CI step's timeout, `kill`) must take that way too, not leave the children
# serving on their ports (`serve` and `fleet` drain on SIGTERM their own way).
_STOP_CHILDREN_ON_SIGTERM = frozenset({"bench", "demo"})

# (module, description) per top-level subcommand; each module defines register(subparsers).
_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.serve_cli", "run the KV-aware OpenAI-compatible reverse proxy"),
    "explain": ("router.explain", "show how the running router would score a prompt"),
    "events": ("router.events_cli", "capture, replay and tail vLLM KV event streams"),
    "sim": ("engines.sim.cli", "run one simulated vLLM worker"),
    "fleet": ("engines.sim.fleet", "run N simulated vLLM workers on free loopback ports"),
    "demo": ("router.demo", "run the seeds' experiment on a simulated fleet"),
    "bench": ("router.bench_cli", "benchmarks: index, proxy, extproc, routing, pd"),
    "envoy-config": ("router.envoy.cli", "print an Envoy bootstrap for the ext_proc picker"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-cache-aware router for vLLM fleets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="store_true", help="print kvroute's version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        try:
            register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = (
                importlib.import_module(module).register
            )
            register(sub)
        except ImportError as exc:  # a command whose optional pieces are missing
            p = sub.add_parser(name, help=f"{help_text} (unavailable: {exc})")
            p.set_defaults(func=_unavailable(name, exc))
    return parser


def _unavailable(name: str, exc: Exception) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"kvroute {name}: unavailable: {exc}", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in _COMMANDS), None)
    parser = build_parser(only=command if command in _COMMANDS else None)
    args = parser.parse_args(argv)
    if args.version:
        from router.metrics import version

        print(f"kvroute {version()}")
        return 0
    from router.logsetup import LEVELS, configure

    if str(args.log_level).upper() not in LEVELS:
        print(
            f"kvroute: --log-level {args.log_level!r}: use one of {', '.join(LEVELS)}",
            file=sys.stderr,
        )
        return 2
    configure(args.log_level, getattr(args, "log_format", None) or _env_log_format())
    args.argv = argv  # `serve --processes N` starts its children with these same arguments
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    if args.command in _STOP_CHILDREN_ON_SIGTERM:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code: int = func(args)
    return code


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Unwind as Ctrl-C does, through every `with` that stops a child process."""
    raise SystemExit(128 + signum)


def _env_log_format() -> str:
    import os

    return os.environ.get("KVROUTE_LOG_FORMAT", "text")


if __name__ == "__main__":
    raise SystemExit(main())
