"""The conformance suite against the simulator (`python -m conformance --target sim`), and
the rules that make it trustworthy: a skipped check fails the run, a crashing or
unsatisfied check fails, and a deliberately mis-configured engine is caught."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conformance.checks import RUN_ORDER, registry
from conformance.registry import Check, Findings, SelectionError, exit_code, plan
from conformance.session import Context, Session, run_checks
from conformance.sim_server import SIM_TOKENIZER_DIR
from conformance.targets import ENGINE_FEATURES, LORA, SimTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def sim_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("conformance-sim")
    cmd = [sys.executable, "-m", "conformance", "--target", "sim", "--report", str(tmp / "r.json")]
    done = subprocess.run(
        [*cmd, "--workdir", str(tmp / "work")], capture_output=True, text=True, timeout=540
    )
    assert (tmp / "r.json").exists(), done.stderr[-3000:]
    yield done.returncode, json.loads((tmp / "r.json").read_text())


def test_sim_run_passes_every_check(sim_report: tuple[int, dict[str, Any]]) -> None:
    code, report = sim_report
    failed = {c["name"]: c["reason"] for c in report["checks"] if c["status"] != "pass"}
    assert failed == {}
    assert code == 0
    assert report["ok"] is True
    assert report["summary"] == {"pass": len(RUN_ORDER), "fail": 0, "skip": 0}


def test_sim_report_shape(sim_report: tuple[int, dict[str, Any]]) -> None:
    _, report = sim_report
    assert report["target"] == "sim"
    assert {"kvroute", "python", "vllm", "engine"} <= set(report["versions"])
    assert [c["name"] for c in report["checks"]] == list(RUN_ORDER)
    for c in report["checks"]:
        assert set(c) == {"name", "description", "needs", "status", "reason", "seconds", "evidence"}
        assert c["description"] and c["needs"] and c["seconds"] > 0
        assert c["evidence"], f"{c['name']} passed without evidence"
    assert {e["role"] for e in report["engines"]} == {"main", "bytes", "peer"}


def test_sim_evidence_is_substantive(sim_report: tuple[int, dict[str, Any]]) -> None:
    checks = {c["name"]: c["evidence"] for c in sim_report[1]["checks"]}
    fidelity = checks["index-fidelity"]
    assert fidelity["requests"] >= 200 and fidelity["ratio"] >= 0.99
    assert fidelity["live_index_counters"]["blocks_removed"] > 0
    scenarios = checks["chaining"]["scenarios"]
    assert set(scenarios) == {
        "int-hashes",
        "eviction",
        "all-blocks-cleared",
        "lora",
        "cache-salt",
        "duplicate-block",
        "report-full",
    }
    assert checks["chaining-32byte"]["captured_frames"]["hash_kinds"] == ["32-byte"]
    cut = checks["truncation"]
    assert cut["cases_cut"] >= 12
    assert all(case["equal"] for case in cut["cases"].values())
    assert checks["replay"]["after_restart"]["full"]["restarts"] == 1
    quality = checks["routing-quality"]
    assert quality["workload"]["requests"] == 48
    assert set(quality["routers"]) == {
        "kvroute",
        "round_robin",
        "sglang-router-cache_aware",
        "vllm-router-cache_aware",
    }
    fractions = quality["cached_fraction"]
    assert fractions["kvroute"] >= fractions["round_robin"] + 0.1


# ---- the registry's rules, with stand-in checks ---------------------------------------------


class _FakeTarget:
    name = "fake"
    ttft_gap_s = 0.0

    def __init__(self, missing: dict[str, str] | None = None) -> None:
        self._missing = missing or {}

    @property
    def tokenizer_dir(self) -> Path:
        return SIM_TOKENIZER_DIR

    def features(self) -> dict[str, str | None]:
        out: dict[str, str | None] = dict.fromkeys(ENGINE_FEATURES)
        return out | self._missing

    def prepare(self) -> None:
        raise AssertionError("stand-in checks start no engine")

    def start(self, spec: Any) -> Any:
        raise AssertionError("stand-in checks start no engine")

    def versions(self) -> dict[str, str]:
        return {}


async def _passes(ctx: Context, f: Findings) -> None:
    f.note("saw", 1)


async def _unsatisfied(ctx: Context, f: Findings) -> None:
    f.require(1 + 1 == 3, "arithmetic is off")


async def _crashes(ctx: Context, f: Findings) -> None:
    raise RuntimeError("engine went away")


def _fake(name: str, fn: Any, needs: tuple[str, ...] = ()) -> Check:
    return Check(name, f"{name} check", fn, frozenset(needs), targets=frozenset({"fake"}))


def _run(checks: list[Check], target: _FakeTarget, tmp: Path) -> list[Any]:
    ctx = Context(target, Session(target, checks), tmp)
    return asyncio.run(run_checks(ctx, checks))


@pytest.mark.parametrize(
    ("fn", "status", "reason"),
    [
        (_passes, "pass", "all requirements met"),
        (_unsatisfied, "fail", "arithmetic is off"),
        (_crashes, "fail", "RuntimeError: engine went away"),
    ],
    ids=["pass", "unsatisfied", "crash"],
)
def test_check_outcomes(fn: Any, status: str, reason: str, tmp_path: Path) -> None:
    [result] = _run([_fake("x", fn)], _FakeTarget(), tmp_path)
    assert (result.status, result.reason) == (status, reason)
    assert exit_code([result]) == (0 if status == "pass" else 1)


async def _crashes_in_the_suite(ctx: Context, f: Findings) -> None:
    from conformance.client import _json

    _json(httpx.Response(500, request=httpx.Request("GET", "http://127.0.0.1:9/v1/models")))


async def _crashes_in_a_check(ctx: Context, f: Findings) -> None:
    from conformance.checks.lora_slots import _sample
    from conformance.client import client
    from conformance.procs import free_port

    async with client(f"http://127.0.0.1:{free_port()}") as nobody:  # refused
        await _sample(nobody, [])


def test_a_crash_names_the_suite_line_it_came_from(tmp_path: Path) -> None:
    """A CI log shows the one-line reason, not the report's traceback: the reason names the
    check's own line that raised (not the client's transport below it), else the suite's."""
    [helper, in_check] = _run(
        [_fake("x", _crashes_in_the_suite), _fake("y", _crashes_in_a_check)],
        _FakeTarget(),
        tmp_path,
    )
    assert helper.reason.startswith("EngineCallError: /v1/models: 500")
    assert re.search(r"\(at conformance/client\.py:\d+, _json\)$", helper.reason), helper.reason
    assert in_check.reason.startswith("ConnectError")
    pattern = r"\(at conformance/checks/lora_slots\.py:\d+, _sample\)$"
    assert re.search(pattern, in_check.reason), in_check.reason


