"""`kvroute bench proxy`: what a router adds on top of a fast fake OpenAI backend.

The backend (router.bench.backend, its own process) is reached directly, through kvroute
(kv policy, tokenizing ~2k-token prompts with the model's tokenizer), and through the peer
routers when they are installed; wrk drives each at concurrency 1 and 32, for each prompt
mix (`router.bench.proxy_prompts`: repeated, shared-prefix, distinct, novel-words). Reported
per mix: p50/p99 latency, added latency over direct, requests/s, each process's CPU per request
(from /proc), ratios against the peers, and the tokenizer's own CPU time for prompts of the
mix (the floor). Medians over `--repeat` runs, which take turns between the targets (all
up at once): the machine is shared and noisy, and its drift must hit every target alike.
`--long N` adds one N-second run at concurrency 1 per target (p99 and max: pauses).

JSON: `by_prompts: {mix: {"targets", "ratios", "tokenizer"}}`; the top-level `targets` and
`ratios` are the repeated-prompt ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.bench.peers import child, peer_bin, sglang_command, vllm_router_command
from router.bench.proxy_prompts import MIXES, Mix, floor
from router.procs import RouterProcess, free_port
from router.svgplot import bar_chart
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer


@dataclass
class Run:
    p50_us: float
    p99_us: float
    max_us: float
    rps: float
    requests: int
    errors: int
    cpu_us: float = 0.0  # the target process's CPU per request


@dataclass
class Target:
    url: str
    pid: int


_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def _latency(text: str, pct: str) -> float:
    m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        raise RuntimeError(f"wrk output has no {pct}% line:\n{text}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _max(text: str) -> float:
    m = re.search(r"^\s+Latency\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)\s", text, re.M)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0


def _family(pid: int) -> list[int]:
    """A process and its children (`kvroute serve --processes N`: the supervisor's)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *(int(k) for k in kids)]


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process and its children (all their threads), in clock ticks."""
    total = 0
    for p in _family(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total


def _rss_mb(pid: int) -> list[float]:
    """Resident memory of each serving process (the children, when there are some)."""
    family = _family(pid)
    out = []
    for p in family[1:] or family:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{p}/status").read_text()
            kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
            out.append(round(kb / 1024, 1))
    return out


def wrk(target: Target, lua: Path, conns: int, seconds: int) -> Run:
    """One wrk run (one thread: the Lua counter makes every request distinct) with a salt
    no other run uses."""
    salt = f"{random.getrandbits(24):06x}"
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(lua)]
    ticks = _cpu_ticks(target.pid)
    out = subprocess.run(
        [*cmd, f"{target.url}/v1/completions", "--", salt, str(random.getrandbits(30))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu_s = (_cpu_ticks(target.pid) - ticks) / os.sysconf("SC_CLK_TCK")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    cpu_us = cpu_s * 1e6 / max(requests, 1)
    return Run(_latency(out, "50"), _latency(out, "99"), _max(out), rps, requests, errors, cpu_us)


@contextlib.contextmanager
def backend(ports: list[int]) -> Iterator[int]:
    """The fake backend on `ports`; yields its pid."""
    cmd = [sys.executable, "-m", "router.bench.backend"]
    for p in ports:
        cmd += ["--port", str(p)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # it prints its ports once listening
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)


@contextlib.contextmanager
def kvroute_target(workers: list[str], processes: int = 1) -> Iterator[Target]:
    extra = ["--processes", str(processes)] if processes > 1 else []
    with RouterProcess(workers, tokenizer=PACKAGED_TOKENIZER, extra=extra) as router:
        yield Target(router.url, router.proc.pid)


def kvroute_processes_target(workers: list[str]) -> Any:
    return kvroute_target(workers, processes=2)


def sglang_target(workers: list[str]) -> Any | None:
    binary = peer_bin("sglang-router")
    if binary is None:
        return None
    port = free_port()
    return _peer(sglang_command(binary, port, workers, "cache_aware"), port)


def vllm_router_target(workers: list[str]) -> Any | None:
    binary = peer_bin("vllm-router")
    if binary is None:
        return None
    port = free_port()
    return _peer(vllm_router_command(binary, port, workers, "cache_aware"), port)


@contextlib.contextmanager
def _peer(cmd: list[str], port: int) -> Iterator[Target]:
    with child(cmd, f"http://127.0.0.1:{port}", "/readiness") as peer:
        yield Target(peer.url, peer.pid)


TARGETS: dict[str, Callable[[list[str]], Any]] = {
    "kvroute": kvroute_target,
    "kvroute-2p": kvroute_processes_target,  # kvroute serve --processes 2
    "sglang-router": sglang_target,
    "vllm-router": vllm_router_target,
}


def run(
    json_path: Path | None,
    seconds: int = 5,
    repeat: int = 3,
    only: list[str] | None = None,
    plot_path: Path | None = None,
    prompts: list[str] | None = None,
    long_seconds: int = 0,
) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("kvroute bench proxy needs wrk (apt-get install wrk)")
    ports = [free_port(), free_port()]
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    mixes = [Mix(name, tok) for name in (prompts or MIXES)]
    by: dict[str, Any] = {m.name: {"targets": {}, "tokenizer": floor(m)} for m in mixes}
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-bench-") as scratch,
        backend(ports) as backend_pid,
        contextlib.ExitStack() as stack,
    ):
        luas = {m.name: m.write(Path(scratch)) for m in mixes}
        targets = {"direct": Target(workers[0], backend_pid)}
        for name, factory in TARGETS.items():
            if only and name not in only:
                continue
            target = factory(workers)
            if target is None:
                for mix in by.values():
                    mix["targets"][name] = {"skipped": "not installed"}
                continue
            targets[name] = stack.enter_context(target)
        _measure_all(by, targets, luas, seconds, repeat)
        if long_seconds:
            _long_runs(by, targets, luas, long_seconds)
        memory = {n: _rss_mb(t.pid) for n, t in targets.items() if n.startswith("kvroute")}
    results = _assemble(by, seconds, repeat)
    results["rss_mb"] = memory  # per serving process, after the runs
    _print(results)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.write_text(plot(results))
        print(f"wrote {plot_path}")
    return results


def _measure_all(
    by: dict[str, Any],
    targets: dict[str, Target],
    luas: dict[str, Path],
    seconds: int,
    repeat: int,
) -> None:
    """Every target is up at once and the runs take turns (each repeat: each mix, each
    concurrency, each target), so the machine's drift over the minutes of a bench hits
    every target alike and the ratios stay fair."""
    runs: dict[tuple[str, str, int], list[Run]] = {}
    for _ in range(repeat):
        for mix, lua in luas.items():
            for target in targets.values():
                wrk(target, lua, 1, 1)  # warm-up: connections, caches
            for conns in (1, 32):
                for name, target in targets.items():
                    runs.setdefault((name, mix, conns), []).append(wrk(target, lua, conns, seconds))
    for (name, mix, conns), rs in runs.items():
        by[mix]["targets"].setdefault(name, {})[f"c{conns}"] = _medians(rs)


def _long_runs(
    by: dict[str, Any], targets: dict[str, Target], luas: dict[str, Path], seconds: int
) -> None:
    """One long run at concurrency 1 per target and mix: p99 and max show pauses."""
    for mix, lua in luas.items():
        for name, target in targets.items():
            wrk(target, lua, 1, 1)
            r = wrk(target, lua, 1, seconds)
            by[mix]["targets"][name]["c1_long"] = {
                "seconds": seconds,
                "p50_us": r.p50_us,
                "p99_us": r.p99_us,
                "max_us": r.max_us,
                "requests": r.requests,
            }


def _assemble(by: dict[str, Any], seconds: int, repeat: int) -> dict[str, Any]:
    for mix in by.values():
        _derive(mix)
    first = by.get("repeated") or next(iter(by.values()))
    return {
        "seconds": seconds,
        "repeat": repeat,
        "targets": first["targets"],
        "ratios": first["ratios"],
        "by_prompts": by,
    }


def plot(results: dict[str, Any]) -> str:
    series: dict[str, dict[str, float]] = {}
    for mix, data in results.get("by_prompts", {"repeated": results}).items():
        for name, t in data["targets"].items():
            if name == "direct" or "skipped" in t:
                continue
            row = series.setdefault(name, {})
            row[f"added p50 c=1 (us), {mix}"] = t["c1"].get("added_p50_us", 0.0)
            row[f"added p99 c=1 (us), {mix}"] = t["c1"].get("added_p99_us", 0.0)
            row[f"req/s c=32, {mix}"] = float(t["c32"]["rps"])
    return bar_chart(
        "Proxy overhead over a fast fake backend (~2k-token prompts: repeated, shared "
        "prefix + distinct tail, distinct)",
        series,
        "latency added over direct access (lower is better); req/s at 32 connections "
        "(higher is better)",
    )


def _medians(runs: list[Run]) -> dict[str, Any]:
    return {
        "p50_us": statistics.median(r.p50_us for r in runs),
        "p99_us": statistics.median(r.p99_us for r in runs),
        "max_us": max(r.max_us for r in runs),
        "rps": round(statistics.median(r.rps for r in runs)),
        "cpu_us_per_req": round(statistics.median(r.cpu_us for r in runs), 1),
        "errors": sum(r.errors for r in runs),
    }


def _derive(mix: dict[str, Any]) -> None:
    targets = mix["targets"]
    direct = targets["direct"]
    for name, t in targets.items():
        if name == "direct" or "skipped" in t:
            continue
        for c in ("c1", "c32"):
            t[c]["added_p50_us"] = round(t[c]["p50_us"] - direct[c]["p50_us"], 1)
            t[c]["added_p99_us"] = round(t[c]["p99_us"] - direct[c]["p99_us"], 1)
    ratios: dict[str, float] = {}
    ours = targets.get("kvroute", {})
    two = targets.get("kvroute-2p", {})
    for peer in ("sglang-router", "vllm-router"):
        theirs = targets.get(peer, {})
        if "c1" not in theirs:
            continue
        if "c1" in ours:
            # > 1: kvroute adds more latency than the peer / serves more requests per second
            ratios[f"added_p50_c1_vs_{peer}"] = round(
                ours["c1"]["added_p50_us"] / max(theirs["c1"]["added_p50_us"], 1.0), 2
            )
            ratios[f"rps_c32_vs_{peer}"] = round(
                ours["c32"]["rps"] / max(theirs["c32"]["rps"], 1), 2
            )
        if "c1" in two:  # --processes 2
            ratios[f"2p_rps_c32_vs_{peer}"] = round(
                two["c32"]["rps"] / max(theirs["c32"]["rps"], 1), 2
            )
    mix["ratios"] = ratios


def _print(results: dict[str, Any]) -> None:
    for name, rss in results.get("rss_mb", {}).items():
        print(f"{name}: resident memory per serving process {rss} MB")
    for name, mix in results["by_prompts"].items():
        f = mix["tokenizer"]
        tail = (
            f"; new tail {f['tail_tokens']} tokens: {f['tail_encode_cpu_us']:.0f} us"
            if "tail_tokens" in f
            else ""
        )
        print(
            f"\n== prompts: {name} (~{f['tokens']} tokens; the tokenizer alone: encode "
            f"{f['encode_cpu_us']:.0f} us CPU, encode_batch_fast {f['encode_fast_cpu_us']:.0f} "
            f"us{tail})"
        )
        _print_mix(mix)


def _print_mix(mix: dict[str, Any]) -> None:
    print(
        f"{'target':<15} {'c1 p50':>9} {'c1 p99':>9} {'added p50':>10} {'c1 req/s':>9} "
        f"{'c32 p50':>9} {'c32 req/s':>10} {'CPU/req c1':>11} {'c32':>8} {'errors':>7}"
    )
    for name, t in mix["targets"].items():
        if "skipped" in t:
            print(f"{name:<15} skipped: {t['skipped']}")
            continue
        c1, c32 = t["c1"], t["c32"]
        added = f"{c1.get('added_p50_us', 0):.0f}us" if name != "direct" else "-"
        print(
            f"{name:<15} {c1['p50_us']:>7.0f}us {c1['p99_us']:>7.0f}us {added:>10} "
            f"{c1['rps']:>9} {c32['p50_us']:>7.0f}us {c32['rps']:>10} "
            f"{c1['cpu_us_per_req']:>9.0f}us {c32['cpu_us_per_req']:>6.0f}us "
            f"{c1['errors'] + c32['errors']:>7}"
        )
        if "c1_long" in t:
            lg = t["c1_long"]
            print(
                f"{'':<15} c=1 over {lg['seconds']} s: p50 {lg['p50_us']:.0f}us, p99 "
                f"{lg['p99_us']:.0f}us, max {lg['max_us']:.0f}us ({lg['requests']} requests)"
            )
    if mix["ratios"]:
        print("ratios:", json.dumps(mix["ratios"]))
