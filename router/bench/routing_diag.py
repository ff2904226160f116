"""Why kvroute's cached fraction falls short of the ideal on a workload: where each group's
requests went, what the router predicted versus what the engines served, and what the
engines really hold at the end (their `POST /sim/cached_tokens` ground truth).

    python -m router.bench.routing_diag --workload vllm-prefix-repetition --runs 3 \\
        [--config kvroute.yaml] [--router kvroute|kvroute-approx|round_robin|...] [--scale F]

Prints per run: cached fraction and the ideal; groups homed per worker (the worker of a
group's first request) and how many groups were split over several workers; the router's
prediction fidelity (`kvroute_prediction_fidelity_total`: exact / over / under, over = it
believed blocks cached that the engine no longer had); requests and TTFT p90 per worker, and
whether the slowest tenth was sent in the run's first second (the cold start) or later;
evictions per engine; and how many groups' whole shared prefix each engine still holds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import statistics
from pathlib import Path
from typing import Any

import httpx

from engines.sim.fleet import start_fleet_process
from router.bench import driver, peers
from router.bench.driver import DriveResult, Sample, drive
from router.bench.ideal import ideal_fraction
from router.bench.routing import fleet_args, pct
from router.bench.targets import TARGETS, Target, replicas_target, with_config
from router.bench.workload_file import WorkloadFileError, load
from router.bench.workloads import GENERATORS, Request, Workload, build

DECISIONS: list[tuple[Request, dict[str, Any], Sample]] = []
BELIEF: collections.Counter[str] = collections.Counter()


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of runs, at least 1")
    return int(text)


def _scale(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction in (0, 1] of the sizes")
    return x


# the routers it can diagnose: every bench router but the oracle (no router to explain)
ROUTERS = [n for n, t in TARGETS.items() if not t.oracle] + ["kvroute-replicas"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        default="vllm-prefix-repetition",
        choices=list(GENERATORS),
        metavar="NAME",
        help="a built-in workload: %(choices)s (`kvroute bench routing --help` says what "
        "each is; default %(default)s)",
    )
    p.add_argument(
        "--workload-file",
        type=Path,
        metavar="F",
        help="a workload file instead (`kvroute bench routing --help` has the format)",
    )
    p.add_argument(
        "--router",
        default="kvroute",
        choices=ROUTERS,
        metavar="ROUTER",
        help="the router to diagnose: %(choices)s (default %(default)s; kvroute-replicas: "
        "two, the client alternating); a peer must be installed (`kvroute bench routing` "
        "installs them)",
    )
    p.add_argument(
        "--runs",
        type=_at_least_one,
        default=3,
        metavar="N",
        help="runs on seeds 0..N-1, each on a fresh fleet; prints their median (default 3)",
    )
    p.add_argument(
        "--config", type=Path, metavar="FILE", help="kvroute.yaml for kvroute's own routers"
    )
    p.add_argument(
        "--scale",
        type=_scale,
        default=1.0,
        metavar="F",
        help="shrink the built-in workload's counts and lengths, (0, 1] (default 1)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="ask /debug/route before each request and analyse the requests that left "
        "their group's first worker (kvroute only; shifts timing slightly)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    target = _target(p, args.router, args.config)
    if args.explain:
        # /debug/route wants the admin token; the routers started here inherit it
        os.environ.setdefault("KVROUTE_ADMIN_TOKEN", "routing-diag")
        driver.one = _explained(driver.one)
    fractions = []
    try:
        mine = load(args.workload_file) if args.workload_file else None
    except WorkloadFileError as exc:
        raise SystemExit(str(exc)) from None
    for seed in range(args.runs):
        w = mine.build(seed) if mine else build(args.workload, seed, args.scale)
        fractions.append(diagnose(w, target, seed))
    print(f"median cached fraction {statistics.median(fractions):.4f} over {fractions}")


def _target(p: argparse.ArgumentParser, router: str, config: Path | None) -> Target:
    """The router's target; a peer that is not installed is refused before anything starts."""
    if router == "kvroute-replicas":
        return replicas_target(config)
    target = with_config(config)[router]
    if target.peer is not None and peers.peer_bin(target.peer) is None:
        p.error(f"--router {router}: {target.peer} is not installed: {peers.remedy(target.peer)}")
    return target


