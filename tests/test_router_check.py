"""router-check against a simulated fleet behind a real in-process router (loopback, real
uvicorn, real ZMQ): every check passes on a healthy fleet, and each planted fault fails the
right check, naming the worker and the fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import Fleet, fleet_configs, run_fleet
from router.app import RouterApp
from router.check.checks_agree import router_samples
from router.check.checks_gateway import GatewayOptions, run_gateway_checks
from router.check.cli import main
from router.check.context import Options, UsageError
from router.check.model import Finding, Report, Result, Status, failed, passed, verdict, warned
from router.check.render import human
from router.check.runner import NAMES, run_checks
from router.check.zmqprobe import Observation
from router.core.config import Config, WorkerConfig
from router.procs import free_port, serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)

BASE = SimConfig(block_size=16, kv_blocks=512, topic="kv-events")
ENGINE_ONLY = frozenset({"repeat-prefix", "load-spread"})  # skipped where they prove nothing
Workers = Callable[[list[str]], tuple[WorkerConfig, ...]]


@dataclass
class Setup:
    fleet: Fleet
    url: str

    def name(self, i: int) -> str:
        return f"127.0.0.1:{self.fleet.workers[i].port}"


@asynccontextmanager
async def fleet_and_router(
    *,
    configs: Sequence[SimConfig] | None = None,
    no_events_on: tuple[int, ...] = (),
    workers: Workers | None = None,
    **config: Any,
) -> AsyncIterator[Setup]:
    configs = configs or fleet_configs(2, BASE, no_events_on)
    async with run_fleet(configs=configs) as fleet:
        cfg = Config(
            workers=workers(fleet.urls) if workers else tuple(WorkerConfig(u) for u in fleet.urls),
            tokenizer=config.pop("tokenizer", str(PACKAGED_TOKENIZER)),
            scrape_interval_s=0.2,
            health_check_interval_s=0.2,
            event_grace_s=1.0,
            admin_insecure=config.pop("admin_insecure", True),
            **config,
        )
        async with serve_in_process(RouterApp(cfg)) as url:
            yield Setup(fleet, url)


async def check(url: str, skip: frozenset[str] = ENGINE_ONLY, **opts: Any) -> Report:
    return await run_checks(Options(router=url, timeout_s=2.0, skip=skip, **opts))


def result(report: Report, name: str, worker: str | None = None) -> Result:
    found = [r for r in report.results if r.name == name and r.worker == worker]
    assert len(found) == 1, (name, worker, human(report))
    return found[0]


def assert_fails(report: Report, name: str, worker: str | None, *fix_words: str) -> Result:
    r = result(report, name, worker)
    assert r.status is Status.FAIL, human(report)
    assert r.fix is not None and all(w in r.fix for w in fix_words), r.fix
    return r


async def cli(*argv: str) -> int:
    """The console entry point, on its own thread and event loop (the router runs on ours)."""
    return await asyncio.to_thread(main, list(argv))


# ---- a healthy fleet ------------------------------------------------------------------------


async def test_every_check_passes_on_a_healthy_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    async with fleet_and_router() as s:
        report = await check(s.url, skip=frozenset())
        assert [r.status for r in report.results] == [Status.PASS] * len(report.results), human(
            report
        )
        per_worker = {r.name for r in report.results if r.worker is not None}
        assert {r.name for r in report.results} == set(NAMES)
        for name in per_worker:
            assert {r.worker for r in report.results if r.name == name} == {s.name(0), s.name(1)}
        flowing = result(report, "events-flowing", s.name(0))
        assert flowing.data["probe_blocks_seen"] == flowing.data["probe_blocks"] >= 4
        repeat = result(report, "repeat-prefix")
        assert repeat.data["speedup"] >= 1.5 and "cached tokens" in repeat.evidence
        assert (
            await cli("--router", s.url, "--timeout", "2", "--json", "--skip", "load-spread") == 0
        )
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and set(doc) == {"checks", "ok"}
    assert {c["name"] for c in doc["checks"]} == set(NAMES) - {"load-spread"}
    for c in doc["checks"]:
        assert c["status"] == "PASS" and c["evidence"] and "fix" not in c
        assert set(c) <= {"name", "status", "worker", "evidence", "fix", "data"}
    assert any(c.get("worker") == s.name(1) for c in doc["checks"])


async def test_a_fleet_behind_an_api_key_passes_with_the_key_and_only_with_it() -> None:
    """Workers started with vLLM's --api-key: router-check sends the key (--api-key) on its
    calls to them and to the router's /v1/models and traffic, never to /admin."""
    keyed = [BASE.replace(api_key="s3cret", port=0) for _ in range(2)]
    async with fleet_and_router(configs=keyed, worker_api_key="s3cret") as s:
        report = await check(s.url, api_key="s3cret")
        assert all(r.status is Status.PASS for r in report.results), human(report)
        without = await check(s.url)
        assert not without.ok


