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
    px = bsub.add_parser(
        "proxy",
        help="added latency and req/s over a fast fake backend, side by side with "
        "sglang-router and vllm-router when installed (needs wrk)",
    )
    px.add_argument("--json", type=Path, help="write the results here as JSON")
    px.add_argument("--plot", type=Path, help="write a bar chart here (SVG)")
    px.add_argument("--seconds", type=int, default=5, help="per wrk run (default 5)")
    px.add_argument("--repeat", type=int, default=3, help="runs per point; medians (default 3)")
    px.add_argument("--only", nargs="+", help="targets to run: kvroute sglang-router vllm-router")
    px.add_argument(
        "--prompts",
        nargs="+",
        choices=("repeated", "shared-prefix", "distinct"),
        help="prompt mixes (default: all three): one repeated prompt; a shared ~2k-token "
        "prefix + distinct ~30-token tail; distinct ~2k-token prompts",
    )
    px.add_argument(
        "--long",
        type=int,
        default=0,
        metavar="SECONDS",
        help="also one run this long at concurrency 1 per target and mix (p99 and max)",
    )
    px.set_defaults(func=_proxy)


def _index(args: argparse.Namespace) -> int:
    from router.bench.index import run

    run(args.json)
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from router.bench.proxy import run

    run(
        args.json,
        seconds=args.seconds,
        repeat=args.repeat,
        only=args.only,
        plot_path=args.plot,
        prompts=args.prompts,
        long_seconds=args.long,
    )
    return 0
