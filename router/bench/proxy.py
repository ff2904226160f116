"""`kvroute bench proxy`: what a router adds on top of a fast fake OpenAI backend.

The backend (router.bench.backend, its own process) is reached directly, through kvroute
(kv policy, tokenizing a ~2k-token prompt with the model's tokenizer), and through the peer
routers when they are installed; wrk drives each at concurrency 1 and 32. Reported: p50/p99
latency, added latency over direct, requests/s, and ratios against the peers. Medians over
`--repeat` runs: the machine is shared and noisy.
"""

from __future__ import annotations

import contextlib
import json
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
from router.procs import RouterProcess, free_port
from router.svgplot import bar_chart
from router.textgen import filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

MODEL = "kvroute-sim"


@dataclass
class Run:
    p50_us: float
    p99_us: float
    rps: float
    errors: int


def make_prompt(tokens: int = 2000) -> str:
    return filler(LocalTokenizer(PACKAGED_TOKENIZER), tokens, random.Random(3))


def write_lua(folder: Path, prompt: str) -> Path:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    path = folder / "post.lua"
    path.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body)}\n"
    )
    return path


_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def _latency(text: str, pct: str) -> float:
    m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        raise RuntimeError(f"wrk output has no {pct}% line:\n{text}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, lua: Path, conns: int, seconds: int) -> Run:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(lua), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    return Run(_latency(out, "50"), _latency(out, "99"), rps, errors)


@contextlib.contextmanager
def backend(ports: list[int]) -> Iterator[None]:
    cmd = [sys.executable, "-m", "router.bench.backend"]
    for p in ports:
        cmd += ["--port", str(p)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # it prints its ports once listening
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)


@contextlib.contextmanager
def kvroute_target(workers: list[str]) -> Iterator[str]:
    with RouterProcess(workers, tokenizer=PACKAGED_TOKENIZER) as router:
        yield router.url


def sglang_target(workers: list[str]) -> Any | None:
    binary = peer_bin("sglang-router")
    if binary is None:
        return None
    port = free_port()
    cmd = sglang_command(binary, port, workers, "cache_aware")
    return child(cmd, f"http://127.0.0.1:{port}", "/readiness")


def vllm_router_target(workers: list[str]) -> Any | None:
    binary = peer_bin("vllm-router")
    if binary is None:
        return None
    port = free_port()
    cmd = vllm_router_command(binary, port, workers, "cache_aware")
    return child(cmd, f"http://127.0.0.1:{port}", "/readiness")


TARGETS: dict[str, Callable[[list[str]], Any]] = {
    "kvroute": kvroute_target,
    "sglang-router": sglang_target,
    "vllm-router": vllm_router_target,
}


def run(
    json_path: Path | None,
    seconds: int = 5,
    repeat: int = 3,
    only: list[str] | None = None,
    plot_path: Path | None = None,
) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("kvroute bench proxy needs wrk (apt-get install wrk)")
    ports = [free_port(), free_port()]
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    lua = write_lua(tmp, make_prompt())
    results: dict[str, Any] = {"seconds": seconds, "repeat": repeat, "targets": {}}
    with backend(ports):
        results["targets"]["direct"] = _measure(workers[0], lua, seconds, repeat)
        for name, factory in TARGETS.items():
            if only and name not in only:
                continue
            target = factory(workers)
            if target is None:
                results["targets"][name] = {"skipped": "not installed"}
                continue
            with target as url:
                results["targets"][name] = _measure(url, lua, seconds, repeat)
    _derive(results)
    _print(results)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.write_text(plot(results))
        print(f"wrote {plot_path}")
    return results


def plot(results: dict[str, Any]) -> str:
    series = {
        name: {
            "added p50 c=1 (us)": t["c1"].get("added_p50_us", 0.0),
            "added p99 c=1 (us)": t["c1"].get("added_p99_us", 0.0),
            "req/s c=32": float(t["c32"]["rps"]),
        }
        for name, t in results["targets"].items()
        if name != "direct" and "skipped" not in t
    }
    return bar_chart(
        "Proxy overhead over a fast fake backend (~2k-token prompt)",
        series,
        "latency added over direct access (lower is better); req/s at 32 connections "
        "(higher is better)",
    )


def _measure(url: str, lua: Path, seconds: int, repeat: int) -> dict[str, Any]:
    target = f"{url}/v1/completions"
    wrk(target, lua, 1, 1)  # warm-up: connections, caches
    out: dict[str, Any] = {}
    for conns in (1, 32):
        runs = [wrk(target, lua, conns, seconds) for _ in range(repeat)]
        out[f"c{conns}"] = {
            "p50_us": statistics.median(r.p50_us for r in runs),
            "p99_us": statistics.median(r.p99_us for r in runs),
            "rps": round(statistics.median(r.rps for r in runs)),
            "errors": sum(r.errors for r in runs),
        }
    return out


def _derive(results: dict[str, Any]) -> None:
    targets = results["targets"]
    direct = targets["direct"]
    for name, t in targets.items():
        if name == "direct" or "skipped" in t:
            continue
        for c in ("c1", "c32"):
            t[c]["added_p50_us"] = round(t[c]["p50_us"] - direct[c]["p50_us"], 1)
            t[c]["added_p99_us"] = round(t[c]["p99_us"] - direct[c]["p99_us"], 1)
    ratios: dict[str, float] = {}
    ours = targets.get("kvroute", {})
    for peer in ("sglang-router", "vllm-router"):
        theirs = targets.get(peer, {})
        if "c1" not in ours or "c1" not in theirs:
            continue
        # > 1: kvroute adds more latency than the peer / serves more requests per second
        ratios[f"added_p50_c1_vs_{peer}"] = round(
            ours["c1"]["added_p50_us"] / max(theirs["c1"]["added_p50_us"], 1.0), 2
        )
        ratios[f"rps_c32_vs_{peer}"] = round(ours["c32"]["rps"] / max(theirs["c32"]["rps"], 1), 2)
    results["ratios"] = ratios


def _print(results: dict[str, Any]) -> None:
    print(
        f"{'target':<15} {'c1 p50':>9} {'c1 p99':>9} {'added p50':>10} {'c1 req/s':>9} "
        f"{'c32 p50':>9} {'c32 req/s':>10} {'errors':>7}"
    )
    for name, t in results["targets"].items():
        if "skipped" in t:
            print(f"{name:<15} skipped: {t['skipped']}")
            continue
        c1, c32 = t["c1"], t["c32"]
        added = f"{c1.get('added_p50_us', 0):.0f}us" if name != "direct" else "-"
        print(
            f"{name:<15} {c1['p50_us']:>7.0f}us {c1['p99_us']:>7.0f}us {added:>10} "
            f"{c1['rps']:>9} {c32['p50_us']:>7.0f}us {c32['rps']:>10} "
            f"{c1['errors'] + c32['errors']:>7}"
        )
    if results["ratios"]:
        print("ratios:", json.dumps(results["ratios"]))
