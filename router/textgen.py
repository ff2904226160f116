"""Deterministic English-like filler text of a given token length, for the demo, the
benchmarks and probes."""

from __future__ import annotations

import random

from router.tokenize import LocalTokenizer

WORDS = [
    "cache",
    "router",
    "block",
    "prefix",
    "token",
    "worker",
    "engine",
    "model",
    "prompt",
    "latency",
    "queue",
    "memory",
    "request",
    "stream",
    "batch",
    "decode",
    "prefill",
    "event",
    "index",
    "replay",
    "shard",
    "pod",
    "cluster",
    "gateway",
    "tensor",
    "kernel",
    "layer",
    "head",
    "attention",
    "window",
    "budget",
    "policy",
    "metric",
    "signal",
]


def filler(tok: LocalTokenizer, tokens: int, rng: random.Random, head: str = "") -> str:
    """`head` followed by sentences of random words until the text is >= `tokens` long."""
    text = head
    while len(tok.completion(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(40)) + ". "
    return text
