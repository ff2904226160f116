"""The sidecar overlay's Envoy preStop (deploy/k8s/overlays/sidecar/envoy-drain.sh), run with
bash against a real Envoy that runs the overlay's own bootstrap (the rendered ConfigMap, ports
moved to free loopback ones) and the container's own arguments, in front of a slow simulated
worker: the hook returns only after the stream in flight has finished, every response after
it started says Connection: close, and an idle or absent Envoy does not hold it up."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_deploy_overlays import container, find, render

from conformance.faults.harness import SimProcess
from router.envoy.process import envoy_binary
from router.procs import free_port

SCRIPT = Path(__file__).resolve().parent.parent / "deploy/k8s/overlays/sidecar/envoy-drain.sh"
SLOW_SIM = ("--block-size", "16", "--kv-blocks", "256", "--decode-ms-per-step", "150")

pytestmark = pytest.mark.timeout(120)


def _bootstrap(sim_port: int, ports: dict[str, int]) -> dict[str, Any]:
    """The sidecar's bootstrap on loopback: `ports` for the listeners (by name) and the
    admin, the workers' cluster at the simulated worker."""
    (config_map,) = [
        d
        for d in render("sidecar")
        if d["metadata"]["name"].startswith("kvroute-envoy-") and "envoy.yaml" in d.get("data", {})
    ]
    doc: dict[str, Any] = yaml.safe_load(config_map["data"]["envoy.yaml"])
    for listener in doc["static_resources"]["listeners"]:
        address = listener["address"]["socket_address"]
        address.update(address="127.0.0.1", port_value=ports[listener["name"]])
    doc["admin"]["address"]["socket_address"]["port_value"] = ports["admin"]
    for cluster in doc["static_resources"]["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        address = endpoint["address"]["socket_address"]
        if cluster["name"] == "kvroute_workers":
            address.update(address="127.0.0.1", port_value=sim_port)
        elif cluster["name"] == "envoy_admin":  # behind the stats listener
            address["port_value"] = ports["admin"]
        else:  # the picker: nobody listens, and the bootstrap fails open (round robin)
            address["port_value"] = free_port()
    return doc


class Envoy:
    """The sidecar's Envoy (its bootstrap and arguments) on loopback, the picker down."""

    def __init__(self, tmp: Path, sim_port: int) -> None:
        self.port, self.admin, self.stats = free_port(), free_port(), free_port()
        ports = {"kvroute_gateway": self.port, "envoy_stats": self.stats, "admin": self.admin}
        config = tmp / "envoy.yaml"
        config.write_text(yaml.safe_dump(_bootstrap(sim_port, ports)))
        args = list(container(find("sidecar", "Deployment", "kvroute"), "envoy")["args"])
        args[args.index("-c") + 1] = str(config)
        binary = envoy_binary()
        assert binary is not None
        self.log = tmp / "envoy.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin}/ready", timeout=1).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("envoy not ready: " + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[Envoy]:
    sim = SimProcess(args=SLOW_SIM)
    try:
        proxy = Envoy(tmp_path, sim.port)
        try:
            yield proxy
        finally:
            proxy.stop()
    finally:
        sim.stop()


def drain(admin: int, max_s: int = 60) -> tuple[int, float]:
    """Runs the preStop hook as the kubelet would (bash FILE, the container's env)."""
    env = {**os.environ, "ENVOY_ADMIN_PORT": str(admin), "DRAIN_MIN_S": "0"}
    env["DRAIN_MAX_S"] = str(max_s)
    out = subprocess.run(["bash", str(SCRIPT)], env=env, timeout=max_s + 10, capture_output=True)
    return out.returncode, time.monotonic()


class Stream(threading.Thread):
    """A streaming completion of 20 tokens at 150 ms each, through Envoy."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.lines: list[str] = []
        self.ended = 0.0

    def run(self) -> None:
        body = {"model": "kvroute-sim", "prompt": "drain me", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                self.started.set()
                self.lines.append(line)
        self.ended = time.monotonic()


def test_the_hook_waits_for_the_request_in_flight(envoy: Envoy) -> None:
    url = f"http://127.0.0.1:{envoy.port}"
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(20), "the stream through Envoy never started"
    hook = threading.Thread(target=lambda: result.append(drain(envoy.admin)))
    result: list[tuple[int, float]] = []
    hook.start()
    # once the hook has asked Envoy to drain, a new request is told to close its connection;
    # when it does so is the hook's business (bash, /dev/tcp): ask until it has
    deadline = time.monotonic() + 10
    while True:
        after = httpx.post(
            f"{url}/v1/completions",
            json={"model": "kvroute-sim", "prompt": "late", "max_tokens": 1},
            timeout=30,
        )
        assert after.status_code == 200
        if after.headers.get("connection") == "close":
            break
        assert time.monotonic() < deadline, "no response said Connection: close"
        time.sleep(0.05)
    hook.join(70)
    stream.join(30)
    ((code, hook_ended),) = result
    assert code == 0
    data = [line for line in stream.lines if line.startswith("data: ")]
    assert len(data) > 10 and data[-1] == "data: [DONE]"  # whole, not cut
    assert not any('"error"' in line for line in data)
    # the hook outlived the request, so SIGTERM cut nothing; Envoy stops counting the stream
    # a moment before this client notes its end, hence the slack (the [DONE] above says the
    # stream was whole)
    assert hook_ended >= stream.ended - 0.2


def test_an_idle_or_absent_envoy_does_not_hold_the_hook(envoy: Envoy) -> None:
    start = time.monotonic()
    code, ended = drain(envoy.admin, max_s=60)
    assert code == 0 and ended - start < 30  # returned on "nothing active", not at DRAIN_MAX_S
    envoy.stop()
    start = time.monotonic()
    code, ended = drain(envoy.admin, max_s=60)
    assert code == 0 and ended - start < 30
