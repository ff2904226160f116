"""Reading the decode workers' metrics after splits: every split proved or counted as a
silent recompute, failed pulls counted, and what the counters say about the link and the
KV size fed to the cost model. Its findings make `/health` degraded (200, named).

One loop, owned by the P/D door (started and stopped with the app): a decode worker is
scraped only while some of its splits wait for proof, at most every `interval_s`. With
`sweep_s` (the first of `--processes`, which alone counts the workers' KV bytes and failed
pulls for all of them) every decode worker is read at least that often too, so those
counters keep up with the splits its siblings made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from engines.sim.pd_metrics import PDSnapshot, pd_snapshot
from router.pd.ledger import Ledger, Outcome
from router.pd.metrics import PDMetrics
from router.pd.model import CostModel
from router.workers import WorkerPool

log = logging.getLogger("kvroute.pd")

SILENT_FIX = (
    "the decode leg reached the worker without its kv_transfer_params, or the worker has no "
    'KV connector: start it with --kv-transfer-config \'{"kv_connector":"NixlConnector",'
    '"kv_role":"kv_consumer"}\', make sure nothing between kvroute and the worker drops '
    "request fields, and never run kvroute with --pd-fault-strip-params (a test fault)"
)
FAILED_FIX = (
    "the decode worker could not read the prefill worker's KV: the prefill worker's NIXL "
    "side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT) must be reachable from the decode "
    "worker, and both must run the same model, dtype and block size"
)


@dataclass
class WorkerAccount:
    """Totals and the current problem of one decode worker."""

    verified: int = 0
    silent: int = 0
    failed_pulls: float = 0.0
    bytes: float = 0.0
    problem: str | None = None
    fix: str | None = None


@dataclass
class Verifier:
    pool: WorkerPool
    model: CostModel
    metrics: PDMetrics
    interval_s: float = 0.5
    sweep_s: float | None = None
    decode_workers: Callable[[], list[str]] = field(default=lambda: [])  # what a sweep reads
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    accounts: dict[str, WorkerAccount] = field(default_factory=dict)
    retired: WorkerAccount = field(default_factory=WorkerAccount)  # removed workers' totals
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    # ---- the door's side --------------------------------------------------------------

    def started(self, endpoint: str) -> None:
        self._ledger(endpoint).inflight += 1

    def ended(self, endpoint: str, proved_tokens: int | None) -> None:
        """A decode leg ended; `proved_tokens`: what its pull should show (None: it failed,
        nothing to prove)."""
        ledger = self._ledger(endpoint)
        ledger.inflight -= 1
        if proved_tokens is not None and ledger.last is not None:
            ledger.expect(proved_tokens)
        self._wake.set()  # a worker without a baseline gets one (this split goes unproved)

    def _ledger(self, endpoint: str) -> Ledger:
        return self.ledgers.setdefault(self._worker(endpoint), Ledger())

    def _worker(self, endpoint: str) -> str:
        """The worker a (data-parallel rank's) endpoint belongs to, removed ones too."""
        h = self.pool.handle_of(endpoint)
        return h.name if h is not None else endpoint.split("#dp", 1)[0]

    # ---- the loop ---------------------------------------------------------------------

    async def baseline(self, endpoints: list[str]) -> None:
        """First snapshots: splits are proved against these."""
        await asyncio.gather(*(self._check(self._worker(e)) for e in endpoints))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        # due whether or not the process's own splits keep waking the loop
        next_sweep = None if self.sweep_s is None else loop.time() + self.sweep_s
        while True:
            wait = None if next_sweep is None else max(0.0, next_sweep - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):  # wait_for could swallow a cancellation
                    await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.interval_s)  # let the metrics catch up, batch splits
            swept = next_sweep is not None and loop.time() >= next_sweep
            if swept and self.sweep_s is not None:
                next_sweep = loop.time() + self.sweep_s
            due = {
                w
                for w, led in self.ledgers.items()
                if swept or led.pending_splits or led.last is None
            }
            if swept:  # decode workers that joined since, too
                due.update(self._worker(e) for e in self.decode_workers())
            await asyncio.gather(*(self._check(w) for w in due))
            self.forget_removed()

    async def _check(self, worker: str) -> None:
        snap = await self._scrape(worker)
        if snap is not None:
            self._record(worker, self.ledgers.setdefault(worker, Ledger()).apply(snap))

    async def _scrape(self, worker: str) -> PDSnapshot | None:
        h = self.pool.handles.get(worker)
        if h is None:
            return None
        with contextlib.suppress(httpx.HTTPError):
            resp = await self.pool.client.get(f"{h.url}/metrics", headers=h.auth)
            if resp.status_code == 200:
                return pd_snapshot(resp.text)
        return None

    def _record(self, worker: str, out: Outcome) -> None:
        a = self.accounts.setdefault(worker, WorkerAccount())
        m = self.metrics
        a.verified += out.verified
        a.silent += out.silent
        a.failed_pulls += out.failed_pulls
        a.bytes += out.bytes
        m.child(m.verified, worker).inc(out.verified)
        m.child(m.silent, worker).inc(out.silent)
        m.child(m.failed_pulls, worker).inc(out.failed_pulls)
        m.child(m.kv_bytes, worker).inc(out.bytes)
        self.model.observe_transfer(out.bytes, out.xfer_seconds, out.external_tokens)
        self._judge(worker, a, out)

    def _judge(self, worker: str, a: WorkerAccount, out: Outcome) -> None:
        """The latest finding stands until a later check proves splits again."""
        if out.silent:
            a.problem = (
                f"decode worker {worker} answered {out.silent} split request(s) without pulling "
                f"their KV: its external_kv_transfer tokens grew by {out.observed_tokens:.0f}, "
                f"the splits needed {out.expected_tokens} (a silent recompute)"
            )
            a.fix = SILENT_FIX
            log.error("%s; fix: %s", a.problem, a.fix)
        elif out.failed_pulls:
            a.problem = (
                f"decode worker {worker}: {out.failed_pulls:.0f} KV pull(s) failed "
                "(vllm:nixl_num_failed_transfers)"
            )
            a.fix = FAILED_FIX
            log.error("%s; fix: %s", a.problem, a.fix)
        elif out.verified:
            a.problem = a.fix = None

    # ---- what /health shows -----------------------------------------------------------

    def totals(self) -> dict[str, Any]:
        accounts = [*self.accounts.values(), self.retired]
        return {
            "verified_handoffs": sum(a.verified for a in accounts),
            "silent_recomputes": sum(a.silent for a in accounts),
            "failed_pulls": int(sum(a.failed_pulls for a in accounts)),
            "kv_bytes_moved": int(sum(a.bytes for a in accounts)),
        }

    def problems(self) -> dict[str, tuple[str, str]]:
        """worker -> (problem, fix), for the workers in the fleet whose last check found
        one (a worker removed since is not the fleet's problem any more)."""
        live = self.pool.handles
        return {
            w: (a.problem, a.fix or "")
            for w, a in self.accounts.items()
            if a.problem is not None and w in live
        }

    def forget_removed(self) -> None:
        """Drop the ledgers and accounts of workers removed from the fleet (pods come and go
        under new addresses); their totals stay counted."""
        live = self.pool.handles
        for w in [w for w, led in self.ledgers.items() if w not in live and led.inflight <= 0]:
            del self.ledgers[w]
            self.metrics.forget_worker([w])
            gone = self.accounts.pop(w, None)
            if gone is not None:
                r = self.retired
                r.verified += gone.verified
                r.silent += gone.silent
                r.failed_pulls += gone.failed_pulls
                r.bytes += gone.bytes
