"""`--access-log`: one line per proxied request (model, worker, predicted overlap, status,
TTFT, duration), in the log format the router runs with."""

from __future__ import annotations

import logging
import time

from router.forward import Outcome
from router.routing import Ticket

log = logging.getLogger("kvroute.access")


class AccessLog:
    def write(
        self,
        model: str,
        ticket: Ticket,
        result: Outcome,
        started: float,
        first_byte: float | None,
        prefill: str | None = None,
    ) -> None:
        """One line per answered request; `prefill`: a split's prefill worker (`worker`
        decoded it)."""
        now = time.perf_counter()
        s = ticket.decision.score_of(ticket.worker)
        fields = {
            "model": model or "-",
            "worker": ticket.worker,
            "status": result.status,
            "prompt_tokens": ticket.decision.prompt_tokens,
            "overlap_tokens": s.overlap_blocks * s.block_size,
            "cached_tokens": result.cached_tokens,
            "ttft_ms": round((first_byte - started) * 1e3, 1) if first_byte else None,
            "duration_ms": round((now - started) * 1e3, 1),
        }
        if prefill is not None:
            fields["prefill"] = prefill
        if result.broken:
            fields["broken"] = result.broken
        log.info("%s", " ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})
