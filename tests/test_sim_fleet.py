"""`kvroute fleet` / `kvroute sim`: in-process fleets, the subprocess helper, and the CLI."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engines.sim.config import ConfigError, SimConfig
from engines.sim.fleet import (
    KEEP_LOGS_ENV,
    drop_scratch,
    fleet_configs,
    run_fleet,
    scratch_dir,
    start_fleet_process,
)
from router.cli import build_parser, main


async def test_in_process_fleet_serves_distinct_workers() -> None:
    async with run_fleet(2, SimConfig(topic="kv-events", kv_blocks=64), no_events_on=[1]) as fleet:
        info = fleet.info()
        a, b = info["workers"]
        assert a["name"] == "sim-0" and b["name"] == "sim-1"
        assert a["port"] != b["port"] and a["events_endpoint"].startswith("tcp://127.0.0.1:")
        assert a["replay_endpoint"] and b["events_endpoint"] is None and not b["events"]
        async with httpx.AsyncClient(timeout=10) as c:
            for url in fleet.urls:
                assert (await c.get(url + "/health")).status_code == 200
    async with httpx.AsyncClient() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(fleet.urls[0] + "/health")


def test_fleet_configs_validate_indexes() -> None:
    with pytest.raises(ConfigError, match=r"0\.\.1"):
        fleet_configs(2, no_events_on=[2])
    with pytest.raises(ConfigError, match="at least one"):
        fleet_configs(0)


def test_fleet_subprocess_starts_and_stops_by_pid() -> None:
    proc = start_fleet_process(
        2, ["--kv-blocks", "128", "--block-size", "32", "--no-events-on", "1"]
    )
    try:
        workers = proc.workers
        assert [w["block_size"] for w in workers] == [32, 32]
        assert workers[0]["topic"] == "kv-events" and workers[1]["events"] is False
        r = httpx.get(workers[0]["url"] + "/metrics", timeout=10)
        assert 'num_gpu_blocks="128"' in r.text
    finally:
        assert proc.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(workers[0]["url"] + "/health", timeout=2)
    assert not proc.log.parent.exists()  # a clean stop leaves no folder behind


def test_a_fleet_that_fails_to_start_keeps_its_log_and_names_it() -> None:
    with pytest.raises(RuntimeError, match="did not start") as err:
        start_fleet_process(2, ["--no-events-on", "7"])
    log = Path(str(err.value).split("log ", 1)[1].split(")", 1)[0])
    try:
        assert "--no-events-on" in log.read_text()
    finally:
        shutil.rmtree(log.parent)


@pytest.mark.parametrize(
    ("codes", "kept"),
    [((0,), False), ((-signal.SIGTERM, 0), False), ((143,), False), ((-9,), True), ((0, 1), True)],
)
def test_a_child_folder_goes_only_after_a_clean_stop(
    monkeypatch: pytest.MonkeyPatch, codes: tuple[int, ...], kept: bool
) -> None:
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    folder = scratch_dir("kvroute-test-")
    try:
        (folder / "x.log").write_text("boom")
        drop_scratch(folder, *codes)
        assert folder.exists() == kept
        monkeypatch.setenv(KEEP_LOGS_ENV, "1")
        folder.mkdir(exist_ok=True)
        drop_scratch(folder, 0)
        assert folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_folder_scratch_dir_did_not_make_is_never_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fleet object built by hand with someone's own folder must not delete it on stop
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    (tmp_path / "theirs.txt").write_text("keep me")
    drop_scratch(tmp_path, 0)
    assert (tmp_path / "theirs.txt").read_text() == "keep me"
    made = scratch_dir("kvroute-test-")
    drop_scratch(made, 0)
    assert not made.exists()
    made.mkdir()  # the same path made again by someone else is theirs now
    try:
        drop_scratch(made, 0)
        assert made.exists()
    finally:
        made.rmdir()


def test_fleet_cli_reports_bad_flags() -> None:
    cmd = [sys.executable, "-m", "router.cli", "fleet", "--workers", "2", "--no-events-on", "7"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--no-events-on" in done.stderr


def test_sim_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["sim", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--kv-blocks", "--no-events", "--events-endpoint", "--prefill-ms-per-token"):
        assert flag in out
    assert "1,500-token" in out


def test_sim_flags_build_the_config() -> None:
    from engines.sim.cli import config_from_args

    argv = "sim --block-size 32 --kv-blocks 100 --no-prefix-caching --bytes-hashes"
    argv += " --max-num-batched-tokens 512 --ttft-base-ms 20 --output-len 4:8"
    args = build_parser("sim").parse_args(argv.split())
    config = config_from_args(args)
    assert (config.block_size, config.kv_blocks, config.enable_prefix_caching) == (32, 100, False)
    assert not config.int_hashes and config.max_num_batched_tokens == 512
    assert config.latency.ttft_base_ms == 20 and config.output_len == (4, 8)
    assert json.dumps(config.cache_info())


def test_sim_cli_rejects_a_public_host() -> None:
    cmd = [sys.executable, "-m", "router.cli", "sim", "--host", "0.0.0.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "127.0.0.1" in done.stderr


async def test_a_busy_events_port_fails_the_start_cleanly() -> None:
    async with run_fleet(1, SimConfig(kv_blocks=64)) as fleet:
        taken = fleet.workers[0].events_endpoint
        assert taken is not None
        with pytest.raises(RuntimeError, match="cannot bind"):
            async with run_fleet(configs=[SimConfig(events_endpoint=taken)]):
                pass
