"""The simulated model: deterministic output tokens. Pure.

Token k of a request's output depends only on the worker's seed, the prompt's token ids and
k, so the same prompt gives the same text on every worker and every run, whether or not it
was preempted. The model "ends its answer" (samples EOS) after a length drawn the same way
from `output_len`, unless the request sets `ignore_eos` (then it writes words up to
`max_tokens`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engines.sim.request import SimRequest


class FakeModel:
    def __init__(
        self,
        vocab: Sequence[int],
        eos_token_id: int,
        seed: int = 0,
        output_len: tuple[int, int] = (16, 64),
    ) -> None:
        if not vocab:
            raise ValueError("the simulated model needs a non-empty vocabulary")
        lo, hi = output_len
        if not 1 <= lo <= hi:
            raise ValueError(f"output_len must satisfy 1 <= min <= max, got {output_len}")
        self.vocab = list(vocab)
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.output_len = output_len

    def digest(self, prompt_ids: Sequence[int], variant: int = 0) -> bytes:
        """The seed of a request's output; `variant` k > 0 tells the k-th of a prompt's `n`
        samples apart (vLLM seeds child k with seed + k)."""
        h = hashlib.blake2b(digest_size=16, key=self.seed.to_bytes(8, "big", signed=True))
        h.update(array("q", prompt_ids).tobytes())
        if variant:
            h.update(b"sample" + variant.to_bytes(4, "big"))
        return h.digest()

    def natural_length(self, digest: bytes) -> int:
        lo, hi = self.output_len
        return lo + int.from_bytes(digest[:4], "big") % (hi - lo + 1)

    def token_at(self, digest: bytes, k: int, allow_eos: bool = True) -> int:
        if allow_eos and k + 1 >= self.natural_length(digest):
            return self.eos_token_id
        h = hashlib.blake2b(digest + k.to_bytes(4, "big"), digest_size=8).digest()
        return self.vocab[int.from_bytes(h, "big") % len(self.vocab)]

    def sample(self, req: SimRequest) -> int:
        """The next token of `req` (its `seed` is the prompt digest). EOS is held back while
        the request ignores it or wants more than `min_tokens`, as vLLM's EOS masking does."""
        k = len(req.output_ids)
        sp = req.sampling
        return self.token_at(req.seed, k, allow_eos=not sp.ignore_eos and k >= sp.min_tokens)