def diagnose(w: Workload, target: Any, seed: int) -> float:
    with (
        start_fleet_process(w.workers, fleet_args(w, seed, target.events)) as fleet,
        target.launch(fleet.workers, seed) as urls,
    ):
        result = asyncio.run(drive(w, urls))
        names = {str(x["url"]).removeprefix("http://"): i for i, x in enumerate(fleet.workers)}
        router_metrics = _router_metrics(urls[0])
        truth = _ground_truth(w, fleet.workers)
        stats = [httpx.get(f"{x['url']}/sim/stats").json() for x in fleet.workers]
    out = report(w, result, names, router_metrics, truth, stats)
    if DECISIONS:
        explain_splits(DECISIONS)
        DECISIONS.clear()
    return out


def _explained(one: Any) -> Any:
    async def wrapped(
        client: httpx.AsyncClient, url: str, r: Request, model: str = driver.MODEL
    ) -> Sample:
        token = {"authorization": f"Bearer {os.environ['KVROUTE_ADMIN_TOKEN']}"}
        doc = (
            await client.post(f"{url}/debug/route", json={"prompt": r.prompt}, headers=token)
        ).json()
        await _compare_belief(client, doc, r.prompt)
        sample: Sample = await one(client, url, r, model)
        DECISIONS.append((r, doc, sample))
        return sample

    return wrapped


async def _compare_belief(client: httpx.AsyncClient, doc: dict[str, Any], prompt: str) -> None:
    """The router's overlap per worker against the engine's ground truth, at decision time."""
    if "workers" not in doc:
        raise SystemExit(f"/debug/route did not explain the decision: {doc}")
    for x in doc["workers"]:
        truth = await client.post(
            f"http://{x['worker']}/sim/cached_tokens", json={"prompt": prompt}
        )
        held = truth.json()["cached_blocks"]
        believed = x["overlap_blocks"]
        if believed == held:
            BELIEF["exact"] += 1
        elif believed > held:
            BELIEF["router over (engine evicted, index still shows)"] += 1
            BELIEF["over blocks"] += believed - held
        else:
            BELIEF["router under (engine holds, index does not show)"] += 1
            BELIEF["under blocks"] += held - believed
            BELIEF["under while router saw 0" if believed == 0 else "under, partial"] += 1


def explain_splits(decisions: list[tuple[Request, dict[str, Any], Sample]]) -> None:
    """Requests that went elsewhere than their group's first worker: why, by the terms."""
    home: dict[str, str] = {}
    why: collections.Counter[str] = collections.Counter()
    shown = 0
    for r, doc, sample in decisions:
        worker = sample.worker or "?"
        first = home.setdefault(r.group, worker)
        if worker == first:
            continue
        by = {x["worker"]: x for x in doc["workers"]}
        h, chosen = by.get(first, {}), by.get(worker, {})
        winner = doc.get("winner")
        why[_reason(h, chosen, stale=winner != worker)] += 1
        if shown < 4:
            shown += 1
            print(f"  split {r.group}: home {first} -> {worker}, cached {sample.cached_tokens}")
            if winner != worker:
                print(f"    (this explain, from just before, ranked {winner} first)")
            print("    " + doc["explain"].replace("\n", "\n    "))
    print(f"  why requests left their group's first worker: {dict(why)}")
    print(f"  router belief vs engine truth (per worker x request): {dict(BELIEF)}")
    BELIEF.clear()


def _reason(home: dict[str, Any], chosen: dict[str, Any], *, stale: bool = False) -> str:
    """Why a request left its group's first worker, from the `/debug/route` answer asked
    just before it was sent. `stale`: that answer's winner is not where the request went,
    so the fleet changed in between (another request was placed meanwhile) and its terms do
    not explain the move."""
    if stale:
        return "the fleet changed between the explain and the request"
    if excluded := home.get("excluded"):
        return f"home excluded ({str(excluded).split(':', 1)[0]})"  # the filter's own words
    if home.get("overlap_blocks", 0) == 0:
        return "router saw no overlap on home"
    if chosen.get("overlap_blocks", 0) >= home.get("overlap_blocks", 0):
        return "other worker had >= overlap"
    return "load/headroom outweighed the overlap"