def test_missing_feature_skips_with_reason_and_fails_the_run(tmp_path: Path) -> None:
    target = _FakeTarget({LORA: "no adapter loaded"})
    results = _run([_fake("a", _passes), _fake("b", _passes, (LORA,))], target, tmp_path)
    assert [r.status for r in results] == ["pass", "skip"]
    assert results[1].reason == "skipped, needed feature(s) missing: lora: no adapter loaded"
    assert exit_code(results) == 1
    assert exit_code([]) == 1  # nothing run is never a pass


def test_plan_selection() -> None:
    checks = registry()
    assert [c.name for c in plan("sim", (), checks)] == list(RUN_ORDER)
    assert [c.name for c in plan("vllm", ("replay", "tokenizer"), checks)] == [
        "tokenizer",
        "replay",
    ]
    with pytest.raises(SelectionError, match="unknown check"):
        plan("sim", ("no-such-check",), checks)
    with pytest.raises(SelectionError, match="no check to run"):
        plan("gpu", (), checks)


def test_cli_rejects_unknown_check() -> None:
    cmd = [sys.executable, "-m", "conformance", "--target", "sim", "--only", "nope"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown check" in done.stderr


# ---- a real check against a deliberately broken engine --------------------------------------


def test_tokenizer_check_catches_a_different_chat_template(tmp_path: Path) -> None:
    """The engine serves a chat template that differs from the folder kvroute reads: the
    tokenizer check must fail and show the difference."""
    served = tmp_path / "served-tokenizer"
    shutil.copytree(SIM_TOKENIZER_DIR, served)
    config_path = served / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace("'\\n'", "': '")
    assert config["chat_template"] != json.loads(config_path.read_text())["chat_template"]
    config_path.write_text(json.dumps(config))
    target = SimTarget(extra_args=("--tokenizer", str(served)))
    checks = plan("sim", ("tokenizer",), registry())
    ctx = Context(target, Session(target, checks), tmp_path / "work")
    [result] = asyncio.run(run_checks(ctx, checks))
    assert result.status == "fail"
    assert "chat[0]" in result.reason and "first difference" in result.reason
    assert result.evidence["cases"]["completion[0]"]["equal"] is True


def test_a_port_lost_above_the_last_lines_of_the_start_is_retried(tmp_path: Path) -> None:
    """vLLM's engine core reports a port another process took far above the API server's
    traceback; only this start's lines count (the log is appended across restarts)."""
    from conformance.vllm_server import VllmServer

    server = VllmServer(tmp_path, log_dir=tmp_path)
    server.log_path.write_text("an earlier start: Address already in use\n")
    server._log_start = server.log_path.stat().st_size
    with server.log_path.open("a") as log:
        log.write("(EngineCore) zmq.error.ZMQError: Address already in use\n")
        log.write("traceback line\n" * 100)
    assert server._lost_port_race()
    server._log_start = server.log_path.stat().st_size
    with server.log_path.open("a") as log:
        log.write("RuntimeError: Engine core initialization failed\n" + "line\n" * 100)
    assert not server._lost_port_race()
