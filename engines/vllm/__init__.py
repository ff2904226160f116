"""vLLM: the first engine adapter (KV events, endpoint discovery, metrics, fix texts)."""

from __future__ import annotations

from engines.base import EngineAdapter
from engines.vllm.discovery import event_sources, parse_metrics
from engines.vllm.events import StreamDecoder, decode_batch
from engines.vllm.hints import HINTS

ADAPTER = EngineAdapter(
    name="vllm",
    decode_batch=decode_batch,
    event_sources=event_sources,
    event_sources_path="/kv_event_sources",
    parse_metrics=parse_metrics,
    hints=HINTS,
    stream_decoder=StreamDecoder,
)
