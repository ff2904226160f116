"""Proof that handoffs really happened, one decode worker at a time. Pure.

`usage.cached_tokens` on a decode leg is no evidence (vLLM copies the prefill side's count);
the decode worker's own counters are: `prompt_tokens_by_source{source="external_kv_transfer"}`
grows by the tokens it pulled, `nixl_bytes_transferred` by their bytes. A decode leg sent
without its `kv_transfer_params` answers 200 with the same text and pulls nothing (a silent
recompute). The ledger keeps, per decode worker, the tokens its completed splits should have
pulled and checks them against each new snapshot of its metrics.

External tokens can show up before the split that pulled them completes (the pull comes
before the first token), so tokens seen ahead of completions are carried to the next check
while decode legs are still running there.

Tokens a split did not pull count against it only as far as the decode worker computed
tokens itself (`local_compute`): a silent recompute computes the whole prompt, while a split
whose sibling's pull filled the decode worker's cache first pulls just its tail and finds
the rest there (`local_cache_hit`). Judged by pulls alone, concurrent splits sharing a
prefix were reported as silent recomputes and /health went degraded.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.sim.pd_metrics import PDSnapshot

PROVED_FRACTION = 0.5  # a silent recompute pulls nothing; a real pull ~ all uncached tokens


@dataclass
class Outcome:
    """What one snapshot showed."""

    verified: int = 0  # splits proved
    silent: int = 0  # splits that pulled nothing
    expected_tokens: int = 0
    observed_tokens: float = 0.0
    failed_pulls: float = 0.0
    bytes: float = 0.0
    xfer_seconds: float = 0.0
    external_tokens: float = 0.0  # what the counters moved by (for bytes per token)
    restarted: bool = False


@dataclass
class Ledger:
    last: PDSnapshot | None = None
    pending_tokens: int = 0
    pending_splits: int = 0
    inflight: int = 0  # decode legs running there now
    carry: float = 0.0  # external tokens seen before their split completed
    computed_carry: float = 0.0  # tokens computed there while its decode legs ran

    def expect(self, tokens: int) -> None:
        """A split completed there; its pull must show up."""
        self.pending_tokens += tokens
        self.pending_splits += 1

    def apply(self, snap: PDSnapshot) -> Outcome:
        if self.last is None:
            self.last = snap
            return Outcome()
        delta = snap - self.last
        self.last = snap
        if min(delta.external_kv_transfer, delta.bytes_transferred, delta.transfers) < 0:
            self._clear()  # the engine restarted: its counters began again
            return Outcome(restarted=True)
        out = Outcome(
            failed_pulls=delta.failed_transfers,
            bytes=delta.bytes_transferred,
            xfer_seconds=delta.xfer_seconds,
            external_tokens=delta.external_kv_transfer,
        )
        self._settle(
            delta.external_kv_transfer + self.carry, delta.local_compute + self.computed_carry, out
        )
        return out

    def _settle(self, observed: float, computed: float, out: Outcome) -> None:
        expected = self.pending_tokens
        out.expected_tokens, out.observed_tokens = expected, observed
        if expected == 0:
            self.carry = observed if self.inflight else 0.0
            self.computed_carry = computed if self.inflight else 0.0
            return
        self.computed_carry = 0.0
        per_split = expected / self.pending_splits
        # a split counts as silent when more than half its tokens never arrived and were
        # computed instead (a real pull may fall short by what the decode worker had cached
        # beyond the index's view, or by what a sibling's pull had just put there)
        unpulled = min(max(expected - observed, 0.0), computed)
        missing = unpulled / per_split
        out.silent = min(self.pending_splits, int(missing + PROVED_FRACTION - 1e-9))
        out.verified = self.pending_splits - out.silent
        self.carry = max(observed - expected, 0.0) if self.inflight and not out.silent else 0.0
        self.pending_tokens = self.pending_splits = 0

    def _clear(self) -> None:
        self.pending_tokens = self.pending_splits = 0
        self.carry = self.computed_carry = 0.0
