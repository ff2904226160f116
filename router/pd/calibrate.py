"""At start: probe handoffs between a prefill and a decode worker teach the cost model the
link, the KV bytes per token, the split's overhead and a first prefill rate (the prefill
legs), and local prefills on the decode worker its own rate. Until then `auto` splits
nothing. A probe that fails or pulls nothing makes `/health` degraded with the fix.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.core.fleet import WorkerState
from router.pd.model import CostModel
from router.pd.probe import Endpoint, ProbeResult, probe_handoff, probe_local
from router.workers import WorkerHandle, WorkerPool

log = logging.getLogger("kvroute.pd")

PROBE_TOKENS = (64, 512, 2048)  # the first one pays the NIXL handshake: not a sample
WAIT_S = 120.0  # for a discovered prefill worker and decode worker
# a failed calibration is run again after this long, doubling to the second: an engine still
# loading its model, a side channel not yet up, or a fixed flag must not leave `auto`
# splitting nothing until the router restarts
RETRY_S = (30.0, 300.0)
PROBE_FIX = (
    "run router-check --router URL (its pd-path check runs the same probe and names the "
    "fix); every prefill worker needs --kv-transfer-config with NixlConnector and kv_role "
    "kv_producer, every decode worker kv_consumer, and the decode workers must reach the "
    "prefill workers' side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT)"
)


def endpoint(h: WorkerHandle) -> Endpoint:
    return Endpoint(h.name, h.url, h.auth)


def model_of(state: WorkerState) -> str:
    names = sorted(state.models or ())
    return names[0] if names else ""


class Calibration:
    def __init__(self, pool: WorkerPool, model: CostModel) -> None:
        self.pool = pool
        self.model = model
        self.results: list[ProbeResult] = []
        self.problem: str | None = None
        self.pair = "probe"  # prefill -> decode, once chosen
        self.state = "pending"  # pending | running | done | failed | off
        self.local_learnt = False  # the decode worker's own prefill rate was probed

    async def run(self) -> None:
        """Probe once. Run again after a failure, the last failure stands until the new
        run's verdict: /health does not flap while a retry runs."""
        if self.state != "failed":
            self.state = "running"
        self.results = []
        self.problem = await self._run()
        self.state = "failed" if self.problem else "done"

    async def _run(self) -> str | None:
        """None once calibrated, else what went wrong."""
        pair = await self._pair()
        if pair is None:
            return f"no discovered prefill and decode worker to probe within {WAIT_S:g} s"
        (p, ps), (d, ds) = pair
        self.pair = f"{p.name} -> {d.name}"
        # first: the overhead is what a decode step leaves. Only on an idle D (a retry, or
        # a router restarted beside a live fleet, may find it serving): its local prefills
        # would queue, and add computed tokens the verifier reads against pending splits
        if not self.local_learnt and self._idle(d):
            await self._local_rate(d, ds)
        for i, tokens in enumerate(PROBE_TOKENS):
            result = await probe_handoff(
                self.pool.client,
                endpoint(p),
                endpoint(d),
                model=model_of(ps),
                tokens=tokens,
                block_size=ps.block_size,
            )
            self.results.append(result)
            if not result.proved:
                problem = (
                    result.describe()
                    if result.error
                    else (result.describe() + ": the decode worker did not pull the KV")
                )
                log.error("P/D %s; fix: %s (probing again in a while)", problem, PROBE_FIX)
                return problem
            self._learn(p, d, result, sample=i > 0)
        log.warning("P/D calibrated: %s; %s", self.model.snapshot(), self.results[-1].describe())
        return None

    def _idle(self, h: WorkerHandle) -> bool:
        """No request in flight on any of the worker's endpoints (data-parallel ranks)."""
        load = self.pool.fleet.load
        return not any(load.view(f.state.name).requests for f in h.feeds)

    def _learn(self, p: WorkerHandle, d: WorkerHandle, r: ProbeResult, sample: bool) -> None:
        if not sample:
            return
        m = r.moved
        self.model.observe_transfer(m.bytes_transferred, m.xfer_seconds, m.external_kv_transfer)
        if not (self._idle(p) and self._idle(d)):
            return  # probing a serving fleet: its times are partly others' queue
        prefill = p.feeds[0].state.name
        self.model.observe_prefill(prefill, r.prompt_tokens, 0, r.prefill_leg_ms)
        if r.decode_ttft_ms is not None:
            self.model.observe_overhead(
                r.decode, r.decode_ttft_ms, r.prompt_tokens, r.prompt_tokens
            )

    async def _local_rate(self, h: WorkerHandle, state: WorkerState) -> None:
        for tokens in PROBE_TOKENS[1:]:
            n, ttft = await probe_local(
                self.pool.client, endpoint(h), model=model_of(state), tokens=tokens
            )
            if ttft is not None:
                self.model.observe_prefill(state.name, n, 0, ttft)
                self.local_learnt = True

    async def _pair(self) -> tuple[tuple[WorkerHandle, WorkerState], ...] | None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = [self._first(("prefill",)), self._first(("decode", "both"))]
            if all(f is not None for f in found):
                return tuple(f for f in found if f is not None)
            await asyncio.sleep(0.5)
        return None

    def _first(self, roles: tuple[str, ...]) -> tuple[WorkerHandle, WorkerState] | None:
        for h in self.pool.handles.values():
            state = h.feeds[0].state
            if state.role in roles and h.discovered and state.available:
                return h, state
        return None

    def problems(self) -> dict[str, tuple[str, str]]:
        return {} if self.problem is None else {self.pair: (self.problem, PROBE_FIX)}
