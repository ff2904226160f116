"""`kvroute demo --pd`: the prefill->decode handoff in about a minute, on simulated workers
that move real KV bytes with NIXL: which requests kvroute splits and why, the bytes moved,
and the time to first token against never splitting, on a fast link and a 1 GbE-like one.

Per link: one prefill and one decode worker, two routers side by side (`--pd-threshold
auto` and `never`) taking turns, streams decoding on the decode worker throughout; "stall"
is the longest any of them waited for its next token while a request started (what a long
local prefill costs the others, and what a split saves them).
"""

from __future__ import annotations

import statistics
import sys

from router.bench.pd import KV_BYTES_PER_TOKEN, Sample, _prompt_set, run_link, seeds_table

LENGTHS = (256, 2048, 6000)
REPEATS = 2
LINKS: tuple[tuple[str, float | None], ...] = (("fast (loopback)", None), ("1 GbE-like", 104.0))


def run() -> int:
    print(
        f"kvroute demo --pd: 1 prefill + 1 decode simulated worker per link, real NIXL "
        f"transfers, {KV_BYTES_PER_TOKEN} KV bytes per token; auto vs never split",
        file=sys.stderr,
    )
    for name, link in LINKS:
        prompts = {p: _prompt_set(LENGTHS, REPEATS) for p in ("auto", "never")}
        rate, results, moved = run_link(link, KV_BYTES_PER_TOKEN, prompts, _quiet)
        print(f"\n{name} link, {rate:g} MB/s: NIXL moved {moved / 1e6:.1f} MB")
        _table(results["auto"], results["never"])
    print("\nthe seeds' model (88 KB/token, 83 ms per ~4,000-token prefill), busy decode worker:")
    for row in seeds_table(None):
        above = row["split_above_tokens"]
        verdict = "never splits" if above is None else f"splits above {above} tokens"
        print(f"  {row['link']:<22} {verdict}")
    return 0


def _table(auto: dict[int, list[Sample]], never: dict[int, list[Sample]]) -> None:
    print(
        f"  {'tokens':>6}  {'auto decision (reason)':<28} {'TTFT auto':>9} {'never':>7}   "
        f"{'stall auto':>10} {'never':>7}"
    )
    for n, samples in auto.items():
        for s, base in zip(samples, never[n], strict=False):
            decision = f"{'split' if s.split else 'local'} ({s.reason})"
            print(
                f"  {n:>6}  {decision:<28} {s.ttft_ms:>7.0f}ms {base.ttft_ms:>5.0f}ms   "
                f"{_stall(s):>8.0f}ms {_stall(base):>5.0f}ms"
            )
    mine = statistics.median(x.ttft_ms for xs in auto.values() for x in xs)
    theirs = statistics.median(x.ttft_ms for xs in never.values() for x in xs)
    print(f"  median TTFT: auto {mine:.0f} ms, never {theirs:.0f} ms")


def _stall(s: Sample) -> float:
    """The longest a running stream waited for its next token while this one started."""
    return max(s.stalls_ms, default=0.0)


def _quiet(line: str) -> None:
    print(line, file=sys.stderr)
