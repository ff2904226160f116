"""`kvroute serve --ext-proc-port P [--no-proxy]`: the picker in the router's own process,
held to the picker conformance kit (conformance.extproc) over real gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engines.sim.fleet import start_fleet_process
from router.procs import free_port
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(240)


def wait_health(port: int, seconds: float = 60) -> None:
    """The picker's gRPC port accepts connections (the kit then asks its health service)."""
    import socket

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port}")


@pytest.mark.parametrize("proxy", [True, False], ids=["with-proxy", "picker-alone"])
def test_serve_runs_the_picker_the_kit_accepts(proxy: bool, tmp_path: Path) -> None:
    fleet = start_fleet_process(2, ["--block-size", "16", "--kv-blocks", "512"])
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "router.cli", "serve", "--port", str(http_port)]
    cmd += ["--tokenizer", str(PACKAGED_TOKENIZER), "--ext-proc-port", str(grpc_port)]
    for w in fleet.workers:
        cmd += ["--worker", str(w["url"])]
    if not proxy:
        cmd.append("--no-proxy")
    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_health(grpc_port)
        time.sleep(1.0)  # discovery
        endpoints = ",".join(str(w["url"]).split("//")[1] for w in fleet.workers)
        kit = subprocess.run(
            [
                sys.executable,
                "-m",
                "conformance.extproc",
                "--picker",
                f"127.0.0.1:{grpc_port}",
                "--endpoints",
                endpoints,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert kit.returncode == 0, kit.stdout + kit.stderr + (tmp_path / "router.log").read_text()
        if proxy:
            ready = httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=5)
            assert ready.status_code == 200
        else:  # probes and metrics only
            base = f"http://127.0.0.1:{http_port}"
            assert httpx.get(f"{base}/ready", timeout=5).status_code == 200
            assert "kvroute_build_info" in httpx.get(f"{base}/metrics", timeout=5).text
            body = {"model": "kvroute-sim", "prompt": "x"}
            refused = httpx.post(f"{base}/v1/completions", json=body, timeout=5)
            assert refused.status_code == 404 and "--no-proxy" in refused.text
        os.kill(router.pid, signal.SIGTERM)
        assert router.wait(60) == 0
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
        log.close()
        fleet.stop()
