"""kvroute against each peer router, run by run, for `kvroute bench routing`: the median
difference of paired runs, the interval that holds it and a verdict on the TTFT p90 that is
given only at the confidence `WANT` (fewer runs say "not told apart" and how many would do).

Entry (JSON `paired`, "kvroute vs PEER"): "cached_diff", "ttft_p90_diff_ms" (medians of ours
minus the peer's, per run), "cached_diff_interval" and "ttft_p90_diff_interval_ms" [lo, hi]
with their "interval_confidence" (the sign test's interval: distribution-free),
"ttft_p90_verdict" ("lower" or "higher" when the interval excludes 0 at >= WANT confidence,
else "not told apart") and "ttft_p90_verdict_reason" (why not told apart, e.g. "3 runs: 75%;
5 give 94%"; "" for a verdict), "ttft_p90_lower_runs" (runs where ours had the lower p90),
"runs". Values are unrounded; the report rounds them when it writes the JSON.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from typing import Any

OURS = ("kvroute", "kvroute-approx")
WANT = 0.9  # the confidence an interval needs before the verdict says lower or higher


def paired(routers: dict[str, Any], peers: Collection[str]) -> dict[str, Any]:
    """kvroute (and its approximate mode) against each peer router (`peers`: the routers
    that are peers), run by run: run i of every router replays the same seed, so the
    differences of paired runs are what the router changed, not which order the workload
    came in. A TTFT p90 spreads 10-20% between runs on a shared machine while two routers'
    medians differ by a few percent, so the median difference and how many runs went each
    way say more than two medians do."""
    out: dict[str, Any] = {}
    for ours in OURS:
        a = routers.get(ours, {})
        if not comparable(a):
            continue
        for name, b in routers.items():
            if name in peers and comparable(b):
                out[f"{ours} vs {name}"] = entry(a, b)
    return out


def comparable(row: dict[str, Any]) -> bool:
    """A row that ran, every request answered: a row's figures are its answered requests',
    so one whose router refused or lost some (429s, a router that died) would look faster
    than one that served them all."""
    return bool(row) and "skipped" not in row and not row.get("errors")


def entry(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Router row `a` against row `b`, run i against run i."""
    runs = list(zip(a["ttft_p90_ms_runs"], b["ttft_p90_ms_runs"], strict=True))
    cached = zip(a["cached_fraction_runs"], b["cached_fraction_runs"], strict=True)
    more = [x - y for x, y in cached]
    ttft = [x - y for x, y in runs]
    lo, hi, confidence = median_interval(ttft)
    said, why = verdict(lo, hi, confidence, len(ttft))
    return {
        "cached_diff": statistics.median(more),
        "cached_diff_interval": list(median_interval(more)[:2]),
        "ttft_p90_diff_ms": statistics.median(ttft),
        "ttft_p90_diff_interval_ms": [lo, hi],
        "interval_confidence": confidence,
        "ttft_p90_verdict": said,
        "ttft_p90_verdict_reason": why,
        "ttft_p90_lower_runs": sum(1 for x, y in runs if x < y),
        "runs": len(runs),
    }


def verdict(lo: float, hi: float, confidence: float, runs: int) -> tuple[str, str]:
    """("lower" | "higher" | "not told apart", why not told apart). Under `WANT` confidence
    an interval that excludes 0 tells nothing: one run's interval is that run (0%), three
    runs' is their range (75%), and one run of three in each direction is common."""
    if confidence < WANT:
        enough = runs_for(WANT)
        plural = "run" if runs == 1 else "runs"
        reach = f"{runs} {plural}: {confidence:.0%}; {enough} give {sign_confidence(enough):.0%}"
        return "not told apart", reach
    if hi < 0:
        return "lower", ""
    if lo > 0:
        return "higher", ""
    return "not told apart", "the interval holds 0"


def runs_for(want: float) -> int:
    """The fewest runs whose widest interval (the lowest to the highest) reaches `want`."""
    n = 1
    while sign_confidence(n) < want:
        n += 1
    return n


def sign_confidence(n: int, k: int = 1) -> float:
    """Confidence that x(k)..x(n+1-k) of `n` values holds their distribution's median."""
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) * 0.5**n


def median_interval(values: Sequence[float], want: float = WANT) -> tuple[float, float, float]:
    """An interval that holds the median of the distribution `values` were drawn from, with
    the confidence it has: the narrowest pair of order statistics x(k), x(n+1-k) whose
    confidence, 1 - 2 P(Binomial(n, 1/2) < k), is at least `want` (the sign test's interval:
    it assumes nothing of the shape, which a p90 of one run does not let us assume). Under
    five values no pair reaches 90%; the widest one is returned with what it does reach
    (three: 75%)."""
    xs = sorted(values)
    n = len(xs)
    k = 1
    while 2 * (k + 1) <= n + 1 and sign_confidence(n, k + 1) >= want:
        k += 1
    return xs[k - 1], xs[n - k], sign_confidence(n, k)
