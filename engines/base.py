"""What the router needs from an engine, whatever the engine: the types its adapter fills in
and the adapter itself. One adapter per engine lives under `engines/<name>/`; the table of
them is `engines.ADAPTERS`. The neutral core (`indexer/`, `router/core/`) never names an
engine: wording such as "start vLLM with ..." comes from here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from indexer.events import EventBatch
from indexer.health import HealthFixes


@dataclass(frozen=True)
class EventSource:
    """Where one engine (one data-parallel rank) publishes its KV events."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    rank: int = 0


def connectable(endpoint: str, host: str) -> str:
    """An endpoint a subscriber can dial: `tcp://*:5557` is how an engine binds (vLLM's
    default), so a wildcard host becomes the worker's own."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    bind_host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if bind_host in ("*", "0.0.0.0", "", "[::]", "::"):
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"


@dataclass(frozen=True)
class RankLoad:
    """Load gauges of one data-parallel rank (vLLM's `engine` label)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    deferred: float | None = None  # as EngineMetrics.deferred
    generation_tokens: float | None = None  # as EngineMetrics.generation_tokens, this rank's


@dataclass(frozen=True)
class EngineMetrics:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    # of `waiting`, those the engine held for something other than room in its batch (vLLM
    # 0.32's `num_requests_waiting_by_reason{reason="deferred"}`: an adapter with no LoRA
    # slot, KV arriving from a prefill worker, a grammar compiling). vLLM counts such a
    # request until it is scheduled, so also once it waits for a slot like the rest. None
    # where the engine does not split its queue
    deferred: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_caching: bool | None = None
    hash_algo: str | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    # tokens the engine generated since it started (vllm:generation_tokens_total): it moves
    # while any request decodes, so a request waiting on a worker whose count moved was
    # waiting on a live engine
    generation_tokens: float | None = None
    by_rank: dict[int, RankLoad] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineHints:
    """Operator-facing fixes, in the engine's own flags."""

    health: HealthFixes
    events_missing: str  # "{url}" is the worker's URL
    prefix_caching_off: str
    block_size_mismatch: str  # "{configured}" and "{reported}" are filled in
    tokenizer_mismatch: str


@dataclass(frozen=True)
class EngineAdapter:
    name: str
    decode_batch: Callable[[bytes], EventBatch]
    # GET /kv_event_sources (or the engine's equivalent) -> one source per data-parallel rank
    event_sources: Callable[[Any, str], list[EventSource]]
    event_sources_path: str
    parse_metrics: Callable[[str], EngineMetrics]
    hints: EngineHints
    # a decoder for one worker's stream, when decoding needs what earlier batches said
    # (vLLM: which KV-cache group is full attention); None: `decode_batch` itself
    stream_decoder: Callable[[], Callable[[bytes], EventBatch]] | None = None
