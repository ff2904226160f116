"""router-check against a fleet with a data-parallel worker: real `kvroute sim` processes (one
with --data-parallel-size 2, whose ranks the router lists as host:port#dp0 and #dp1) behind a
real `kvroute serve` child process, on loopback. Every check passes on that healthy fleet, and
each check about the worker speaks for all of its ranks. And an empty admin token is refused
before anything is dialled."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.sim.fleet import stop_process
from router.check.checks_events import PROBE_BLOCKS
from router.check.cli import main
from router.check.httpio import Fetched
from router.check.model import Result, Status, combine, failed, passed, warned
from router.check.runner import NAMES
from router.check.workerfacts import WorkerFacts, group_workers
from router.procs import RouterProcess, free_port
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)

START_S = 20.0
PER_WORKER = {
    "worker",
    "prefix-caching",
    "events-config",
    "events-endpoint",
    "events-flowing",
    "block-size",
    "tokenizer",
    "index",
}


@contextmanager
def sim(folder: Path, name: str, *args: str) -> Iterator[dict[str, Any]]:
    """`kvroute sim ARGS` as a child process; yields the JSON line it prints once it serves,
    and stops it by its PID on the way out."""
    out, log = folder / f"{name}.json", folder / f"{name}.log"
    with out.open("wb") as stdout, log.open("wb") as stderr:
        cmd = [sys.executable, "-m", "router.cli", "sim", "--name", name, *args]
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + START_S
        while not out.read_text().endswith("\n"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvroute sim {name} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield json.loads(out.read_text().splitlines()[0])
    finally:
        stop_process(proc)


def wait_for_ranks(router: RouterProcess, endpoints: int) -> list[dict[str, Any]]:
    """The router's /health once it lists every endpoint (a data-parallel worker's ranks
    appear once the router has asked it for its publishers), each ok."""
    deadline = time.monotonic() + START_S
    while True:
        doc = httpx.get(f"{router.url}/health", timeout=2).json()
        workers = doc.get("workers") or []
        if len(workers) == endpoints and all(w.get("status") == "ok" for w in workers):
            return list(workers)
        assert time.monotonic() < deadline, (doc, router.log())
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, str, str]]:
    """A router over a data-parallel worker (2 ranks) and a plain one: (router, the
    data-parallel worker's URL, the other's)."""
    folder = tmp_path_factory.mktemp("dp-fleet")
    with ExitStack() as stack:
        ranked = stack.enter_context(sim(folder, "ranked", "--data-parallel-size", "2"))
        plain = stack.enter_context(sim(folder, "plain"))
        urls = [ranked["url"], plain["url"]]
        router = stack.enter_context(RouterProcess(urls, tokenizer=PACKAGED_TOKENIZER))
        health = wait_for_ranks(router, 3)
        name = ranked["url"].removeprefix("http://")
        assert {w["name"] for w in health if w["url"] == ranked["url"]} == {
            f"{name}#dp0",
            f"{name}#dp1",
        }
        yield router, ranked["url"], plain["url"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--timeout", "3", "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_worker(doc: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"] if c.get("worker") == name}


def test_every_check_passes_on_a_fleet_with_a_data_parallel_worker(
    fleet: tuple[RouterProcess, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    router, ranked, plain = fleet
    code, doc = run(capsys, "--router", router.url, "--admin-token", router.admin_token)
    failing = [c for c in doc["checks"] if c["status"] != "PASS"]
    assert code == 0 and doc["ok"] is True and not failing, failing
    assert [c["name"] for c in doc["checks"] if "worker" not in c] == [
        n for n in NAMES if n not in PER_WORKER
    ]
    name, other = ranked.removeprefix("http://"), plain.removeprefix("http://")
    # the data-parallel worker is checked once, its ranks inside each check
    for worker in (name, other):
        assert set(by_worker(doc, worker)) == PER_WORKER
    assert {c.get("worker") for c in doc["checks"]} == {None, name, other}
    mine = by_worker(doc, name)
    assert "router dp0: available" in mine["worker"]["evidence"]
    assert "router dp1: available" in mine["worker"]["evidence"]
    for check in ("events-endpoint", "events-flowing"):
        assert "dp0: " in mine[check]["evidence"] and "dp1: " in mine[check]["evidence"]
    # each rank served its own probe and published it; the router indexed both
    flowing = mine["events-flowing"]["data"]
    assert flowing["probe_blocks_seen"] == flowing["probe_blocks"] >= 2 * PROBE_BLOCKS
    assert mine["index"]["data"]["index"] >= flowing["probe_blocks"]
    assert "router 16" in mine["block-size"]["evidence"]
    router_check = next(c for c in doc["checks"] if c["name"] == "router")
    assert "2 workers listed (3 endpoints" in router_check["evidence"]


def test_the_data_parallel_worker_named_with_worker_passes(
    fleet: tuple[RouterProcess, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--worker URL, as the router was given it, matches the router's entries of its ranks."""
    router, ranked, plain = fleet
    argv = ["--router", router.url, "--admin-token", router.admin_token]
    argv += ["--worker", ranked, "--worker", plain + "/", "--skip", "repeat-prefix,load-spread"]
    code, doc = run(capsys, *argv)
    failing = [c for c in doc["checks"] if c["status"] != "PASS"]
    assert code == 0 and not failing, failing
    assert len(by_worker(doc, ranked.removeprefix("http://"))) == len(PER_WORKER)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_admin_token_is_refused_up_front(
    how: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty Secret gives an empty token: refused before anything is dialled (the router
    here is a closed port), naming the fix, not read as no token at all."""
    argv = ["--router", f"http://127.0.0.1:{free_port()}"]
    if how == "flag":
        argv += ["--admin-token", ""]
    else:
        monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", "")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("router-check: --admin-token is empty")
    assert "the same non-empty value kvroute serve --admin-token runs with" in captured.err


# ---- pieces ---------------------------------------------------------------------------------

RANKED = [
    {
        "name": "a:1#dp1",
        "url": "http://a:1",
        "data_parallel_rank": 1,
        "events_endpoint": "tcp://a:6",
    },
    {
        "name": "a:1#dp0",
        "url": "http://a:1",
        "data_parallel_rank": 0,
        "events_endpoint": "tcp://a:5",
    },
    {"name": "b:2", "url": "http://b:2", "events_endpoint": "tcp://b:5"},
]


@pytest.mark.parametrize(
    ("urls", "grouped"),
    [
        (
            ["http://a:1", "http://a:1", "http://b:2"],
            {"a:1": ["a:1#dp0", "a:1#dp1"], "b:2": ["b:2"]},
        ),
        (["http://a:1/", "http://b:2"], {"a:1": ["a:1#dp0", "a:1#dp1"], "b:2": ["b:2"]}),
        (["http://c:3"], {"c:3": []}),
    ],
    ids=["router-list", "worker-flags", "unlisted"],
)
def test_a_worker_gathers_the_entries_of_all_its_ranks(
    urls: list[str], grouped: dict[str, list[str]]
) -> None:
    reports = [{"name": "a:1#dp1", "status": "ok"}]
    workers = group_workers(urls, RANKED, reports)
    assert {w.name: [r.name for r in w.ranks] for w in workers} == grouped
    ranks = {r.name: r for w in workers for r in w.ranks}
    if "a:1#dp0" in ranks:  # each rank carries its own /health report
        assert (ranks["a:1#dp0"].report, ranks["a:1#dp1"].report) == (None, reports[0])


def test_each_rank_is_paired_with_its_own_advertised_publisher() -> None:
    (w,) = group_workers(["http://a:1"], RANKED, [])
    sources = {str(r): {"endpoint": f"tcp://*:{5 + r}", "replay_endpoint": None} for r in (1, 0)}
    w.sources = Fetched("http://a:1/kv_event_sources", 200, sources)
    pubs = [
        (p.name, p.rank, p.router, p.advertised and p.advertised.endpoint) for p in w.publishers
    ]
    assert pubs == [
        ("a:1#dp0", 0, "tcp://a:5", "tcp://a:5"),
        ("a:1#dp1", 1, "tcp://a:6", "tcp://a:6"),
    ]
    unlisted = WorkerFacts("a:1", "http://a:1", sources=w.sources)
    assert [(p.name, p.rank, p.router) for p in unlisted.publishers] == [
        ("a:1#dp0", 0, None),
        ("a:1#dp1", 1, None),
    ]


@pytest.mark.parametrize(
    ("parts", "status", "fix"),
    [
        ([("dp0", passed("x", "a")), ("dp1", passed("x", "b"))], Status.PASS, None),
        ([("dp0", passed("x", "a")), ("dp1", failed("x", "b", "do X"))], Status.FAIL, "dp1: do X"),
        (
            [("dp0", failed("x", "a", "do X")), ("dp1", failed("x", "b", "do X"))],
            Status.FAIL,
            "dp0, dp1: do X",
        ),
        ([("dp0", warned("x", "a")), ("dp1", passed("x", "b"))], Status.WARN, None),
    ],
    ids=["all-pass", "one-rank-fails", "same-fix-once", "warn"],
)
def test_a_check_over_ranks_takes_the_worst_and_names_the_failing_ranks(
    parts: list[tuple[str, Result]], status: Status, fix: str | None
) -> None:
    r = combine("x", parts, "a:1")
    assert (r.status, r.fix, r.worker) == (status, fix, "a:1")
    assert r.evidence == "; ".join(f"{label}: {p.evidence}" for label, p in parts)
