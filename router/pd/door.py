"""The prefill->decode door: completions and chat of a fleet with prefill workers.

Decode-first: the proxy door already asked the decision service with the `decode` profile;
here the uncached part of the prompt on that decode worker and the cost model decide whether
to split (`router.pd.model`); the prefill worker is chosen by the `prefill` profile over the
same fleet state. A request that stays local goes the proxy's own way (retries, timeouts).
A split runs the prefill leg, then the decode leg with the returned params
(`router.pd.legs`), and its pull is proved afterwards on the decode worker's metrics
(`router.pd.verify`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from router.asgi import CANCELLED_OUTCOMES, Send
from router.core.config import Config, pd_threshold
from router.core.decision import Constraints, Decision, WorkerScore
from router.core.errors import BadRequest, NoWorkerAvailable, UpstreamError, UpstreamTimeout
from router.forward import ConnectFailed, Forwarder, Outcome, WorkerTimedOut
from router.openai_req import RoutingInput
from router.pd import model as m
from router.pd.calibrate import PROBE_FIX, RETRY_S, Calibration
from router.pd.legs import (
    ClientRequest,
    LegFailed,
    PrefillAnswer,
    decode_leg,
    decode_timeouts,
    prefill_leg,
    reached_worker,
    tagged,
)
from router.pd.metrics import PDMetrics
from router.pd.verify import Verifier
from router.pd.wire import decode_body, not_splittable, request_doc
from router.processes import counts_worker_totals, role_from_env
from router.routing import DecisionService, Ticket
from router.upstream import UpstreamPool

log = logging.getLogger("kvroute.pd")

ACTIVE_POLL_S = 1.0  # how soon a fleet's first prefill worker, added after start, is probed
# prefill legs failing in a row on one worker before /health names it (one failure can be a
# restart or a blip; every one of them costs a second prefill)
PREFILL_FAILURES_DEGRADE = 3
UNKNOWN_WORKER = "?"  # the worker label of an orphan whose prefill worker is not known
# the first of --processes reads every decode worker at least this often: the KV bytes and
# failed pulls it alone counts keep up with its siblings' splits
SWEEP_S = 5.0

Local = Callable[[Any, Send], Awaitable[None]]
# the proxy's bookkeeping of an answer relayed from a worker: (ticket, request, outcome,
# the prefill worker of a split)
Answered = Callable[[Ticket, Any, Outcome, "str | None"], None]


def cached_tokens(score: WorkerScore, prompt_tokens: int) -> int:
    """Prompt tokens the engine will take from its cache (never the last one)."""
    bs = score.block_size
    return min(score.overlap_blocks * bs, max(prompt_tokens - 1, 0) // bs * bs)


class PDDoor:
    def __init__(
        self,
        svc: DecisionService,
        upstream: UpstreamPool,
        forwarder: Forwarder,
        config: Config,
        registry: CollectorRegistry,
        answered: Answered,
    ) -> None:
        self.svc = svc
        self.pool = svc.pool
        self.upstream = upstream
        self.forwarder = forwarder
        self.config = config
        link = config.pd_link_mb_s * 1e6 if config.pd_link_mb_s else None
        self.model = m.CostModel(
            pd_threshold(config.pd_threshold), link, config.pd_kv_bytes_per_token
        )
        self.metrics = PDMetrics(registry, self.model.snapshot)
        # the first of --processes counts every decode worker's pulls, its siblings' too
        sweep_s = SWEEP_S if role_from_env() is not None and counts_worker_totals() else None
        self.verifier = Verifier(self.pool, self.model, self.metrics, sweep_s=sweep_s)
        self.verifier.decode_workers = self._decode_endpoints
        self.pool.on_removed.append(self._forget_removed)
        # prefill worker -> (legs failed in a row there, the last failure)
        self._prefill_failures: dict[str, tuple[int, str]] = {}
        # the proxy's bookkeeping of each answer (router.proxy.ProxyDoor.answered): access
        # log, worker health and stream errors of decode legs
        self.answered = answered
        self.calibration = Calibration(self.pool, self.model)
        self._tasks: list[asyncio.Task[None]] = []
        if config.pd_fault_strip_params:
            log.warning("TEST FAULT --pd-fault-strip-params: decode legs lose their params")

    @property
    def active(self) -> bool:
        """Some worker has the prefill role."""
        return any(w.role == "prefill" for w in self.svc.fleet.workers.values())

    # ---- lifecycle (the app's lifespan) -----------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.verifier.run(), name="pd-verify"),
            asyncio.create_task(self._calibrate(), name="pd-calibrate"),
        ]

    async def _calibrate(self) -> None:
        if not self.config.pd_probe or pd_threshold(self.config.pd_threshold) == "never":
            self.calibration.state = "off"
            await self.verifier.baseline(self._decode_endpoints())
            return
        if not self.active:
            self.calibration.state = "off"
            await self.verifier.baseline(self._decode_endpoints())
            # prefill workers may join later (a workers file, DNS, the admin API): probe the
            # link when the first one does, as at start, or splits would go unproved and
            # /health would say nothing of it
            while not self.active:
                await asyncio.sleep(ACTIVE_POLL_S)
        await self.calibration.run()
        await self.verifier.baseline(self._decode_endpoints())
        wait = RETRY_S[0]
        while self.calibration.state == "failed":
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])
            await self.calibration.run()

    def _decode_endpoints(self) -> list[str]:
        return [w.name for w in self.svc.fleet.workers.values() if w.role != "prefill"]

    def _count(self, counter: Any, worker: str, cause: str) -> None:
        """One orphaned prefill or failed decode leg, by worker and cause. A worker that left
        the fleet while the request was in flight keeps no series for it: counted there,
        it would stay for good (its removal already forgot its series)."""
        self.metrics.child(counter, worker, cause).inc()
        if worker != UNKNOWN_WORKER and worker not in self.svc.fleet.workers:
            self.metrics.forget_worker([worker])

    def _forget_removed(self, h: object, names: list[str]) -> None:
        """Workers removed from the fleet: their ledgers, and their prefill failures (one
        added back starts afresh). Their endpoints' series go now; the decode totals,
        labelled by worker, once its ledger drained (Verifier.forget_removed)."""
        self.verifier.forget_removed()
        for name in names:  # its endpoints (data-parallel ranks: host:port#dpN)
            self._prefill_failures.pop(name, None)
        self.metrics.forget_worker(names)  # their series: orphans and decode errors by cause

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the decision -----------------------------------------------------------------

    async def plan(
        self, decision: Decision, rin: RoutingInput, doc: dict[str, Any]
    ) -> tuple[m.Plan, Decision | None]:
        """Split or not, and the prefill decision when split."""
        d = decision.best
        n = decision.prompt_tokens
        cached = cached_tokens(d, n)
        dside = m.Side(d.worker, n - cached, cached, d.requests, d.prefill_tokens)
        why = not_splittable(doc, rin.kind == "chat")
        if why is not None:
            return m.Plan(
                False, m.LOCAL_NOT_SPLITTABLE, d.worker, uncached=dside.new, detail=why
            ), None
        if self.model.threshold == "never" or dside.new < d.block_size:
            return self.model.decide(dside, None, d.block_size), None
        dry = decision.request.dry_run
        pdec, pside, why_not = await self._prefill_side(rin, d.worker, n, dry)
        return self.model.decide(dside, pside, d.block_size, why_not), pdec

    async def _prefill_side(
        self, rin: RoutingInput, decode: str, n: int, dry_run: bool
    ) -> tuple[Decision | None, m.Side | None, str]:
        """The prefill profile's pick, skipping saturated workers (`dry_run`: for
        /debug/route, which sends nothing: no placement wait)."""
        try:
            pdec = await self.svc.decide(
                rin,
                profile="prefill",
                constraints=Constraints(exclude=frozenset({decode})),
                dry_run=dry_run,
            )
        except NoWorkerAvailable:
            return None, None, m.LOCAL_NO_PREFILL
        limit = self.config.pd_max_prefill_inflight
        for s in pdec.ranked:
            if s.requests < limit:
                cached = cached_tokens(s, n)
                return pdec, m.Side(s.worker, n - cached, cached, s.requests, s.prefill_tokens), ""
        return pdec, None, m.LOCAL_SATURATED

    # ---- a request --------------------------------------------------------------------

    async def serve(self, r: ClientRequest, send: Send, local: Local) -> None:
        doc = request_doc(r.body)
        if "kv_transfer_params" in doc:
            raise BadRequest(
                "kv_transfer_params are set by the router in a prefill/decode fleet",
                param="kv_transfer_params",
            )
        plan, pdec = await self.plan(r.decision, r.rin, doc)
        self.metrics.decisions.labels("split" if plan.split else "local", plan.reason).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", r.request_id.decode(errors="replace"), plan.explain())
        if plan.split and pdec is not None:
            await self._split(r, send, local, plan, pdec, doc)
        else:
            await self._local(r, tagged(send, plan), local, plan)

    async def _local(
        self, r: ClientRequest, send: Send, local: Local, plan: m.Plan, learn: bool = True
    ) -> None:
        """The proxy's way, on the decode worker; a streamed answer's time to first token
        teaches the model that worker's prefill rate (when nothing queued before it)."""
        try:
            await local(r, send)
        finally:  # a client that hangs up after its first token still taught us
            if learn and r.rin.stream and r.first_byte is not None:
                self._learn_local(r, plan)

    def _learn_local(self, r: ClientRequest, plan: m.Plan) -> None:
        d = r.decision.best
        if r.tries != [d.worker]:
            return  # retried: its wait was a failed worker's timeout plus another's prefill
        if plan.uncached > 0 and d.prefill_tokens == 0 and r.first_byte is not None:
            ms = (r.first_byte - r.started) * 1000
            cached = r.decision.prompt_tokens - plan.uncached
            self.model.observe_prefill(d.worker, plan.uncached, cached, ms)

    async def _split(
        self,
        r: ClientRequest,
        send: Send,
        local: Local,
        plan: m.Plan,
        pdec: Decision,
        doc: dict[str, Any],
    ) -> None:
        assert plan.prefill is not None
        gone = self._gone_since(plan.decode, "decode")
        if gone is not None:
            # removed or ejected while the prefill side was decided: the proxy's way
            # decides again
            self.metrics.fallbacks.labels(gone).inc()
            await local(r, tagged(send, plan, fallback=gone))
            return
        # the decode worker's load is counted from the decision, not from the decode leg:
        # concurrent splits must see each other there (busy bounds, shedding, the load
        # score), or a burst of them all lands on one decode worker during their prefills.
        # Its decode step only, and its cache from the pull on (DecisionService.pulled)
        ticket = self.svc.start(r.decision, plan.decode, handoff=True)
        try:
            answer = await self._prefill(r, plan, pdec, doc)
        except BaseException:
            self.svc.release(ticket)
            raise
        if isinstance(answer, str):
            self.svc.release(ticket)
            await self._local(r, tagged(send, plan, fallback=answer), local, plan, learn=False)
            return
        self.metrics.prefill_leg.observe(answer.seconds)
        await self._decode(r, send, local, plan, answer.params, ticket)

    def _gone_since(self, worker: str, leg: str) -> str | None:
        """Why `worker` can no longer take its `leg` (prefill, decode) of a split since the
        decision, as the fallback's cause (None: it can). A drain lets it finish what it
        was given, so only removal and ejection (hung, unreachable) count."""
        state = self.svc.fleet.workers.get(worker)
        if state is None:
            return f"{leg}_removed"
        return None if state.available else f"{leg}_unavailable"

    async def _prefill(
        self, r: ClientRequest, plan: m.Plan, pdec: Decision, doc: dict[str, Any]
    ) -> PrefillAnswer | str:
        """The prefill leg's answer, or why it failed (the request is prefilled locally)."""
        worker = plan.prefill
        assert worker is not None
        h = self.pool.handle_of(worker)
        state = self.svc.fleet.workers.get(worker)
        gone = self._gone_since(worker, "prefill")
        if gone is not None or h is None or state is None:
            gone = gone or "prefill_removed"
            self.metrics.fallbacks.labels(gone).inc()
            return gone
        # a leg that queued behind others on P times its queue too: as on the local path,
        # only one sent to a worker with nothing before it teaches P's prefill rate
        alone = self.svc.fleet.load.view(worker).prefill_tokens == 0
        ticket = self.svc.start(pdec, worker)
        sent_at = self.pool.clock.now()
        try:
            answer = await prefill_leg(
                self.upstream, h, r, doc, state.rank, self.config, state.block_size
            )
        except LegFailed as exc:
            self._prefill_failed(worker, ticket, exc, sent_at)
            return exc.cause
        except asyncio.CancelledError:
            self.svc.finish(ticket, status=0, outcome=r.cancelled_outcome())
            raise
        self.svc.first_token(ticket)
        self.svc.finish(ticket, status=200, cached_tokens=answer.cached_tokens)
        self.pool.note_answered(worker)
        self._prefill_failures.pop(worker, None)
        if alone:
            s = pdec.score_of(worker)
            cached = cached_tokens(s, pdec.prompt_tokens)
            self.model.observe_prefill(
                worker, pdec.prompt_tokens - cached, cached, answer.seconds * 1000
            )
        return answer

    def _prefill_failed(self, worker: str, ticket: Ticket, exc: LegFailed, sent_at: float) -> None:
        if exc.cause == "prefill_refused":  # the request's fault: no word against the worker
            log.debug("prefill leg on %s refused the request (%s)", worker, exc.detail)
            self.svc.finish(ticket, status=exc.status)
            self.metrics.fallbacks.labels(exc.cause).inc()
            return
        log.warning(
            "prefill leg on %s failed (%s): prefilling on the decode worker", worker, exc.detail
        )
        if exc.status:  # it answered: an HTTP error, or params unfit to forward
            self.svc.finish(ticket, status=exc.status)
        else:
            outcome = "timeout" if exc.cause == "prefill_timeout" else "connect_failed"
            self.svc.finish(ticket, status=0, outcome=outcome)
        self.metrics.fallbacks.labels(exc.cause).inc()
        count, _ = self._prefill_failures.get(worker, (0, ""))
        self._prefill_failures[worker] = (count + 1, f"{exc.cause}: {exc.detail}")
        if exc.orphan:
            self._count(self.metrics.orphans, worker, "bad_params")
        if exc.cause == "prefill_timeout":
            # a prefill worker's engine generates one token a prefill: where any finished
            # meanwhile, this one waited in a busy queue, not on a hung engine
            self.pool.timed_out(worker, sent_at, "prefill leg")
        elif exc.cause == "prefill_failed" and exc.detail.startswith(("connect", "closed")):
            self.pool.eject(worker, f"prefill leg: {exc.detail}")

    async def _decode(
        self,
        r: ClientRequest,
        send: Send,
        local: Local,
        plan: m.Plan,
        params: dict[str, Any],
        ticket: Ticket,
    ) -> None:
        worker = plan.decode
        h = self.pool.handle_of(worker)
        state = self.svc.fleet.workers.get(worker)
        gone = self._gone_since(worker, "decode")
        if h is None or state is None or gone is not None:
            gone = gone or "decode_removed"
            self.svc.release(ticket)
            # removed while the prefill ran (the admin API, a workers file, DNS), or ejected
            # (hung, unreachable: a leg sent there would wait out its timeouts): nobody will
            # pull that KV; the proxy's way decides again among the workers left
            self._count(self.metrics.orphans, plan.prefill or UNKNOWN_WORKER, gone)
            self.metrics.fallbacks.labels(gone).inc()
            await local(r, tagged(send, plan, fallback=gone))
            return
        body = r.body if self.config.pd_fault_strip_params else decode_body(r.body, params)
        timeouts = decode_timeouts(
            self.config, r.rin.stream, self.model.transfer_ms(plan.uncached), plan.uncached
        )
        sent = time.perf_counter()
        sent_at = self.pool.clock.now()

        def first_byte() -> None:
            self.svc.first_token(ticket)
            self.svc.pulled(ticket)
            r.first_byte = time.perf_counter()

        self.verifier.started(worker)
        proved: int | None = None
        try:
            result = await decode_leg(
                self.forwarder,
                h,
                worker,
                r,
                body,
                state.rank,
                tagged(send, plan),
                timeouts,
                first_byte,
            )
            proved = self._decoded(r, plan, ticket, result, sent)
        except ConnectFailed as exc:
            await self._decode_unsent(r, send, local, plan, ticket, exc, sent_at)
        except asyncio.CancelledError:
            if r.first_byte is not None:  # the first token came: the pull happened
                proved = self._learn_split(r, plan, sent)
            self._decode_gone(r, plan, ticket, r.cancelled_outcome())
            raise
        except UpstreamError:
            self._decode_gone(r, plan, ticket, "worker_failed")
            raise
        except UpstreamTimeout:  # its head came, its whole answer did not
            self._decode_gone(r, plan, ticket, "timeout")
            raise
        except BaseException:
            self._decode_gone(r, plan, ticket, "error")
            raise
        finally:
            self.verifier.ended(worker, proved)

    def _decoded(
        self, r: ClientRequest, plan: m.Plan, ticket: Ticket, result: Outcome, sent: float
    ) -> int | None:
        """The decode leg answered; what its pull should prove (None: nothing)."""
        self.svc.finish(ticket, status=result.status)  # its cached_tokens are the prefill's
        self.answered(ticket, r, result, plan.prefill)
        if result.status != 200 or result.broken is not None:
            cause = result.broken or f"http_{result.status}"
            self._count(self.metrics.decode_errors, plan.decode, cause)
            # refused: it pulled nothing (a stream cut after its first token is relayed as a
            # 502, but it pulled: D holds the prompt)
            if r.first_byte is None or (result.broken is None and result.status != 200):
                self._count(self.metrics.orphans, plan.prefill or UNKNOWN_WORKER, "decode_failed")
                # its answer was the first byte, which credited D with the pull
                self.svc.unbelieve(ticket)
            return None
        return self._learn_split(r, plan, sent)

    def _learn_split(self, r: ClientRequest, plan: m.Plan, sent: float) -> int:
        """A split's first token came: its handoff latency, and what the decode leg's time
        to first token says of the overhead. Returns the tokens its pull must prove."""
        if r.first_byte is not None:
            self.metrics.handoff.observe(r.first_byte - r.started)
            if r.rin.stream:
                ttft = (r.first_byte - sent) * 1000
                self.model.observe_overhead(
                    plan.decode, ttft, plan.uncached, r.decision.prompt_tokens
                )
        return plan.uncached

    async def _decode_unsent(
        self,
        r: ClientRequest,
        send: Send,
        local: Local,
        plan: m.Plan,
        ticket: Ticket,
        exc: ConnectFailed,
        sent_at: float,
    ) -> None:
        """Nothing reached the client. A decode worker that timed out may still hold the
        request and be pulling: one error, and one toward ejecting it where its engine
        generated nothing meanwhile (as the proxy counts it). One that never took it, or
        dropped the connection (the engine aborts a request whose connection closed):
        served the proxy's way instead, as the proxy serves a worker that fails so."""
        timed_out = isinstance(exc, WorkerTimedOut)
        self.svc.finish(ticket, status=0, outcome="timeout" if timed_out else "connect_failed")
        self._count(self.metrics.orphans, plan.prefill or UNKNOWN_WORKER, "decode_failed")
        if timed_out:
            self.pool.timed_out(plan.decode, sent_at, f"decode leg: {exc.detail}")
            self._count(self.metrics.decode_errors, plan.decode, "timeout")
            raise UpstreamTimeout(
                "the decode worker did not answer in time", detail=f"{plan.decode}: {exc.detail}"
            )
        cause = "decode_closed" if reached_worker(exc) else "decode_unreachable"
        if cause == "decode_closed":
            self._count(self.metrics.decode_errors, plan.decode, "closed")
        self.pool.eject(plan.decode, f"decode leg: {exc.detail}")
        self.metrics.fallbacks.labels(cause).inc()
        await local(r, tagged(send, plan, fallback=cause))

    def _decode_gone(self, r: ClientRequest, plan: m.Plan, ticket: Ticket, outcome: str) -> None:
        cancelled = outcome in CANCELLED_OUTCOMES
        self.svc.finish(ticket, status=0 if cancelled else 502, outcome=outcome)
        if r.first_byte is None:  # the pull may never have happened
            self._count(self.metrics.orphans, plan.prefill or UNKNOWN_WORKER, outcome)
        if not cancelled:
            self._count(self.metrics.decode_errors, plan.decode, outcome)

    # ---- what the control endpoints show ----------------------------------------------

    async def explain(
        self, decision: Decision, rin: RoutingInput, doc: dict[str, Any]
    ) -> dict[str, Any]:
        """The P/D part of `/debug/route`."""
        plan, pdec = await self.plan(decision, rin, doc)
        out: dict[str, Any] = {
            "decision": "split" if plan.split else "local",
            "reason": plan.reason,
            "decode_worker": plan.decode,
            "prefill_worker": plan.prefill,
            "uncached_tokens": plan.uncached,
            "terms_ms": {k: round(v, 2) for k, v in plan.terms.items()},
            "threshold": self.config.pd_threshold,
            "estimates": self.model.snapshot(),
            "prefill_fits": self.model.fits_doc(),
            "explain": plan.explain(),
        }
        if pdec is not None:
            out["prefill_explain"] = pdec.explain()
        return out

    def _prefill_problems(self) -> dict[str, tuple[str, str]]:
        """Prefill workers whose last legs all failed: each of their splits is prefilled
        twice (there, then on the decode worker), which only this shows."""
        out: dict[str, tuple[str, str]] = {}
        for worker, (count, last) in self._prefill_failures.items():
            if count >= PREFILL_FAILURES_DEGRADE and worker in self.svc.fleet.workers:
                text = (
                    f"prefill worker {worker}: its last {count} prefill legs failed (last: "
                    f"{last}); those requests were prefilled again on their decode worker"
                )
                out[worker] = (text, PROBE_FIX)
        return out

    def health(self) -> dict[str, Any] | None:
        """The P/D part of `/health` (None without prefill workers): degraded, with the
        decode workers named, when a split was not proved or a pull failed."""
        if not self.active:
            return None
        problems = self.verifier.problems()
        problems |= self.calibration.problems()
        problems |= self._prefill_problems()
        doc: dict[str, Any] = {
            "status": "degraded" if problems else "ok",
            "threshold": self.config.pd_threshold,
            "calibration": self.calibration.state,
            **self.model.snapshot(),
            **self.verifier.totals(),
            "workers": sorted(problems),
            "problems": [p for p, _ in problems.values()],
        }
        fixes = [f for _, f in problems.values() if f]
        if fixes:
            doc["fix"] = "; ".join(dict.fromkeys(fixes))
        if self.config.pd_fault_strip_params:
            doc["test_fault"] = "pd_fault_strip_params: decode legs are sent without their params"
        return doc