# ---- planted faults -------------------------------------------------------------------------


async def test_worker_without_events_fails_naming_it_and_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with fleet_and_router(no_events_on=(1,)) as s:
        report = await check(s.url)
        silent, fine = s.name(1), s.name(0)
        assert_fails(report, "events-config", silent, "--kv-events-config")
        assert_fails(report, "events-flowing", silent, "--kv-events-config")
        assert_fails(report, "index", silent, "publish KV events")
        assert result(report, "events-endpoint", silent).status is Status.WARN  # nothing to dial
        for name in ("events-config", "events-endpoint", "events-flowing", "index"):
            assert result(report, name, fine).status is Status.PASS, human(report)
        assert await cli("--router", s.url, "--timeout", "2", "--skip", "repeat-prefix") == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("FAIL  events-config"))
    assert silent in line and "publishes no KV events" in line
    assert "fix: start vLLM with --kv-events-config" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED:")


@pytest.mark.parametrize(
    ("where", "failing"),
    [("router", (0, 1)), ("worker", (1,))],
    ids=["router-wide-block-size", "per-worker-block-size"],
)
async def test_block_size_mismatch_fails_with_the_sizes(
    where: str, failing: tuple[int, ...]
) -> None:
    def workers(urls: list[str]) -> tuple[WorkerConfig, ...]:
        return (WorkerConfig(urls[0]), WorkerConfig(urls[1], block_size=32))

    config: dict[str, Any] = {"block_size": 32} if where == "router" else {"workers": workers}
    async with fleet_and_router(**config) as s:
        report = await check(s.url)
        for i in (0, 1):
            r = result(report, "block-size", s.name(i))
            if i in failing:
                assert_fails(report, "block-size", s.name(i), "block_size", "--block-size 32")
                assert "router 32" in r.evidence and "engine cache_config 16" in r.evidence
            else:
                assert r.status is Status.PASS, human(report)


