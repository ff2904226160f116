"""Engine adapters, one table: what kvroute needs to know of each engine it routes for.

    ADAPTERS["vllm"]   KV events (vLLM's msgpack wire format), `/kv_event_sources`, `/metrics`
                       names, and the fixes kvroute prints, in vLLM's flags

A worker names its engine with `engine:` in the config (default vllm). `engines/sim` is a
simulated vLLM, so it uses the vLLM adapter.
"""

from __future__ import annotations

from engines.base import EngineAdapter
from engines.vllm import ADAPTER as VLLM

ADAPTERS: dict[str, EngineAdapter] = {"vllm": VLLM}
DEFAULT_ENGINE = "vllm"
