"""What a vLLM worker tells us about itself over HTTP: its KV event publishers and its
cache config and load (`/metrics`). Parsing only; the calls live in `router.workers`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from engines.base import EngineMetrics, EventSource, RankLoad, connectable
from engines.vllm.metrics_text import Sample, Unparsed, wanted_samples


def event_sources(doc: Any, worker_url: str) -> list[EventSource]:
    """One publisher per data-parallel rank from `GET /kv_event_sources`: vLLM 0.32 answers
    `{rank: KVEventsConfig}`, later versions a list of `{data_parallel_rank, endpoint,
    replay_endpoint, topic}`. Empty when the engine publishes nothing. `*`/`0.0.0.0` bind
    addresses mean the worker's host."""
    if isinstance(doc, list):
        entries = [
            (e.get("data_parallel_rank", i), e) for i, e in enumerate(doc) if isinstance(e, dict)
        ]
    elif isinstance(doc, dict):
        entries = list(doc.items())
    else:
        return []
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    out = []
    for raw_rank, cfg in entries:
        source = _source(cfg, host, _rank(raw_rank))
        if source is not None:
            out.append(source)
    return sorted(out, key=lambda s: s.rank)


def _rank(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def _source(cfg: Any, host: str, rank: int) -> EventSource | None:
    if not isinstance(cfg, dict) or cfg.get("enable_kv_cache_events") is False:
        return None
    if "endpoint" not in cfg and not cfg.get("enable_kv_cache_events"):
        return None
    if cfg.get("publisher") not in ("zmq", None):
        return None
    endpoint = connectable(str(cfg.get("endpoint") or "tcp://*:5557"), host)
    replay = cfg.get("replay_endpoint")
    return EventSource(
        endpoint=endpoint,
        replay_endpoint=connectable(str(replay), host) if replay else None,
        topic=str(cfg.get("topic") or ""),
        rank=rank,
    )


def parse_metrics(text: str) -> EngineMetrics:
    """The vLLM gauges the router blends into its load view, summed over label sets, and
    split per data-parallel rank (the `engine` label) where the engine runs several. Only
    the wanted lines are read (`metrics_text`); a page whose wanted lines are unusual goes
    through prometheus_client's full parser instead."""
    try:
        return _metrics(list(wanted_samples(text, READ_METRICS)))
    except Unparsed:
        return parse_metrics_full(text)


def parse_metrics_full(text: str) -> EngineMetrics:
    """`parse_metrics` by prometheus_client's parser alone (raises ValueError on a bad page):
    the reference the fast path is held to."""
    return _metrics(full_samples(text))


def full_samples(text: str) -> list[Sample]:
    """The samples the router reads, by prometheus_client's parser."""
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in READ_METRICS
    ]


def _metrics(samples: Iterable[Sample]) -> EngineMetrics:
    values: dict[str, float] = {}
    ranks: dict[int, dict[str, float]] = {}
    info: dict[str, str] = {}
    for name, labels, value in samples:
        if name == _INFO:
            info = labels
            continue
        if name == _BY_REASON:
            if labels.get("reason") != "deferred":
                continue  # "capacity": the rest of vllm:num_requests_waiting
            name = _DEFERRED
        values[name] = values.get(name, 0.0) + value
        rank = _int(labels.get("engine"))
        if rank is not None:
            mine = ranks.setdefault(rank, {})
            mine[name] = mine.get(name, 0.0) + value
    by_rank = {
        r: RankLoad(
            v.get("vllm:num_requests_running", 0.0),
            v.get("vllm:num_requests_waiting", 0.0),
            v.get("vllm:kv_cache_usage_perc"),
            v.get(_DEFERRED),
            v.get("vllm:generation_tokens_total"),
        )
        for r, v in ranks.items()
    }
    usage = values.get("vllm:kv_cache_usage_perc")
    return EngineMetrics(
        running=values.get("vllm:num_requests_running", 0.0),
        waiting=values.get("vllm:num_requests_waiting", 0.0),
        kv_usage=usage / len(by_rank) if usage is not None and len(by_rank) > 1 else usage,
        deferred=values.get(_DEFERRED),
        block_size=_int(info.get("block_size")),
        num_gpu_blocks=_int(info.get("num_gpu_blocks")),
        prefix_caching=_bool(info.get("enable_prefix_caching")),
        hash_algo=info.get("prefix_caching_hash_algo"),
        prefix_queries=values.get("vllm:prefix_cache_queries_total"),
        prefix_hits=values.get("vllm:prefix_cache_hits_total"),
        generation_tokens=values.get("vllm:generation_tokens_total"),
        by_rank=by_rank,
    )


_WANTED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:generation_tokens_total",
}
_INFO = "vllm:cache_config_info"
_BY_REASON = "vllm:num_requests_waiting_by_reason"  # vLLM >= 0.32
_DEFERRED = "deferred"  # the key its "deferred" samples are summed under
READ_METRICS = frozenset(_WANTED | {_INFO, _BY_REASON})  # every sample name the router reads


def _int(raw: str | None) -> int | None:
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def _bool(raw: str | None) -> bool | None:
    if raw is None:
        return None
    return raw.strip().lower() in ("true", "1")
