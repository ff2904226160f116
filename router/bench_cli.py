"""`kvroute bench index|proxy`: benchmarks that print ratios against the named peers."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks: index, proxy")
    bsub = p.add_subparsers(dest="bench_command", metavar="WHICH", required=True)
    ix = bsub.add_parser(
        "index",
        help="prefix index: find_matches latency, apply throughput, hashing, memory "
        "(and Dynamo's RadixTree side by side when ai-dynamo-runtime is installed)",
    )
    ix.add_argument("--json", type=Path, help="write the results here as JSON")
    ix.set_defaults(func=_index)


def _index(args: argparse.Namespace) -> int:
    from indexer.bench import run

    run(args.json)
    return 0