def report(
    w: Workload,
    result: DriveResult,
    names: dict[str, int],
    router_metrics: dict[str, float],
    truth: list[int],
    stats: list[dict[str, Any]],
) -> float:
    s = result.samples
    cached = sum(x.cached_tokens for x in s) / max(sum(x.prompt_tokens for x in s), 1)
    homes: dict[str, int] = {}
    # group -> requests per worker (the workers a group spread over are its keys)
    spread: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for x in s:
        worker = names.get(x.worker or "", -1)
        homes.setdefault(x.group, worker)
        spread[x.group][worker] += 1
    per_worker = collections.Counter(homes.values())
    split = sum(1 for v in spread.values() if len(v) > 1)
    print(f"\nrun: cached {cached:.4f} (ideal {ideal_fraction(w):.4f}), errors {result.errors}")
    if s and all(x.worker is None for x in s):
        # a peer router names no worker on its responses: no placement to show, rather
        # than every group "homed" nowhere
        print("  placement: not known (this router names no worker on its responses)")
        print(f"  evicted blocks per engine: {[st['blocks_evicted'] for st in stats]}")
        print(f"  groups whose whole prefix each engine holds at the end: {truth}")
        return round(cached, 4)
    print(f"  groups homed per worker: {[per_worker.get(i, 0) for i in range(w.workers)]}")
    print(f"  groups split over >1 worker: {split} of {len(spread)}")
    in_order = sorted(s, key=lambda x: x.sent)
    for group in sorted(g for g, v in spread.items() if len(v) > 1):
        path = [x for x in in_order if x.group == group]
        steps = " ".join(
            f"w{names.get(x.worker or '', -1)}:{x.cached_tokens / max(x.prompt_tokens, 1):.2f}"
            for x in path
        )
        print(f"    {group} (worker:cached per request, in order sent): {steps}")
    placed = "  ".join(
        f"{g}:" + ",".join(f"w{k}x{n}" for k, n in sorted(spread[g].items()))
        for g in sorted(spread)
    )
    print(f"  requests per group and worker: {placed}")
    served = collections.Counter(names.get(x.worker or "", -1) for x in s)
    print(f"  requests per worker: {[served.get(i, 0) for i in range(w.workers)]}")
    by_worker: dict[int, list[float]] = collections.defaultdict(list)
    for x in s:
        by_worker[names.get(x.worker or "", -1)].append(x.ttft_ms)
    p90s = [_p90(by_worker.get(i, [])) for i in range(w.workers)]
    print(f"  TTFT p90 ms per worker: {p90s}, all: {_p90([x.ttft_ms for x in s])}")
    tail, early = slow_tail(s)
    print(f"  requests at or over the p90: {tail}, sent in the run's first second: {early}")
    print(f"  evicted blocks per engine: {[st['blocks_evicted'] for st in stats]}")
    print(f"  groups whose whole prefix each engine holds at the end: {truth}")
    fid = {k: v for k, v in router_metrics.items() if k.startswith("fidelity")}
    print(f"  prediction fidelity: {fid}")
    pred = router_metrics.get("predicted", 0.0)
    rep = router_metrics.get("reported", 0.0)
    print(f"  predicted cached tokens {pred:.0f}, reported {rep:.0f} ({pred / max(rep, 1):.3f}x)")
    return round(cached, 4)


def _p90(values: list[float]) -> float:
    """The bench's own p90 (nearest rank), so the diag's agrees with the table's."""
    return round(pct(sorted(values), 0.9), 1)


def slow_tail(samples: list[Sample], first_s: float = 1.0) -> tuple[int, int]:
    """How many requests took the p90 TTFT or longer, and how many of those were sent in the
    run's first `first_s` seconds: a tail sent at the start is the cold start (every cache
    empty, the first wave arriving at once), one spread over the run is the steady state."""
    if not samples:
        return 0, 0
    p90 = _p90([x.ttft_ms for x in samples])
    start = min(x.sent for x in samples)
    tail = [x.sent - start for x in samples if x.ttft_ms >= p90]
    return len(tail), sum(1 for t in tail if t < first_s)


_LINE = re.compile(r"^(kvroute_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$", re.M)


def _router_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = collections.defaultdict(float)
    for name, labels, value in _LINE.findall(text):
        if name == "kvroute_prediction_fidelity_total":
            result = re.search(r'result="(\w+)"', labels)
            out[f"fidelity_{result.group(1) if result else '?'}"] += float(value)
        elif name == "kvroute_predicted_cached_tokens_total":
            out["predicted"] += float(value)
        elif name == "kvroute_reported_cached_tokens_total":
            out["reported"] += float(value)
    return dict(out)


def _ground_truth(w: Workload, workers: list[dict[str, Any]]) -> list[int]:
    """Per engine: groups whose first request's leading full blocks (all but the tail
    block) are all still cached there."""
    first: dict[str, str] = {}
    for r in w.requests:
        first.setdefault(r.group, r.prompt)
    out = []
    for x in workers:
        held = 0
        for prompt in first.values():
            doc = httpx.post(f"{x['url']}/sim/cached_tokens", json={"prompt": prompt}).json()
            full = (doc["prompt_tokens"] - 1) // doc["block_size"]
            held += doc["cached_blocks"] >= full - 8  # the shared part; suffix blocks differ
        out.append(held)
    return out


if __name__ == "__main__":
    main()
