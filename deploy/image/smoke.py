"""What the container image does, checked without a container daemon (CI has none):

1. hadolint passes on the Dockerfile;
2. the wheel the image installs is built from this tree and installed into a fresh virtualenv
   (with the compiled index core): first alone, where `kvroute --version` and `kvroute serve
   --help` must work without any extra, then with the image's `grpc` extra;
3. `kvroute --version` answers from it;
4. the image's ENTRYPOINT + CMD run exactly as the image runs them, with the image's own
   default config (deploy/image/kvroute.yaml) changed only where a test must stay on
   loopback (host 127.0.0.1, workers_dns pointing at a simulated worker): /ready turns 200,
   a completion is routed, SIGTERM drains and exits 0.

    python deploy/image/smoke.py [--keep]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import httpx
import yaml

from conformance.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def step(what: str) -> None:
    print(f"image smoke: {what}", flush=True)


def dockerfile_command() -> list[str]:
    """The last stage's ENTRYPOINT + CMD (exec form)."""
    entry: list[str] = []
    cmd: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            entry = json.loads(line.removeprefix("ENTRYPOINT "))
        elif line.startswith("CMD "):
            cmd = json.loads(line.removeprefix("CMD "))
    if not entry:
        raise SystemExit("image smoke: no ENTRYPOINT in the Dockerfile")
    return entry + cmd


def hadolint() -> None:
    step("hadolint Dockerfile")
    subprocess.run([str(VENV_BIN / "hadolint"), str(ROOT / "Dockerfile")], check=True)
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    if f'"kvroute[grpc]=={want}"' not in (ROOT / "Dockerfile").read_text():
        raise SystemExit(f"image smoke: the Dockerfile does not install kvroute {want}")


def build_and_install(tmp: Path) -> Path:
    step("building the wheel")
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
    )
    (wheel,) = wheels.glob("kvroute-*.whl")
    step(f"installing {wheel.name} into a fresh virtualenv")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], check=True)
    backends = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "from indexer.index import available_backends as a; print(*a())",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if "c" not in backends:
        raise SystemExit(f"image smoke: the wheel has no compiled index core ({backends})")
    bin_dir = venv / "bin"
    version(bin_dir)  # no extra installed yet
    subprocess.run([str(bin_dir / "kvroute"), "serve", "--help"], check=True, capture_output=True)
    step("installing the image's extra: grpc")
    subprocess.run([str(bin_dir / "pip"), "install", "-q", f"{wheel}[grpc]"], check=True)
    return bin_dir


def version(bin_dir: Path) -> None:
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    got = subprocess.run(
        [str(bin_dir / "kvroute"), "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    step(f"kvroute --version: {got}")
    if got != f"kvroute {want}":
        raise SystemExit(f"image smoke: --version says {got!r}, pyproject says {want}")


def run_entrypoint(bin_dir: Path, tmp: Path) -> None:
    sim_port, port = free_port(), free_port()
    sim = subprocess.Popen(
        [str(VENV_BIN / "kvroute"), "--log-level", "WARNING", "sim", "--port", str(sim_port)],
        stdout=subprocess.DEVNULL,
    )
    router = None
    try:
        _wait(f"http://127.0.0.1:{sim_port}/health", 30)
        config = yaml.safe_load((ROOT / "deploy" / "image" / "kvroute.yaml").read_text())
        config.update(host="127.0.0.1", port=port, workers_dns=f"127.0.0.1:{sim_port}")
        smoke = tmp / "kvroute.yaml"
        smoke.write_text(yaml.safe_dump(config))
        command = dockerfile_command()
        command = [str(bin_dir / command[0]), *command[1:-1], str(smoke)]  # CMD's config path
        command += ["--ext-proc-port", str(free_port())]  # the picker the image carries
        step(f"running the ENTRYPOINT: {' '.join(command)}")
        router = subprocess.Popen(command, env={**os.environ, "PATH": str(bin_dir)})
        base = f"http://127.0.0.1:{port}"
        _wait(f"{base}/ready", 60)
        body = {"model": "kvroute-sim", "prompt": "image smoke test", "max_tokens": 2}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        if resp.status_code != 200 or "x-kvroute-worker" not in resp.headers:
            raise SystemExit(f"image smoke: completion answered {resp.status_code}: {resp.text}")
        if "kvroute_build_info" not in httpx.get(f"{base}/metrics", timeout=10).text:
            raise SystemExit("image smoke: /metrics has no kvroute_build_info")
        router.send_signal(signal.SIGTERM)
        code = router.wait(60)
        step(f"SIGTERM: exited {code}")
        if code != 0:
            raise SystemExit(f"image smoke: kvroute serve exited {code} on SIGTERM")
    finally:
        for proc in (router, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"image smoke: {url} not 200 within {seconds:.0f} s")


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-image-smoke-"))
    try:
        hadolint()
        bin_dir = build_and_install(tmp)
        run_entrypoint(bin_dir, tmp)
    finally:
        if "--keep" not in sys.argv:
            shutil.rmtree(tmp, ignore_errors=True)
    step("passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
