"""`kvroute bench pd`: when does a prefill->decode split pay? Simulated workers that move
real KV bytes with NIXL (UCX, DRAM), behind `kvroute serve`, swept over prompt length x
link (104 MB/s as the seeds' 1 GbE, 1.25 GB/s, and the unthrottled loopback) for three
thresholds: always split (`--pd-threshold 0`), never, and auto (the cost model).

The decode worker runs `BACKGROUND` streams the whole time (short prompts: they stay local),
so a local prefill stalls them. The three routers run side by side on one fleet per link and
take turns request by request (a noisy machine's slow moments fall on all alike). Per cell,
`repeats` fresh prompts per policy, one at a time: their TTFT (p50, p90) and, per request,
the worst inter-token gap each running stream saw while it was prefilled (`itl_ms_p90`: the
stall a long local prefill causes). A policy's cost at a point is TTFT p50 + that ITL p90
(the cost model's objective: the request's wait plus the wait it imposes); the goal is auto
within 5% (+2 ms) of the better of always and never at every point. The seeds' numbers
(88 KB/token) and faster links (NVLink, RDMA) go through the cost model only, printed after
the sweep.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.sim.pd_fleet import PDFleetProcess, start_pd_fleet
from engines.sim.pd_metrics import pd_snapshot
from router.pd.model import split_above
from router.procs import RouterProcess
from router.svgplot import bar_chart
from router.textgen import WORDS
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

LENGTHS = (256, 1024, 2048, 4096, 8000)
LINKS: tuple[float | None, ...] = (104.0, 1250.0, None)  # MB/s; None: unthrottled
POLICIES = {"always": "0", "never": "never", "auto": "auto"}
KV_BYTES_PER_TOKEN = 8192  # keeps the 104 MB/s cells short; the seeds' 88 KB via the model
SEEDS_KV_BYTES = 88_000
BACKGROUND = 4  # streams decoding on the decode worker throughout
BG_TOKENS = 300
MAX_TOKENS = 4
GOAL_FRACTION, GOAL_MS = 0.05, 2.0
SIM_ARGS = ["--max-model-len", "16384", "--kv-blocks", "2048"]
Log = Callable[[str], None]
Prompts = dict[int, list[str]]


@dataclass
class Sample:
    ttft_ms: float
    split: bool
    reason: str
    stalls_ms: list[float] = field(default_factory=list)  # worst gap of each running stream


def make_prompts(lengths: tuple[int, ...], repeats: int, seed: int = 7) -> dict[int, list[str]]:
    """Fresh prompts (a nonce first: cached nowhere), sized with the packaged tokenizer;
    built before any clock starts."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    rng = random.Random(seed)
    out: dict[int, list[str]] = {}
    for n in lengths:
        words = [rng.choice(WORDS) for _ in range(n)]
        scale = n / len(tok.completion(" ".join(words)))
        out[n] = [
            f"{uuid.uuid4().hex} " + " ".join(rng.choice(WORDS) for _ in range(int(n * scale)))
            for _ in range(repeats)
        ]
    return out


# ---- the running streams ----------------------------------------------------------------------


