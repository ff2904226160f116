"""Where the manifests' memory requests and limits come from: `kvroute serve`'s resident set
size, idle and under load, on a simulated fleet (`kvroute sim` workers in child processes).

For each run: 4 simulated workers (8,192 KV blocks each, so the index keeps growing under
load), `kvroute serve` in a child process as the pods run it (the packaged tokenizer, or
also the ext_proc picker with --picker), RSS read from /proc:

    idle        10 s after /ready, before any request
    peak        the highest sample (every 0.25 s) while c clients stream completions of
                ~300-word distinct prompts, then of ~1,600-word ones (the tokenizer's and
                the prefix index's worst case: nothing is shared)
    after       10 s after the load stopped

    .venv/bin/python deploy/k8s/measure_rss.py --runs 3 --seconds 30 --json out/rss.json

Prints each run and the medians; the figures in deploy/k8s/base/kvroute.yaml's comment come from
it. On a shared machine the absolute numbers vary little (RSS is not a timing), but rerun it
before changing the manifests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from conformance.faults.harness import Load, SimProcess, prompt, router_for, rss_mb
from router.procs import free_port

SIM_ARGS = ("--block-size", "16", "--kv-blocks", "8192", "--topic", "kv-events")


class LongLoad(Load):
    """Load with ~1,600-word prompts (~3,800 tokens: near the sim workers' 4,096 context)."""

    async def _client(self, client: Any, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self.stop.is_set():
            self.fates[await self.one(client, prompt(rng, 1600))] += 1


async def _sample(pid: int, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        out.append(rss_mb(pid))
        await asyncio.sleep(0.25)


async def _phase(load: Load, pid: int, seconds: float, samples: list[float]) -> dict[str, int]:
    sampler = asyncio.create_task(_sample(pid, load.stop, samples))
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(seconds)
    load.stop.set()
    await asyncio.gather(runner, sampler)
    return dict(load.fates)


def one_run(picker: bool, seconds: float, concurrency: int) -> dict[str, Any]:
    sims = [SimProcess(args=SIM_ARGS) for _ in range(4)]
    extra = ["--ext-proc-port", str(free_port())] if picker else []
    try:
        with router_for(sims, *extra) as router:
            pid = router.proc.pid
            time.sleep(10)
            idle = rss_mb(pid)
            samples: list[float] = []
            url = [router.url]
            short = asyncio.run(_phase(Load(url, concurrency), pid, seconds, samples))
            long = asyncio.run(_phase(LongLoad(url, concurrency), pid, seconds, samples))
            time.sleep(10)
            after = rss_mb(pid)
            return {
                "picker": picker,
                "idle_mb": round(idle, 1),
                "peak_mb": round(max([*samples, after]), 1),
                "after_mb": round(after, 1),
                "fates": {"short": short, "long": long},
            }
    finally:
        for sim in sims:
            sim.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="per load phase")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report: dict[str, Any] = {"runs": [], "median": {}}
    for picker in (False, True):
        runs = [one_run(picker, args.seconds, args.concurrency) for _ in range(args.runs)]
        for run in runs:
            print(json.dumps(run), flush=True)
        key = "proxy+picker" if picker else "proxy"
        report["runs"] += runs
        report["median"][key] = {
            k: statistics.median(r[k] for r in runs) for k in ("idle_mb", "peak_mb", "after_mb")
        }
    print(json.dumps(report["median"], indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
