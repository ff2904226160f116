"""The simulated vLLM worker (`kvroute sim`) as a child process, shaped like `VllmServer`, so
the same conformance checks run against the simulator in seconds.

    with SimServer(num_gpu_blocks=64, enable_lora=True) as sim:
        sim.url, sim.events_endpoint, sim.replay_endpoint, sim.topic
        sim.restart(kv_events=False)   # same ports, sequence back to 0, empty cache
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from conformance.model import LORA_B_NAME, LORA_NAME, REPO_ROOT
from conformance.procs import free_ports, http_ok, log_tail, spawn, stop_group

TOPIC = "kv-events"
SERVED_MODEL_NAME = "tiny-llama"
_LIVE: set[SimServer] = set()


class SimError(RuntimeError):
    """The simulator did not start."""


class SimServer:
    def __init__(
        self,
        *,
        block_size: int = 32,
        num_gpu_blocks: int = 64,
        kv_events: bool = True,
        int_hashes: bool = True,
        enable_lora: bool = False,
        served_model_name: str = SERVED_MODEL_NAME,
        startup_timeout_s: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_events = kv_events
        self.int_hashes = int_hashes
        self.enable_lora = enable_lora
        self.model = served_model_name
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = Path(tempfile.mkdtemp(prefix="kvroute-sim-")) / "sim.log"
        self._ports: tuple[int, ...] = (0, 0, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._ports[0]}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._ports[1]}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._ports[2]}"

    @property
    def topic(self) -> str:
        return TOPIC

    @property
    def lora_resolver_dir(self) -> Path:
        """Where the simulator, as vLLM's filesystem LoRA resolver, finds the adapters
        requests name; kept with the log."""
        path = self.log_path.parent / "lora-resolver"
        path.mkdir(exist_ok=True)
        return path

    def install_adapter(self, name: str) -> Path:
        """An adapter the resolver loads as `name` (the simulator reads only its config)."""
        dst = self.lora_resolver_dir / name
        dst.mkdir(exist_ok=True)
        doc = {"peft_type": "LORA", "base_model_name_or_path": self.model, "r": 8}
        (dst / "adapter_config.json").write_text(json.dumps(doc))
        return dst

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise SimError("not started")
        return self._proc.pid

    def command(self) -> list[str]:
        http, events, replay = self._ports
        cmd = [sys.executable, "-m", "router.cli", "--log-level", "WARNING", "sim"]
        cmd += ["--port", str(http), "--topic", TOPIC, "--model", self.model]
        cmd += ["--events-endpoint", f"tcp://127.0.0.1:{events}"]
        cmd += ["--replay-endpoint", f"tcp://127.0.0.1:{replay}"]
        cmd += ["--block-size", str(self.block_size), "--kv-blocks", str(self.num_gpu_blocks)]
        if not self.int_hashes:
            cmd.append("--bytes-hashes")
        if self.enable_lora:
            cmd += ["--lora-modules", f"{LORA_NAME}={LORA_NAME}", f"{LORA_B_NAME}={LORA_NAME}"]
            cmd += ["--lora-resolver-dir", str(self.lora_resolver_dir)]
        if not self.kv_events:
            cmd.append("--no-events")
        return cmd + list(self.extra_args)

    def start(self) -> Self:
        if self._proc is not None:
            raise SimError("already started")
        self._ports = free_ports(3)
        self._spawn_and_wait()
        return self

    def restart(self, *, kv_events: bool | None = None) -> Self:
        """Stop and start on the same ports; `kv_events=False` comes back publishing nothing."""
        self.stop()
        if kv_events is not None:
            self.kv_events = kv_events
        self._spawn_and_wait()
        return self

    def _spawn_and_wait(self) -> None:
        started = time.monotonic()
        self._proc = spawn(self.command(), self.log_path)
        _LIVE.add(self)
        try:
            while not http_ok(self.url + "/health", 1.0):
                if self._proc.poll() is not None:
                    raise SimError(f"kvroute sim exited {self._proc.returncode}: {self.log_tail()}")
                if time.monotonic() - started > self.startup_timeout_s:
                    raise SimError(f"kvroute sim not healthy: {self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is not None:
            stop_group(proc, 5.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


# The simulator serves the packaged tokenizer, which the tiny vLLM model also uses.
SIM_TOKENIZER_DIR = REPO_ROOT / "engines" / "sim" / "data" / "tokenizer"
