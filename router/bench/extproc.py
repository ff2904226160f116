"""`kvroute bench extproc`: what a picker behind Envoy costs, against the fast fake backend.

Paths, each driven by wrk at concurrency 1 and 32 with a ~2k-token shared prefix and a
distinct tail per request:
  direct                    wrk -> backend
  envoy                     Envoy alone (round robin)
  envoy+ref[-duplex|-x2|-lean]  Envoy + the do-nothing reference picker (router.bench.
                            extproc_ref: parses the body, picks at random), BUFFERED or
                            FULL_DUPLEX_STREAMED bodies, one or two picker processes, response
                            bodies read or skipped (lean: `envoy-config --response-body skip`)
  envoy+kvroute[...]        the same with `kvroute serve --ext-proc-port` (the real decision)
  kvroute-proxy             kvroute's own HTTP proxy
Reported per path: p50/p99, latency added over direct, req/s, and each picker's CPU per
request (utime+stime from /proc/PID/stat over the run). Medians over --repeat runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from router.bench.extproc_lua import write_shared_prefix_lua
from router.bench.proxy import Target as WrkTarget
from router.bench.proxy import backend, wrk
from router.envoy.bootstrap import Endpoint, GatewayConfig
from router.envoy.process import INSTALL_HINT, EnvoyProcess, envoy_binary
from router.procs import RouterProcess, free_port
from router.svgplot import bar_chart
from router.tokenize import PACKAGED_TOKENIZER

Target = tuple[str, list[int]]  # (base URL, PIDs whose CPU is the picker's)
PathFactory = Callable[[list[Endpoint]], contextlib.AbstractContextManager[Target]]
_CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


@contextlib.contextmanager
def _envoy(
    workers: list[Endpoint], pickers: list[Endpoint], body_mode: str, response_body: str = "read"
) -> Iterator[str]:
    cfg = GatewayConfig(
        response_body=response_body,
        listen_port=free_port(),
        listen_host="127.0.0.1",
        ext_proc=pickers[0] if pickers else None,
        more_pickers=tuple(pickers[1:]),
        workers=tuple(workers),
        body_mode=body_mode,
        admin_port=free_port(),
    )
    with EnvoyProcess(cfg) as envoy:
        yield envoy.url


@contextlib.contextmanager
def _ref_pickers(workers: list[Endpoint], n: int) -> Iterator[list[tuple[Endpoint, int]]]:
    endpoints = ",".join(f"{w.host}:{w.port}" for w in workers)
    procs = []
    try:
        for _ in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "router.bench.extproc_ref", "--port", str(port)]
            proc = subprocess.Popen([*cmd, "--endpoints", endpoints], stdout=subprocess.PIPE)
            procs.append((Endpoint("127.0.0.1", port), proc))
            assert proc.stdout is not None
            proc.stdout.readline()  # it prints its port once listening
        yield [(ep, p.pid) for ep, p in procs]
    finally:
        for _, p in procs:
            p.terminate()
            p.wait(5)
            if p.stdout is not None:
                p.stdout.close()


def ref_path(body_mode: str, n: int, response_body: str = "read") -> PathFactory:
    @contextlib.contextmanager
    def make(workers: list[Endpoint]) -> Iterator[Target]:
        with (
            _ref_pickers(workers, n) as pickers,
            _envoy(workers, [ep for ep, _ in pickers], body_mode, response_body) as url,
        ):
            yield url, [pid for _, pid in pickers]

    return make


def kvroute_has_picker() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--help"], capture_output=True, text=True
    ).stdout
    return "--ext-proc-port" in out


def kvroute_path(body_mode: str, n: int, response_body: str = "read") -> PathFactory:
    @contextlib.contextmanager
    def make(workers: list[Endpoint]) -> Iterator[Target]:
        urls = [f"http://{w.host}:{w.port}" for w in workers]
        with contextlib.ExitStack() as stack:
            pickers, pids = [], []
            for _ in range(n):
                port = free_port()
                extra = ["--ext-proc-port", str(port), "--ext-proc-host", "127.0.0.1"]
                router = stack.enter_context(
                    RouterProcess(urls, tokenizer=PACKAGED_TOKENIZER, extra=extra)
                )
                pickers.append(Endpoint("127.0.0.1", port))
                pids.append(router.proc.pid)
            url = stack.enter_context(_envoy(workers, pickers, body_mode, response_body))
            yield url, pids

    return make


@contextlib.contextmanager
def direct_path(workers: list[Endpoint]) -> Iterator[Target]:
    yield f"http://{workers[0].host}:{workers[0].port}", []


@contextlib.contextmanager
def envoy_path(workers: list[Endpoint]) -> Iterator[Target]:
    with _envoy(workers, [], "buffered") as url:
        yield url, []


@contextlib.contextmanager
def proxy_path(workers: list[Endpoint]) -> Iterator[Target]:
    urls = [f"http://{w.host}:{w.port}" for w in workers]
    with RouterProcess(urls, tokenizer=PACKAGED_TOKENIZER) as router:
        yield router.url, [router.proc.pid]


PATHS: dict[str, PathFactory] = {
    "direct": direct_path,
    "envoy": envoy_path,
    "envoy+ref": ref_path("buffered", 1),
    "envoy+ref-duplex": ref_path("full-duplex", 1),
    "envoy+ref-x2": ref_path("buffered", 2),
    "envoy+ref-lean": ref_path("buffered", 1, "skip"),
    "envoy+kvroute": kvroute_path("buffered", 1),
    "envoy+kvroute-duplex": kvroute_path("full-duplex", 1),
    "envoy+kvroute-x2": kvroute_path("buffered", 2),
    "envoy+kvroute-lean": kvroute_path("buffered", 1, "skip"),
    "kvroute-proxy": proxy_path,
}
NEEDS_KVROUTE_PICKER = {n for n in PATHS if n.startswith("envoy+kvroute")}


def measure(url: str, lua: Path, pids: list[int], seconds: int, repeat: int) -> dict[str, Any]:
    # the picker's CPU is summed over `pids` here; wrk's own reading is of the first one
    target = WrkTarget(url, pids[0] if pids else os.getpid())
    wrk(target, lua, 1, 1)  # warm-up: connections, caches
    out: dict[str, Any] = {}
    for conns in (1, 32):
        runs = []
        for _ in range(repeat):
            before = sum(cpu_s(p) for p in pids)
            run = wrk(target, lua, conns, seconds)
            spent = sum(cpu_s(p) for p in pids) - before
            runs.append((run, spent * 1e6 / max(run.rps * seconds, 1)))
        out[f"c{conns}"] = {
            "p50_us": statistics.median(r.p50_us for r, _ in runs),
            "p99_us": statistics.median(r.p99_us for r, _ in runs),
            "rps": round(statistics.median(r.rps for r, _ in runs)),
            "errors": sum(r.errors for r, _ in runs),
            "cpu_us_per_req": round(statistics.median(c for _, c in runs), 1) if pids else None,
        }
    return out


def run(
    json_path: Path | None,
    *,
    seconds: int = 5,
    repeat: int = 3,
    only: list[str] | None = None,
    plot_path: Path | None = None,
) -> dict[str, Any]:
    if envoy_binary() is None:
        raise SystemExit(f"kvroute bench extproc needs Envoy: {INSTALL_HINT}")
    ports = [free_port(), free_port()]
    workers = [Endpoint("127.0.0.1", p) for p in ports]
    has_picker = kvroute_has_picker()
    results: dict[str, Any] = {"seconds": seconds, "repeat": repeat, "paths": {}}
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-") as scratch, backend(ports):
        lua = write_shared_prefix_lua(Path(scratch))
        for name, factory in PATHS.items():
            if only and name not in only and name != "direct":
                continue
            if name in NEEDS_KVROUTE_PICKER and not has_picker:
                results["paths"][name] = {"skipped": "kvroute serve has no --ext-proc-port yet"}
                continue
            with factory(workers) as (url, pids):
                results["paths"][name] = measure(url, lua, pids, seconds, repeat)
            print(f"{name}: {json.dumps(results['paths'][name])}", flush=True)
    derive(results)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.write_text(plot(results))
        print(f"wrote {plot_path}")
    return results


def derive(results: dict[str, Any]) -> None:
    """Added latency over direct for every path, and each picker path over Envoy alone."""
    paths = results["paths"]
    direct, envoy = paths["direct"], paths.get("envoy", {})
    for name, p in paths.items():
        if "skipped" in p or name == "direct":
            continue
        for c in ("c1", "c32"):
            p[c]["added_p50_us"] = round(p[c]["p50_us"] - direct[c]["p50_us"], 1)
            p[c]["added_p99_us"] = round(p[c]["p99_us"] - direct[c]["p99_us"], 1)
        if name.startswith("envoy+") and "c1" in envoy:
            p["c1"]["over_envoy_p50_us"] = round(p["c1"]["p50_us"] - envoy["c1"]["p50_us"], 1)
    ref, ours = paths.get("envoy+ref", {}), paths.get("envoy+kvroute", {})
    if "c1" in ref and "c1" in ours:
        results["kvroute_vs_reference_added_p50"] = round(
            ours["c1"]["added_p50_us"] / max(ref["c1"]["added_p50_us"], 1.0), 2
        )


def plot(results: dict[str, Any]) -> str:
    series = {
        name: {
            "added p50 c=1 (us)": p["c1"].get("added_p50_us", 0.0),
            "picker CPU/req (us)": p["c1"].get("cpu_us_per_req") or 0.0,
            "req/s c=32": float(p["c32"]["rps"]),
        }
        for name, p in results["paths"].items()
        if name != "direct" and "skipped" not in p
    }
    return bar_chart(
        "Envoy ext_proc pickers over a fast fake backend (2k shared prefix, distinct tails)",
        series,
        "latency added over direct access, picker CPU per request (lower is better); "
        "req/s at 32 connections (higher is better)",
    )