class Background:
    """`n` streams through the router, restarted as they finish; chunk times per stream."""

    def __init__(self, client: httpx.AsyncClient, url: str, n: int = BACKGROUND) -> None:
        self.client, self.url, self.n = client, url, n
        self.streams: list[list[float]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.n)]

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self, i: int) -> None:
        while not self._stop:
            times: list[float] = []
            self.streams.append(times)
            body = {
                "prompt": f"bg {i}",
                "max_tokens": BG_TOKENS,
                "ignore_eos": True,
                "stream": True,
            }
            async with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())

    def worst_gaps(self, start: float, end: float) -> list[float]:
        """Per stream, the longest gap between tokens that ended inside [start, end]."""
        out = []
        for times in self.streams:
            gaps = [b - a for a, b in itertools.pairwise(times) if start <= b <= end]
            if gaps:
                out.append(max(gaps) * 1000)
        return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[float, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        tag = r.headers.get("x-kvroute-pd", "")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = (time.perf_counter() - start) * 1000
    if ttft is None:
        raise RuntimeError(f"no token from {url}: HTTP {r.status_code}")
    return ttft, tag


async def measure(
    urls: dict[str, str], prompts: dict[str, tuple[Prompts, list[str]]]
) -> dict[str, dict[int, list[Sample]]]:
    """The policies' routers in turn, request by request (the order rotating), so that a
    noisy machine's slow moments fall on every policy alike. The running streams go
    through the `never` router; the others see the decode worker's load in its metrics."""
    out: dict[str, dict[int, list[Sample]]] = {p: {} for p in urls}
    async with httpx.AsyncClient(timeout=300) as client:
        bg = Background(client, urls["never"])
        bg.start()
        await asyncio.sleep(2.0)  # every router has scraped the decode worker's load
        for policy, (_, warm) in prompts.items():
            for text in warm:  # teaches each router's prefill fits; not measured
                await one_request(client, urls[policy], text)
        order = list(urls)
        lengths = next(iter(prompts.values()))[0]
        for n, texts in lengths.items():
            for k in range(len(texts)):
                for policy in order[k % len(order) :] + order[: k % len(order)]:
                    text = prompts[policy][0][n][k]
                    out[policy].setdefault(n, []).append(
                        await _sample(client, urls[policy], text, bg)
                    )
        await bg.stop()
    return out


async def _sample(client: httpx.AsyncClient, url: str, prompt: str, bg: Background) -> Sample:
    start = time.perf_counter()
    ttft, tag = await one_request(client, url, prompt)
    end = start + ttft / 1000 + 0.03
    await asyncio.sleep(0.1)
    reason = tag.split("reason=")[-1]
    return Sample(ttft, tag.startswith("split"), reason, bg.worst_gaps(start, end))


# ---- one link ---------------------------------------------------------------------------------


def router_for(fleet: PDFleetProcess, threshold: str) -> RouterProcess:
    probe = [] if threshold == "auto" else ["--no-pd-probe"]
    extra = [*fleet.router_args, "--pd-threshold", threshold, *probe]
    return RouterProcess([], tokenizer=PACKAGED_TOKENIZER, extra=extra, ready_timeout=60)


def wait_calibrated(r: RouterProcess, timeout: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    pd: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pd = httpx.get(r.url + "/health", timeout=10).json().get("pd") or {}
        if pd.get("calibration") in ("done", "failed", "off"):
            return pd
        time.sleep(0.5)
    return pd


def run_link(
    link: float | None,
    kv_bytes: int,
    prompts: dict[str, tuple[Prompts, list[str]]],
    log: Log,
) -> tuple[float, dict[str, dict[int, list[Sample]]], float]:
    """(the link's measured MB/s, samples per policy and length, bytes moved). `prompts`:
    per policy, the measured prompts and the warm-up ones (fresh for every router: a prompt
    another policy sent is cached on the workers)."""
    decode_args = ["--link-mb-s", str(link)] if link else []
    args = ["--kv-bytes-per-token", str(kv_bytes), *SIM_ARGS]
    with start_pd_fleet(1, 1, args, decode_args=decode_args) as fleet, ExitStack() as stack:
        d = fleet.decode_urls[0]
        routers = {p: stack.enter_context(router_for(fleet, POLICIES[p])) for p in prompts}
        if "auto" in routers:
            log(f"  auto calibrated: {wait_calibrated(routers['auto'])}")
        before = pd_snapshot(httpx.get(d + "/metrics", timeout=10).text)
        results = asyncio.run(measure({p: r.url for p, r in routers.items()}, prompts))
        for policy, samples in results.items():
            log(f"  {_label(link)} {policy}: {_brief(samples)}")
        moved = pd_snapshot(httpx.get(d + "/metrics", timeout=10).text) - before
    rate = moved.link_bytes_per_s
    measured = round(rate / 1e6, 1) if rate else 0.0
    return (link or measured), results, moved.bytes_transferred


def _label(link: float | None) -> str:
    return f"{link:g} MB/s" if link else "loopback"


def _brief(samples: dict[int, list[Sample]]) -> str:
    parts = []
    for n, ss in samples.items():
        ttft = statistics.median(s.ttft_ms for s in ss)
        parts.append(f"{n}: {ttft:.0f} ms ({sum(s.split for s in ss)}/{len(ss)} split)")
    return ", ".join(parts)


# ---- the report -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def point(n: int, link: float, by_policy: dict[str, list[Sample]]) -> dict[str, Any]:
    def over(f: Callable[[list[Sample]], float]) -> dict[str, float]:
        return {p: round(f(s), 1) for p, s in by_policy.items()}

    auto = by_policy.get("auto", [])
    return {
        "prompt_tokens": n,
        "link_mb_s": link,
        "ttft_ms_p50": over(lambda s: statistics.median(x.ttft_ms for x in s)),
        "ttft_ms_p90": over(lambda s: pct([x.ttft_ms for x in s], 0.9)),
        "itl_ms_p90": over(lambda s: pct([g for x in s for g in x.stalls_ms], 0.9)),
        "auto_split_fraction": round(sum(x.split for x in auto) / len(auto), 2) if auto else 0.0,
    }


def cost(p: dict[str, Any], policy: str) -> float:
    return float(p["ttft_ms_p50"][policy] + p["itl_ms_p90"][policy])


def goal_met(p: dict[str, Any]) -> bool:
    best = min(cost(p, "always"), cost(p, "never"))
    return cost(p, "auto") <= best * (1 + GOAL_FRACTION) + GOAL_MS


def seeds_table(loopback_mb_s: float | None) -> list[dict[str, Any]]:
    """The seeds' 88 KB/token and their 83 ms prefill of a ~4,000-token prompt through the
    cost model: the shortest prompt a busy decode worker would hand off, per link."""
    links = {"1 GbE (104 MB/s)": 104e6, "1.25 GB/s": 1.25e9}
    if loopback_mb_s:
        links[f"loopback here ({loopback_mb_s:.0f} MB/s)"] = loopback_mb_s * 1e6
    links |= {"400G RDMA (50 GB/s)": 50e9, "NVLink (450 GB/s)": 450e9}
    return [
        {"link": name, "split_above_tokens": split_above(_seeds_prefill, SEEDS_KV_BYTES, rate, 2.0)}
        for name, rate in links.items()
    ]


def _prompt_set(lengths: tuple[int, ...], repeats: int) -> tuple[Prompts, list[str]]:
    warm = make_prompts((256, 512, 2048), 1)
    return make_prompts(lengths, repeats), [t for texts in warm.values() for t in texts]


def _seeds_prefill(n: int) -> float:
    return 83.0 * n / 3997


def run(
    json_path: Path | None,
    plot_path: Path | None = None,
    *,
    repeats: int = 5,
    lengths: tuple[int, ...] = LENGTHS,
    links: tuple[float | None, ...] = LINKS,
    kv_bytes: int = KV_BYTES_PER_TOKEN,
    log: Log = lambda s: print(s, file=sys.stderr),
) -> dict[str, Any]:
    started = time.monotonic()
    sets = [{p: _prompt_set(lengths, repeats) for p in POLICIES} for _ in links]
    points: list[dict[str, Any]] = []
    moved = 0.0
    loopback = None
    for link, prompts in zip(links, sets, strict=True):
        log(f"link {_label(link)}: always / never / auto, {len(lengths)} lengths x {repeats}")
        rate, results, nbytes = run_link(link, kv_bytes, prompts, log)
        loopback = rate if link is None else loopback
        moved += nbytes
        points += [point(n, rate, {p: results[p][n] for p in POLICIES}) for n in lengths]
    report = {
        "kv_bytes_per_token": kv_bytes,
        "repeats": repeats,
        "points": points,
        "nixl": {"backend": "UCX", "bytes_moved": int(moved)},
    }
    _print(report, seeds_table(loopback), time.monotonic() - started)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.write_text(plot(report))
        print(f"wrote {plot_path}")
    return report


def _print(report: dict[str, Any], seeds: list[dict[str, Any]], seconds: float) -> None:
    head = (
        f"{'tokens':>6} {'link MB/s':>9}  {'TTFT p50 always/never/auto':>28}  "
        f"{'ITL p90':>20}  split  goal"
    )
    print(head)
    for p in report["points"]:
        t, i = p["ttft_ms_p50"], p["itl_ms_p90"]
        print(
            f"{p['prompt_tokens']:>6} {p['link_mb_s']:>9g}  {t['always']:>8.0f} {t['never']:>8.0f} "
            f"{t['auto']:>8.0f}  {i['always']:>6.0f} {i['never']:>6.0f} {i['auto']:>6.0f}  "
            f"{p['auto_split_fraction']:>5.2f}  {'met' if goal_met(p) else 'MISSED'}"
        )
    met = sum(goal_met(p) for p in report["points"])
    total = len(report["points"])
    print(f"goal (auto's TTFT p50 + ITL p90 within 5% + 2 ms of the better): {met}/{total} points")
    print("the seeds' model (88 KB/token, 83 ms per ~4,000-token prefill), busy decode worker:")
    for row in seeds:
        above = row["split_above_tokens"]
        verdict = "never splits" if above is None else f"splits above {above} tokens"
        print(f"  {row['link']:<28} {verdict}")
    print(f"NIXL moved {report['nixl']['bytes_moved'] / 1e9:.2f} GB; {seconds:.0f} s")


def plot(report: dict[str, Any]) -> str:
    series: dict[str, dict[str, float]] = {p: {} for p in POLICIES}
    for pt in report["points"]:
        group = f"{pt['prompt_tokens']} @ {pt['link_mb_s']:g}"
        for policy in POLICIES:
            series[policy][group] = cost(pt, policy)
    return bar_chart(
        "kvroute bench pd: TTFT p50 + running streams' ITL p90 (ms), tokens @ MB/s",
        series,
        "lower is better; auto should match the better of always and never everywhere",
    )
