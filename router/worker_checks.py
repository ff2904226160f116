"""Periodic probes of the workers: health checks (ejection and re-admission), load scraping,
served models, cache config, tokenizer parity and routing modes. Owned by the worker pool,
whose loops call them."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import httpx

from engines.base import EngineMetrics
from indexer.health import EventHealth
from router.core.errors import BadRequest
from router.core.fleet import APPROX, EVENTS
from router.core.load import LEARN_CONFIRM_S
from router.verdicts import log_problems, worker_reports

if TYPE_CHECKING:
    from router.workers import Feed, WorkerHandle, WorkerPool

log = logging.getLogger("kvroute.workers")

CONTROL_TIMEOUT_S = 10.0  # every control-plane call is bounded: a hung worker stalls nothing
CONTROL_KEEPALIVE_S = 4.0  # an idle control connection is not reused past this (vLLM: 5 s)
PROBE_TEXT = "kvroute tokenizer probe: The quick brown fox jumps over 13 lazy dogs."
PROBE_CHAT = [{"role": "user", "content": PROBE_TEXT}]


def _grew(before: float | None, now: float | None) -> bool:
    return before is not None and now is not None and now > before


def restarted(before: EngineMetrics | None, now: EngineMetrics) -> bool:
    """A counter that only grows went down: a new engine process. Generated tokens too, as
    vLLM counts no prefix-cache queries with prefix caching off."""
    if before is None:
        return False
    return any(
        was is not None and is_ is not None and is_ < was
        for was, is_ in (
            (before.prefix_queries, now.prefix_queries),
            (before.generation_tokens, now.generation_tokens),
        )
    )


class WorkerChecks:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._last_error_log: dict[str, float] = {}
        self._told_learns_nothing: set[str] = set()  # workers logged as learning no limit
        self._told_no_base = False  # the --lora-resolver base served nowhere, logged
        self._told_no_chat: set[str] = set()  # models logged as having no chat template
        self.health_rounds = 0  # completed health-check rounds (tests wait on it)
        self._crowded_at: dict[str, float] = {}  # worker -> when it was last scraped for it
        self._crowded_tasks: set[asyncio.Task[None]] = set()
        # one scrape of a worker at a time: two in flight could land out of order, and an
        # older answer's counters after a newer one's read as an engine restart
        self._scraping: dict[str, asyncio.Lock] = {}
        if pool.config.busy_learn_batch:
            pool.fleet.load.on_crowded = self.crowded

    def crowded(self, endpoint: str) -> None:
        """A worker got more requests than it was ever seen running: scrape it now, to learn
        its batch limit before a queue builds there. At most once a scrape interval: a
        worker queueing for KV blocks stays crowded and never teaches a limit."""
        h = self.pool.handle_of(endpoint)
        if h is None or self._scrape_lock(h).locked():
            return
        now = asyncio.get_running_loop().time()
        every = self.pool.config.scrape_interval_s
        if now - self._crowded_at.get(h.name, -every) < every:
            return
        self._crowded_at[h.name] = now
        task = asyncio.create_task(self._scrape_crowded(h))
        self._crowded_tasks.add(task)
        task.add_done_callback(self._crowded_tasks.discard)

    async def _scrape_crowded(self, h: WorkerHandle) -> None:
        try:
            await self._scrape_one(h)
        except Exception:  # as the periodic loop: a failing probe is logged, never raised
            log.exception("scraping crowded worker %s failed", h.name)

    async def stop(self) -> None:
        """Cancel the scrapes of crowded workers still under way (the pool is stopping)."""
        tasks = list(self._crowded_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- health ----------------------------------------------------------------------

    async def health(self) -> None:
        await asyncio.gather(*(self._check_one(h) for h in list(self.pool.handles.values())))
        self.health_rounds += 1

    async def _check_one(self, h: WorkerHandle) -> None:
        from router.workers import EJECT_AFTER_FAILURES

        ejections = h.ejections
        try:
            resp = await self.pool.client.get(
                f"{h.url}/health", headers=h.auth, timeout=self.pool.config.health_timeout_s
            )
            ok = resp.status_code == 200
            why = "" if ok else f"/health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if not ok:
            h.failures += 1
            h.last_error = why
            if h.failures >= EJECT_AFTER_FAILURES:
                self.pool.set_down(h, why)
            return
        was_down = h.failures >= EJECT_AFTER_FAILURES or not h.available
        h.failures = 0
        if was_down and self.pool.held(h) > 0:
            return  # ejected for timeouts again: a passing /health is no sign of its engine
        if not h.discovered:
            if h.lock.locked():
                return  # its discovery is under way: no round waits on one worker's calls
            await self.pool.discover_once(h)
        elif was_down:
            # it may be a new engine process with other flags: ask it again. An ejection is
            # often a blip (a connect failure, slow probes under load) with the engine and
            # its cache intact, so what is known of the cache goes only where the answers
            # show a restart (its counters back, its publishers changed); one they miss still
            # shows when its KV event sequence begins again (the subscription stays)
            await self.pool.ask_again(h)
        else:
            await self.refresh_models(h, timeout=self.pool.config.health_timeout_s)
        if h.ejections != ejections:
            return  # ejected while this check ran: its answer predates the fault
        if was_down:
            # a fresh count for a worker back in rotation (late timeouts of requests cut at
            # its ejection included); a passing /health alone does not clear requests timing
            # out: an engine whose server answers while its model hangs passes every one
            h.timeouts_by.clear()
        if not h.available:
            log.warning("worker %s is healthy again: re-admitted", h.name)
        h.set_available(True)

    # ---- load ------------------------------------------------------------------------

    async def fetch_metrics(self, h: WorkerHandle) -> EngineMetrics | None:
        try:
            resp = await self.pool.client.get(f"{h.url}/metrics", headers=h.auth)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return h.adapter.parse_metrics(resp.text)
        except ValueError:
            return None

    async def scrape(self) -> None:
        handles = list(self.pool.handles.values())
        for gone in self._scraping.keys() - {h.name for h in handles}:
            del self._scraping[gone]
            self._crowded_at.pop(gone, None)
        await asyncio.gather(*(self._scrape_one(h) for h in handles))

    def _scrape_lock(self, h: WorkerHandle) -> asyncio.Lock:
        return self._scraping.setdefault(h.name, asyncio.Lock())

    async def _scrape_one(self, h: WorkerHandle, confirm: bool = True) -> None:
        async with self._scrape_lock(h):
            await self._scrape_now(h)
        load = self.pool.fleet.load
        if confirm and any(load.confirming(f.state.name) for f in h.feeds):
            await asyncio.sleep(LEARN_CONFIRM_S)
            await self._scrape_one(h, confirm=False)

    async def _scrape_now(self, h: WorkerHandle) -> None:
        m = await self.fetch_metrics(h)
        if m is None or self.pool.handles.get(h.name) is not h:
            return  # failed, or the worker was removed (or replaced) meanwhile
        load = self.pool.fleet.load
        if restarted(h.metrics, m):  # rediscovering forgets its batch limit too
            h.metrics = m
            await self.pool.rediscover(h, "its /metrics counters went back (engine restart)")
        now = self.pool.clock.now()
        if _grew(h.metrics.generation_tokens if h.metrics else None, m.generation_tokens):
            h.progressed_at = now
        for rank, figures in m.by_rank.items():
            was = h.metrics.by_rank.get(rank) if h.metrics else None
            if _grew(was.generation_tokens if was else None, figures.generation_tokens):
                h.rank_progressed_at[rank] = now
        h.metrics = m
        for f in h.feeds:
            # a DP rank's own figures; a rank its engine did not report is left as it was
            src = m.by_rank.get(f.state.rank) if f.state.rank is not None else m
            if src is None:
                continue
            # engines also queue requests while their batch has room: one serving LoRA
            # adapters, for an adapter it has no slot for (vLLM's --max-loras); a handoff's
            # decode worker, for KV still on its way (WAITING_FOR_REMOTE_KVS). Where the
            # engine counts those apart (vLLM >= 0.32: "deferred"), the rest still teaches;
            # else such a worker teaches nothing. A plain worker's queue teaches whole: vLLM
            # keeps a request "deferred" until it is scheduled, so a full batch's queue of
            # JSON or tool requests (each deferred on arrival for its grammar) is all
            # "deferred" and would teach nothing
            resolver = self.pool.fleet.lora_resolver
            loads = resolver is not None and resolver in (f.state.models or ())
            plain = not (f.state.adapters or loads) and f.state.role == "both"
            deferred = 0.0 if plain else src.deferred
            if deferred is None:
                self._learns_nothing(f.state.name, f.state.role)
            load.scraped(
                f.state.name, src.running, src.waiting, src.kv_usage, m.num_gpu_blocks, deferred
            )

    def forget(self, names: list[str]) -> None:
        """Endpoints removed from the fleet."""
        for name in names:
            self._last_error_log.pop(name, None)
            self._told_learns_nothing.discard(name)

    def _learns_nothing(self, worker: str, role: str) -> None:
        """Say once per worker why its batch limit is never learned, and what to set."""
        if not self.pool.config.busy_learn_batch or worker in self._told_learns_nothing:
            return
        self._told_learns_nothing.add(worker)
        why = "serves LoRA adapters" if role == "both" else f"is a {role} worker of a handoff"
        log.info(
            "worker %s %s and its engine does not count the requests it holds for another "
            "reason apart (vLLM >= 0.32 does: vllm:num_requests_waiting_by_reason): kvroute "
            "learns no batch limit there; set --busy-max-requests to its --max-num-seqs",
            worker,
            why,
        )

    # ---- what the worker serves ------------------------------------------------------

    async def refresh_models(self, h: WorkerHandle, timeout: float | None = None) -> None:
        """Served names (base model and LoRA adapters) define the worker's model pools."""
        try:
            resp = await self.pool.client.get(
                f"{h.url}/v1/models",
                headers=h.auth,
                timeout=timeout if timeout is not None else CONTROL_TIMEOUT_S,
            )
            data = resp.json().get("data", []) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            h.last_error = f"GET /v1/models: {exc}"
            return
        if resp.status_code in (401, 403):
            # vLLM's --api-key guards /v1: its models stay unknown, so it is eligible for
            # every model a client names (a request for another model gets its 404)
            if "api_key" not in h.problems:
                log.error("worker %s refused GET /v1/models (%d)", h.name, resp.status_code)
            h.problems["api_key"] = (
                f"worker {h.name} refused kvroute's GET /v1/models ({resp.status_code}): it "
                "runs with --api-key, so the models it serves are unknown and it takes "
                "requests for any model; give kvroute one of its keys (--worker-api-key, "
                "KVROUTE_WORKER_API_KEY, or api_key: for this worker)"
            )
            return
        h.problems.pop("api_key", None)
        if data is None:
            return
        cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        names = frozenset(str(m["id"]) for m in cards)
        adapters = {
            str(m["id"]): str(m["parent"])
            for m in cards
            if m.get("parent") and m.get("parent") != m.get("id")
        }
        before = h.feeds[0].state.models
        if before is not None and names != before:
            # an adapter loaded (at its first request, by a LoRA resolver, or by an operator)
            # is routine; a model or adapter gone is not. Only the change: a fleet may load
            # thousands of adapters
            if names - before:
                log.info("worker %s now serves %s too", h.name, ", ".join(sorted(names - before)))
            if before - names:
                gone = ", ".join(sorted(before - names))
                log.warning("worker %s no longer serves %s", h.name, gone)
        h.models = cards
        lens = [int(m["max_model_len"]) for m in cards if isinstance(m.get("max_model_len"), int)]
        for state in h.states:
            state.models = names
            state.adapters = adapters
            state.max_model_len = min(lens) if lens else None
        self._check_resolver_base()

    def _check_resolver_base(self) -> None:
        """Say once when --lora-resolver names a base model no worker serves: every adapter
        request would be a 404."""
        base = self.pool.fleet.lora_resolver
        states = self.pool.fleet.workers.values()
        # an empty fleet (its last worker removed while its models were fetched) says nothing
        # of the base yet
        if (
            base is None
            or self._told_no_base
            or not states
            or any(s.models is None for s in states)
        ):
            return
        if not any(base in s.models for s in states if s.models and base not in s.adapters):
            self._told_no_base = True
            log.error(
                "--lora-resolver names %r, which no worker serves (they serve %s): adapters "
                "loaded on demand would all be 404s; name the base model as the workers' "
                "/v1/models does (their --served-model-name)",
                base,
                ", ".join(self.pool.fleet.served_models()) or "nothing",
            )

    def apply_cache_config(self, h: WorkerHandle) -> None:
        m = h.metrics
        if m is None:
            return
        # asked again, the engine's answer replaces what an earlier one found
        h.problems.pop("block_size", None)
        h.problems.pop("prefix_caching", None)
        configured = h.config.block_size or self.pool.config.block_size
        margin = self.pool.config.index_cap_margin
        for state in h.states:
            if m.num_gpu_blocks:
                state.capacity_blocks = m.num_gpu_blocks
                self.pool.fleet.set_capacity(state.name, int(m.num_gpu_blocks * margin))
            if m.block_size and not configured:
                state.block_size = m.block_size
            state.caching = m.prefix_caching is not False
        hints = h.adapter.hints
        if m.block_size and configured and m.block_size != configured:
            h.problems["block_size"] = (
                f"worker {h.name}: block size mismatch: configured block_size={configured} "
                f"but the engine reports block_size={m.block_size}; "
                + hints.block_size_mismatch.format(configured=configured, reported=m.block_size)
            )
        if m.prefix_caching is False:
            h.problems["prefix_caching"] = (
                f"worker {h.name} runs with prefix caching off: nothing can be reused, KV-aware "
                f"routing is pointless; {hints.prefix_caching_off}"
            )

    async def check_tokenizers(self, h: WorkerHandle) -> None:
        """For each base model the worker serves: tokenize a probe here and on the worker;
        a difference breaks every prefix match."""
        h.problems.pop("tokenizer", None)
        bases = [str(m["id"]) for m in h.models if not m.get("parent") or m["parent"] == m["id"]]
        for model in bases or [""]:
            tok = self.pool.tokenizers.local(model)
            if tok is None:
                continue
            problem = await self._probe_tokenizer(h, model, tok)
            if problem:
                h.problems["tokenizer"] = problem
                return

    async def _probe_tokenizer(self, h: WorkerHandle, model: str, tok: Any) -> str | None:
        mine = {"completion": tok.completion(PROBE_TEXT)}
        bodies: dict[str, dict[str, Any]] = {"completion": {"model": model, "prompt": PROBE_TEXT}}
        chat = self._chat_probe(model, tok)
        if chat is not None:
            mine["chat"] = chat
            bodies["chat"] = {"model": model, "messages": PROBE_CHAT, "add_generation_prompt": True}
        for kind, body in bodies.items():
            try:
                resp = await self.pool.client.post(f"{h.url}/tokenize", json=body, headers=h.auth)
                theirs = resp.json().get("tokens") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                theirs = None
            if theirs is None or theirs == list(mine[kind]):
                continue  # an engine without /tokenize: router-check warns
            return (
                f"worker {h.name}: tokenizer mismatch for model {model or '?'} on a {kind} "
                f"probe: the router makes {len(mine[kind])} tokens {list(mine[kind][:6])}..., "
                f"the worker {len(theirs)} tokens {theirs[:6]}...; "
                + h.adapter.hints.tokenizer_mismatch
            )
        return None

    def _chat_probe(self, model: str, tok: Any) -> list[int] | None:
        """The probe chat's tokens, or None when the tokenizer cannot render a chat: a base
        model without a chat template serves completions (vLLM answers its chats 400, as
        the router does), so that must not stop the router from starting."""
        try:
            return list(tok.chat(PROBE_CHAT))
        except BadRequest as exc:
            if model not in self._told_no_chat:
                self._told_no_chat.add(model)
                log.warning(
                    "model %s: chat tokenizer probe skipped, completions still checked: %s",
                    model or "(default)",
                    exc.message,
                )
            return None

    # ---- modes -----------------------------------------------------------------------

    async def refresh_modes(self) -> None:
        """Every second: modes follow event health, and broken workers are logged (at most
        once a minute each) whether or not anyone polls /health."""
        reports = []
        for h in self.pool.handles.values():
            for f in h.feeds:
                self.refresh_mode(h, f)
            reports += worker_reports(self.pool, h)
        log_problems(reports, self.pool.clock.now(), self._last_error_log)

    def refresh_mode(self, h: WorkerHandle, f: Feed) -> None:
        """auto: events while they flow, approximate otherwise (and /health says so)."""
        if h.mode_setting in (APPROX, EVENTS):
            f.state.mode = h.mode_setting
            return
        report = f.state.health.report() if f.state.health else None
        flowing = f.task is not None and (
            report is None or report.state not in (EventHealth.NO_EVENTS, EventHealth.STALE)
        )
        mode = EVENTS if flowing else APPROX
        if mode == APPROX and f.state.mode != APPROX:
            # what an earlier approximate stint recorded predates what the events said
            # since (a cache cleared, blocks evicted): guessing starts afresh
            self.pool.fleet.approx.forget_worker(f.state.name)
        f.state.mode = mode
