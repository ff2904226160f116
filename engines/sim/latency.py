"""How long one simulated engine step takes. Pure.

A step is one forward pass over every scheduled token:

    step_ms = (ttft_base_ms if any prefill runs else decode_ms_per_step)
              + sum over prefill chunks of
                  prefill_ms_per_token * new
                + attention_ms_per_mpair * (new * context + new**2 / 2) / 1e6

The last term is attention: each new token attends to every earlier token, cached or not,
which is what makes long prefills super-linear. Defaults reproduce the seeds' vLLM
measurements: a 1,500-token prompt takes 80 ms to its first token uncached and ~15.7 ms when
all but its last partial block is cached (block size 16); a 3,500-token prefill makes a
227 ms step, which is how long every running stream waits for its next token (~15 ms
otherwise) unless `max_num_batched_tokens` splits the prefill into chunks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyModel:
    ttft_base_ms: float = 15.0
    decode_ms_per_step: float = 15.0
    prefill_ms_per_token: float = 0.0304
    attention_ms_per_mpair: float = 17.24

    def __post_init__(self) -> None:
        for name in (
            "ttft_base_ms",
            "decode_ms_per_step",
            "prefill_ms_per_token",
            "attention_ms_per_mpair",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def prefill_ms(self, new: int, context: int = 0) -> float:
        """Cost of computing `new` prompt tokens after `context` already computed ones."""
        pairs = new * context + new * new / 2
        return self.prefill_ms_per_token * new + self.attention_ms_per_mpair * pairs / 1e6

    def step_ms(self, prefills: Iterable[tuple[int, int]], decodes: int) -> float:
        """One step: `prefills` as (new tokens, context) pairs, plus `decodes` decode tokens
        (their cost is in the fixed part). An empty step costs nothing."""
        cost = 0.0
        any_prefill = False
        for new, context in prefills:
            any_prefill = True
            cost += self.prefill_ms(new, context)
        if any_prefill:
            return self.ttft_base_ms + cost
        return self.decode_ms_per_step if decodes else 0.0

    def ttft_ms(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Time to first token of a lone request (no other work in its step)."""
        return self.ttft_base_ms + self.prefill_ms(prompt_tokens - cached_tokens, cached_tokens)
