"""`kvroute bench index|proxy`: benchmarks that print ratios against the named peers."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks: index, proxy, pd")
    bsub = p.add_subparsers(dest="bench_command", metavar="WHICH", required=True)
    ix = bsub.add_parser(
        "index",
        help="prefix index: find_matches latency, apply throughput, hashing, memory "
        "(and Dynamo's RadixTree side by side when ai-dynamo-runtime is installed)",
    )
    ix.add_argument("--json", type=Path, help="write the results here as JSON")
    ix.add_argument("--repeat", type=int, default=3, help="rounds; medians (default 3)")
    ix.add_argument("--scale", nargs="+", choices=["1m", "10m"], default=[], help="growth figures")
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
    px.set_defaults(func=_proxy)
    pd = bsub.add_parser(
        "pd",
        help="prefill->decode handoff: always / never / auto split over prompt length x link, "
        "simulated workers moving real KV with NIXL (~5-10 minutes)",
    )
    pd.add_argument("--json", type=Path, help="write the results here as JSON")
    pd.add_argument("--plot", type=Path, help="write a bar chart here (SVG)")
    pd.add_argument("--repeat", type=int, default=5, help="requests per cell; medians (default 5)")
    pd.add_argument("--lengths", help="prompt lengths, comma-separated (default 256..8000)")
    pd.add_argument(
        "--links", help="MB/s per link, comma-separated; 0 = unthrottled (default 104,1250,0)"
    )
    pd.add_argument("--kv-bytes-per-token", type=int, default=8192, help="default 8192")
    pd.set_defaults(func=_pd)


def _index(args: argparse.Namespace) -> int:
    from router.bench.index import run

    run(args.json, repeat=args.repeat, scale=args.scale)
    return 0


def _pd(args: argparse.Namespace) -> int:
    from router.bench.pd import LENGTHS, LINKS, run

    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    links = tuple(float(x) or None for x in args.links.split(",")) if args.links else LINKS
    run(
        args.json,
        args.plot,
        repeats=args.repeat,
        lengths=lengths,
        links=links,
        kv_bytes=args.kv_bytes_per_token,
    )
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from router.bench.proxy import run

    run(args.json, seconds=args.seconds, repeat=args.repeat, only=args.only, plot_path=args.plot)
    return 0