def other_tokenizer(folder: Path) -> Path:
    """The packaged tokenizer without its BOS: completions and chats both lose one token."""
    folder.mkdir()
    tok = json.loads((PACKAGED_TOKENIZER / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((PACKAGED_TOKENIZER / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("{{ bos_token }}", "")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


async def test_router_with_another_tokenizer_fails_tokenizer_parity(tmp_path: Path) -> None:
    async with fleet_and_router(tokenizer=str(other_tokenizer(tmp_path / "tok"))) as s:
        report = await check(s.url)
        for i in (0, 1):
            r = assert_fails(report, "tokenizer", s.name(i), "--tokenizer")
            assert "completion: the router makes" in r.evidence
            assert "chat: the router makes" in r.evidence


def swapped_specials(folder: Path) -> Path:
    """The packaged tokenizer with the ids of <s> and </s> swapped: the same token counts,
    different ids, which only an id-by-id comparison (or the router's own probe) catches."""
    folder.mkdir()
    tok = json.loads((PACKAGED_TOKENIZER / "tokenizer.json").read_text())
    swap = {"<s>": 1, "</s>": 0}
    for added in tok["added_tokens"]:
        added["id"] = swap.get(added["content"], added["id"])
    tok["model"]["vocab"].update(swap)
    tok["post_processor"]["special_tokens"]["<s>"]["ids"] = [1]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_text((PACKAGED_TOKENIZER / name).read_text())
    return folder


async def test_same_counts_but_other_token_ids_still_fail(tmp_path: Path) -> None:
    async with fleet_and_router(tokenizer=str(swapped_specials(tmp_path / "tok"))) as s:
        report = await check(s.url, skip=ENGINE_ONLY | {"events-flowing", "index"})
        r = assert_fails(report, "tokenizer", s.name(0), "--tokenizer")
        assert "tokenizer mismatch" in r.evidence or "first difference at 0" in r.evidence


async def test_prefix_caching_off_fails_naming_the_worker() -> None:
    configs = fleet_configs(2, BASE)
    configs[1] = configs[1].replace(enable_prefix_caching=False)
    async with fleet_and_router(configs=configs) as s:
        report = await check(s.url)
        assert_fails(report, "prefix-caching", s.name(1), "--enable-prefix-caching")
        assert_fails(report, "events-flowing", s.name(1), "--enable-prefix-caching")
        assert result(report, "prefix-caching", s.name(0)).status is Status.PASS


async def test_unreachable_event_endpoint_fails_with_the_right_endpoint() -> None:
    closed = f"tcp://127.0.0.1:{free_port()}"

    def workers(urls: list[str]) -> tuple[WorkerConfig, ...]:
        return (WorkerConfig(urls[0]), WorkerConfig(urls[1], events=closed))

    async with fleet_and_router(workers=workers) as s:
        report = await check(s.url)
        real = s.fleet.workers[1].events_endpoint
        assert real is not None
        r = assert_fails(report, "events-endpoint", s.name(1), f"events: {real}")
        assert closed in r.evidence and "does not answer" in r.evidence
        assert_fails(report, "index", s.name(1), closed)
        assert result(report, "events-endpoint", s.name(0)).status is Status.PASS


async def test_a_drained_worker_is_out_of_rotation_and_load_spread_skips_it() -> None:
    async with fleet_and_router() as s:
        drained, serving = s.name(0), s.name(1)
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{s.url}/admin/workers/{drained}/drain")
            assert resp.status_code == 200 and resp.json()["draining"] is True
        report = await check(s.url, skip=frozenset(NAMES) - {"router", "worker", "load-spread"})
        out = result(report, "worker", drained)
        assert out.status is Status.WARN and "router: available" not in out.evidence
        assert f"POST /admin/workers/{drained}/undrain" in out.evidence
        assert "router: available" in result(report, "worker", serving).evidence
        spread = result(report, "load-spread")
        assert spread.status is Status.WARN and f"{drained} draining" in spread.evidence
        assert "1 draining" in result(report, "router").evidence
        assert report.exit_code == 0, human(report)


# ---- what cannot run is a WARN, and the admin token -----------------------------------------


async def test_unreachable_worker_fails_and_its_other_checks_only_warn() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with fleet_and_router() as s:
        report = await check(s.url, workers=(s.fleet.urls[0], dead), skip=ENGINE_ONLY)
        gone = dead.removeprefix("http://")
        assert_fails(report, "worker", gone, "start the worker")
        assert_fails(report, "router", None, "--worker URL")  # it is not in the router's list
        others = [r for r in report.results if r.worker == gone and r.name != "worker"]
        assert others and {r.status for r in others} == {Status.WARN}
        assert result(report, "events-flowing", s.name(0)).status is Status.PASS
        not_a_router = await check(s.fleet.urls[0])  # a worker has no /admin/workers
        assert not_a_router.exit_code == 2 and "--worker" in (not_a_router.fatal or "")


async def test_admin_token_gates_the_worker_list_and_token_ids() -> None:
    async with fleet_and_router(admin_token="s3cret") as s:
        no_token = await check(s.url)
        assert no_token.exit_code == 2 and "--admin-token" in (no_token.fatal or "")
        urls = tuple(s.fleet.urls)
        blind = await check(s.url, workers=urls)
        tok = result(blind, "tokenizer", s.name(0))
        assert tok.status is Status.WARN and "--admin-token" in tok.evidence
        assert result(blind, "router").status is Status.WARN
        seeing = await check(s.url, admin_token="s3cret")
        assert result(seeing, "tokenizer", s.name(0)).status is Status.PASS, human(seeing)
        assert seeing.ok


# ---- exit codes and usage -------------------------------------------------------------------


async def test_unreachable_router_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert await cli("--router", url, "--timeout", "1", "--json") == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["checks"][0]["name"] == "router"
    assert doc["checks"][0]["status"] == "FAIL" and "kvroute serve" in doc["checks"][0]["fix"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--router", "localhost:8000"],
        ["--router", "http://127.0.0.1:1", "--skip", "no-such-check"],
        ["--router", "http://127.0.0.1:1", "--margin", "0.5"],
        ["--router", "http://127.0.0.1:1", "--timeout", "0"],
        ["--router", "http://127.0.0.1:1", "--worker", "not-a-url"],
        ["--router", "http://127.0.0.1:99999"],
        ["--gateway", "localhost:8080"],
        ["--gateway", "http://127.0.0.1:99999"],
        ["--gateway", "http://127.0.0.1:1", "--gateway-admin", "envoy:9901"],
        ["--gateway", "http://127.0.0.1:1", "--skip", "no-such-check"],
        ["--gateway", "http://127.0.0.1:1", "--timeout", "0"],
        ["--gateway", "http://127.0.0.1:1", "--pairs", "0"],
    ],
    ids=[
        "router-not-a-url",
        "unknown-skip",
        "margin-below-1",
        "zero-timeout",
        "bad-worker",
        "router-port-out-of-range",
        "gateway-not-a-url",
        "gateway-port-out-of-range",
        "gateway-admin-not-a-url",
        "gateway-only-unknown-skip",
        "gateway-only-zero-timeout",
        "gateway-only-no-pairs",
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("router-check: ")


async def test_an_unreachable_gateway_is_never_ok(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # a gateway check that cannot even finish reached nothing: the run stops there, exit 2
    stalled = await run_gateway_checks(GatewayOptions(dead, timeout_s=0))
    assert [(r.name, r.status) for r in stalled.results] == [("gateway", Status.FAIL)]
    assert stalled.exit_code == 2 and "cannot reach" in (stalled.fatal or "")
    async with fleet_and_router() as s:
        router_only = ",".join(n for n in NAMES if n != "router")
        argv = ["--router", s.url, "--gateway", dead, "--timeout", "2", "--skip", router_only]
        assert await cli(*argv) == 2
    out = capsys.readouterr().out
    assert "PASS  router " in out and f"FAIL  gateway  -  cannot reach {dead}" in out
    assert out.rstrip().splitlines()[-1].startswith("ERROR: cannot reach")


def test_missing_router_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_help_teaches_the_checks_and_exit_codes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.check", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    for name in NAMES:
        assert f"  {name} " in out
    assert "exit status" in out and "--admin-token" in out and "KVROUTE_ADMIN_TOKEN" in out


# ---- pieces ---------------------------------------------------------------------------------


def test_observation_matches_probe_blocks_by_token_ids() -> None:
    from engines.vllm.events import BlockStored, encode_batch

    seen = Observation()
    stored = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)
    seen.record([b"kv-events", (0).to_bytes(8, "big"), encode_batch(0.0, [stored])])
    seen.record([b"kv-events", (1).to_bytes(8, "big"), b"\x01garbage"])
    assert seen.coverage(list(range(10))) == (2, 2)  # the partial third block is not expected
    assert seen.coverage([0, 1, 2, 3, 9, 9, 9, 9]) == (1, 2)
    assert (seen.batches, seen.stored_events, seen.malformed) == (2, 1, 1)
    assert seen.topics == {"kv-events"} and seen.block_sizes == {4}


@pytest.mark.parametrize(
    ("findings", "status", "fix"),
    [
        ([], Status.PASS, None),
        ([Finding(Status.PASS, "fine")], Status.PASS, None),
        ([Finding(Status.WARN, "could not run")], Status.WARN, None),
        ([Finding(Status.WARN, "w"), Finding(Status.FAIL, "f", "do X")], Status.FAIL, "do X"),
        (
            [Finding(Status.FAIL, "a", "do X"), Finding(Status.FAIL, "b", "do X")],
            Status.FAIL,
            "do X",
        ),
    ],
    ids=["nothing", "pass", "warn", "worst-wins", "fixes-deduplicated"],
)
def test_verdict_takes_the_worst_finding(
    findings: list[Finding], status: Status, fix: str | None
) -> None:
    r = verdict("x", "base", findings, "w:1")
    assert (r.status, r.fix, r.worker) == (status, fix, "w:1")
    assert r.evidence.startswith("base")


def test_human_report_is_one_line_per_check_with_the_fix_below() -> None:
    report = Report("http://r:8000")
    report.results += [
        passed("router", "ok"),
        warned("tokenizer", "could not run", "w:1"),
        failed("events-config", "no events", "start vLLM with --kv-events-config", "w:2"),
    ]
    lines = human(report).splitlines()
    assert lines[1].split() == ["PASS", "router", "-", "ok"]
    assert lines[2].split()[:3] == ["WARN", "tokenizer", "w:1"]
    assert lines[3].startswith("FAIL  events-config  w:2") and lines[4].strip().startswith("fix:")
    assert lines[-1] == "FAILED: 1 failed, 1 warnings, 1 passed"
    assert report.exit_code == 1 and report.to_json()["ok"] is False


def test_router_samples_reads_one_workers_counters() -> None:
    text = "\n".join(
        [
            'kvroute_index_blocks{worker="a:1"} 7.0',
            'kvroute_index_blocks{worker="b:2"} 3.0',
            'kvroute_kv_events_total{type="BlockStored",worker="a:1"} 2.0',
            'kvroute_kv_events_total{type="BlockRemoved",worker="a:1"} 1.0',
            'kvroute_kv_sequence_gaps_total{worker="a:1"} 1.0',
        ]
    )
    got = router_samples(text, "a:1")
    assert got == {"index": 7, "events": 3, "gaps": 1, "malformed": 0, "resyncs": 0}


@pytest.mark.parametrize(
    "changes",
    [{"router": "ftp://x"}, {"pairs": 0}, {"burst": 1}, {"prompt_tokens": 10}],
    ids=["scheme", "pairs", "burst", "prompt-tokens"],
)
def test_options_reject_nonsense(changes: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        Options(**{"router": "http://127.0.0.1:8000", **changes}).validate()
