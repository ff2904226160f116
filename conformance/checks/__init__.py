"""The conformance checks, and the order they run in: chosen so that engines are shared
(the 32-byte engine first, then stopped; everything on `main`; the restart last but one;
routing quality on the two workers before the fleet check restarts one without events;
the two-worker fleet, then the prefill->decode pair, which starts its own engines).
`tokenizer-chat` (real vLLM only, its own engine) and `replay-buffer` (real vLLM only, vLLM's
publisher without an engine) are not in RUN_ORDER, the simulator's list: they run last."""

from conformance import faults
from conformance.checks import (
    chaining,
    fidelity,
    fleet,
    lora_resolver,
    lora_slots,
    metrics,
    pd,
    replay,
    replay_buffer,
    routing_quality,
    tokenizer,
    tokenizer_chat,
    truncation,
    wire_format,
)
from conformance.registry import REGISTRY, Check

RUN_ORDER = (
    "chaining-32byte",
    "chaining",
    "wire-format",
    "tokenizer",
    "truncation",
    "metrics",
    "lora-slots",
    "index-fidelity",
    "replay",
    "lora-resolver",
    "routing-quality",
    "fleet",
    "pd",
)


def registry() -> dict[str, Check]:
    """Every registered check, in run order (any not listed in RUN_ORDER go last)."""
    ordered = {name: REGISTRY[name] for name in RUN_ORDER}
    return ordered | {name: c for name, c in REGISTRY.items() if name not in ordered}


__all__ = ["RUN_ORDER", "chaining", "faults", "fidelity", "fleet", "registry", "replay"]
__all__ += ["lora_resolver", "lora_slots", "metrics", "tokenizer", "tokenizer_chat", "truncation"]
__all__ += ["replay_buffer", "wire_format"]
__all__ += ["pd"]
__all__ += ["routing_quality"]
