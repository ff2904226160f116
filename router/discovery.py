"""What a worker tells us about itself over HTTP: its KV event publisher, its cache config,
its load, its models. Parsing only; the calls live in `router.workers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EventSource:
    endpoint: str
    replay_endpoint: str | None
    topic: str


def event_source(doc: Any, worker_url: str) -> EventSource | None:
    """Rank 0's publisher from vLLM's `GET /kv_event_sources` ({rank: KVEventsConfig});
    None when the engine publishes nothing. `*`/`0.0.0.0` bind addresses mean the worker's host."""
    if not isinstance(doc, dict) or not doc:
        return None
    cfg = doc.get("0", doc.get(0))
    if cfg is None:
        cfg = next(iter(doc.values()))
    if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events"):
        return None
    if cfg.get("publisher") not in ("zmq", None):
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    endpoint = _connectable(str(cfg.get("endpoint") or "tcp://*:5557"), host)
    replay = cfg.get("replay_endpoint")
    return EventSource(
        endpoint=endpoint,
        replay_endpoint=_connectable(str(replay), host) if replay else None,
        topic=str(cfg.get("topic") or ""),
    )


def _connectable(endpoint: str, host: str) -> str:
    """tcp://*:5557 is how vLLM binds; a subscriber must dial the worker's own address."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    addr = endpoint[len("tcp://") :]
    bind_host, _, port = addr.rpartition(":")
    if bind_host in ("*", "0.0.0.0", "", "[::]", "::"):
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"


@dataclass(frozen=True)
class EngineMetrics:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_caching: bool | None = None
    hash_algo: str | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


def parse_metrics(text: str) -> EngineMetrics:
    """The vLLM gauges the router blends into its load view, summed over label sets."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                info = dict(sample.labels)
            elif name in _WANTED:
                values[name] = values.get(name, 0.0) + sample.value
    return EngineMetrics(
        running=values.get("vllm:num_requests_running", 0.0),
        waiting=values.get("vllm:num_requests_waiting", 0.0),
        kv_usage=values.get("vllm:kv_cache_usage_perc"),
        block_size=_int(info.get("block_size")),
        num_gpu_blocks=_int(info.get("num_gpu_blocks")),
        prefix_caching=_bool(info.get("enable_prefix_caching")),
        hash_algo=info.get("prefix_caching_hash_algo"),
        prefix_queries=values.get("vllm:prefix_cache_queries_total"),
        prefix_hits=values.get("vllm:prefix_cache_hits_total"),
    )


_WANTED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
}


def _int(raw: str | None) -> int | None:
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def _bool(raw: str | None) -> bool | None:
    if raw is None:
        return None
    return raw.strip().lower() in ("true", "1")
