"""One simulated worker's configuration, validated once (bad values fail at start, naming
the field and the fix)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from engines.sim.blockpool import DEFAULT_NONE_HASH_SEED
from engines.sim.events_pub import DEFAULT_BUFFER_STEPS, DEFAULT_HWM, EndpointError
from engines.sim.events_pub import loopback_endpoint as _loopback
from engines.sim.latency import LatencyModel
from engines.sim.pd_config import KVTransferConfig, PDConfigError
from engines.sim.tokenizer import DEFAULT_TOKENIZER_DIR

DEFAULT_MODEL = "kvroute-sim"
VLLM_VERSION = "0.32.0"
# The seeds' demo fleet: 14,816 tokens of KV room per worker at block size 16.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_BLOCKS = 926


class ConfigError(ValueError):
    """A configuration value the simulator cannot run with."""


@dataclass(frozen=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    model: str = DEFAULT_MODEL
    tokenizer: Path = DEFAULT_TOKENIZER_DIR
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_blocks: int = DEFAULT_KV_BLOCKS  # vLLM's num_gpu_blocks, null block included
    max_model_len: int | None = None  # None: the tokenizer's model_max_length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    events: bool = True
    events_endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    int_hashes: bool = True
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED
    latency: LatencyModel = field(default_factory=LatencyModel)
    seed: int = 0
    output_len: tuple[int, int] = (16, 64)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) served as extra models
    # vLLM's --max-loras (default 1): adapters in one batch; a request for another one waits,
    # "deferred", while other requests pass it
    max_loras: int = 1
    # vLLM's filesystem LoRA resolver (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
    # VLLM_LORA_RESOLVER_CACHE_DIR): a model name not served is loaded as the adapter in
    # <dir>/<name> at its first request, when its adapter_config.json names this model
    lora_resolver_dir: str | None = None
    api_key: str | None = None  # vLLM's --api-key: guards /v1/* as vLLM does
    data_parallel_size: int = 1  # vLLM's --data-parallel-size: engines behind one server
    data_parallel_rank: int = 0  # which one this engine is (its events and metrics say so)
    name: str = "sim"
    kv_transfer: KVTransferConfig | None = None  # P/D handoff over NIXL (engines.sim.pd_*)
    # usage.prompt_tokens_details, as vLLM's --enable-prompt-tokens-details (on: the project's
    # clients read cached_tokens there; off: as a vLLM started without the flag)
    prompt_tokens_details: bool = True

    def replace(self, **changes: object) -> SimConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def validate(self) -> SimConfig:
        if self.host not in ("127.0.0.1", "localhost"):
            raise ConfigError(f"host={self.host!r}: the simulator binds 127.0.0.1 only")
        _positive("block_size", self.block_size, "e.g. --block-size 16")
        if self.kv_blocks < 2:
            raise ConfigError(
                f"kv_blocks={self.kv_blocks}: needs >= 2 (block 0 is vLLM's null block)"
            )
        _positive("max_num_seqs", self.max_num_seqs, "e.g. --max-batch 64")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, "e.g. 8192")
        _positive("max_loras", self.max_loras, "vLLM's default is 1")
        if self.lora_resolver_dir is not None and not os.path.isdir(self.lora_resolver_dir):
            # vLLM refuses to start so too (VLLM_LORA_RESOLVER_CACHE_DIR)
            raise ConfigError(
                f"lora_resolver_dir={self.lora_resolver_dir!r} is not a directory: give the "
                "folder that holds one folder per adapter"
            )
        _positive("buffer_steps", self.buffer_steps, "vLLM's default is 10000")
        _positive("data_parallel_size", self.data_parallel_size, "e.g. --data-parallel-size 2")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port={self.port}: use 1..65535, or 0 for a free port")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len, "or leave it unset")
        lo, hi = self.output_len
        if not 1 <= lo <= hi:
            raise ConfigError(f"output_len={self.output_len}: needs 1 <= MIN <= MAX")
        for key, endpoint in (
            ("events_endpoint", self.events_endpoint),
            ("replay_endpoint", self.replay_endpoint),
        ):
            if endpoint is not None:
                try:
                    _loopback(endpoint)
                except EndpointError as exc:
                    raise ConfigError(f"{key}: {exc}") from None
        if self.kv_transfer is not None:
            try:
                self.kv_transfer.validate()
            except PDConfigError as exc:
                raise ConfigError(str(exc)) from None
        return self

    @property
    def kv_tokens(self) -> int:
        """KV room in tokens, as vLLM logs it (`num_gpu_blocks * block_size`)."""
        return self.kv_blocks * self.block_size

    def cache_info(self) -> dict[str, str]:
        """Labels of `vllm:cache_config_info` (vLLM exports every CacheConfig field)."""
        return {
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.92",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.kv_blocks),
            "num_gpu_blocks_override": str(self.kv_blocks),
            "prefix_caching_hash_algo": "sha256",
        }


def _positive(name: str, value: int, hint: str) -> None:
    if value < 1:
        raise ConfigError(f"{name}={value}: must be >= 1 ({hint})")
