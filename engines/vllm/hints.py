"""vLLM's wording for the fixes kvroute prints (health reports, start-up problems,
router-check)."""

from __future__ import annotations

import json

from engines.base import EngineHints
from indexer.health import HealthFixes

KV_EVENTS_FLAG = (
    "--kv-events-config '"
    + json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv-events",
        },
        separators=(",", ":"),
    )
    + "'"
)
PREFIX_CACHING_FIX = "start vLLM with --enable-prefix-caching"

HINTS = EngineHints(
    health=HealthFixes(
        no_events=f"start vLLM with {KV_EVENTS_FLAG}",
        stale="check the vLLM process and its --kv-events-config publisher",
        resync="none needed if it recurs rarely; frequent resyncs mean lost events: "
        "give vLLM a replay_endpoint and raise its hwm/buffer_steps",
    ),
    events_missing="GET {url}/kv_event_sources is empty: start vLLM with --kv-events-config, "
    "or set events: tcp://HOST:PORT for this worker",
    prefix_caching_off=PREFIX_CACHING_FIX,
    block_size_mismatch="set block_size: {reported} or start vLLM with --block-size {configured}",
    tokenizer_mismatch="point --tokenizer at the same files the engine loads (or use "
    "--tokenizer remote); a chat probe alone differing: give kvroute the engine's "
    "--chat-template and --chat-template-content-format (a multimodal model whose processor "
    "the engines could not load renders with its tokenizer's template: give kvroute that "
    "one as --chat-template)",
)
