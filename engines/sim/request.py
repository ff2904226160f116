"""One request inside the simulated engine, as vLLM's scheduler sees it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engines.sim.blockpool import NO_KEYS, Block, CacheKeys, EngineHash


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, KV being pulled
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling parameters the simulated model honours."""

    max_tokens: int
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # vllm_xargs {"kv_cache_report_mode": "full"}: its cache hits are published again
    report_cached: bool = False


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    keys: CacheKeys = NO_KEYS
    arrival: float = 0.0
    seed: bytes = b""  # mixes into the generated tokens (prompt digest)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached_tokens: int = -1  # tokens from the prefix cache at first admission
    num_preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[EngineHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # blocks of this request already in the prefix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Prefill -> decode handoff (engines.sim.pd_connector):
    kv_transfer_params: Mapping[str, Any] | None = None  # as the client sent them
    remote: Any = None  # decode side: where to pull the prompt's KV from (RemoteParams)
    remote_prefill: bool = False  # the pull is still to start
    num_external_tokens: int = 0  # prompt tokens whose KV was pulled, not computed
    kv_transfer_out: dict[str, Any] | None = None  # prefill side: params for the decode leg

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
