"""The decision service: the one routing decision every door calls (the HTTP proxy,
`/debug/route` and `kvroute explain`, the Envoy ext_proc picker, the prefill->decode handoff).

    decision = await svc.decide(rin, profile="default", constraints=Constraints(...))
    ticket = svc.start(decision, decision.best.worker)   # load, predicted entries
    svc.first_token(ticket)                             # prefill done: load moves to decode
    svc.finish(ticket, status=200, cached_tokens=n)     # load released, fidelity observed

`decide` tokenizes the prompt with the model's tokenizer (local, or a worker of the model's
pool), namespaces it (model, LoRA adapter, cache_salt) and asks the pure picker
(`router.core.picker`) with the named profile over the shared fleet state. Errors are the
project's error tree: 404 for a model nobody serves (listing the served ones), 503 when no
endpoint is eligible, 429 when every endpoint is busy and shedding is on (counted in
`kvroute_requests_shed_total`; a `dry_run` decision is never shed), 400 for a request that
cannot be tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from indexer.clock import Clock
from indexer.hashing import Namespace
from indexer.ingest import BurstLog
from router.core.config import Config
from router.core.decision import Constraints, Decision, RouteRequest
from router.core.errors import BadRequest, NoWorkerAvailable, Overloaded
from router.core.filters import unknown_model
from router.core.fleet import EVENTS, FleetState, serves
from router.core.load import Ticket as LoadTicket
from router.core.picker import Picker
from router.core.profiles import Profile
from router.metrics import RouterMetrics
from router.openai_req import PROMPT_PATHS, RoutingInput
from router.tokenize import TokenCache, special_ends, truncate
from router.tokenizers import TokenizerSet
from router.workers import WorkerPool

log = logging.getLogger("kvroute.routing")

__all__ = ["Constraints", "DecisionService", "Ticket"]

NO_CONSTRAINTS = Constraints()


# The load estimate of a request's output: vLLM generates at most the context its prompt
# leaves (a larger max_tokens is capped, not refused), and refuses an n past its
# VLLM_MAX_N_SEQUENCES (default 16384) itself. Clients choose both numbers, of any size.
MAX_N_ESTIMATE = 16384
UNKNOWN_CONTEXT = 1 << 20  # the context assumed of a worker whose max_model_len is unknown


def output_blocks(req: RouteRequest, block_size: int, max_model_len: int | None) -> int:
    """KV blocks the request's output sequences may fill, as the engine will cap them."""
    room = max((max_model_len or UNKNOWN_CONTEXT) - req.prompt_tokens, 0)
    tokens = min(req.max_tokens, room) * min(req.n, MAX_N_ESTIMATE)
    return -(-tokens // block_size)  # ceil, in integers


@dataclass
class Ticket:
    """One request in flight on one endpoint, from `start` to `finish`."""

    decision: Decision
    worker: str
    load: LoadTicket
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    done: bool = False
    # the pick's belief of the endpoint's cache was recorded (a handoff's only at its pull)
    believed: bool = True


def _too_long(limit: int, tokens: int, qualifier: str) -> BadRequest:
    return BadRequest(
        f"This model's maximum context length is {limit} tokens. However, your prompt has "
        f"{qualifier}{tokens} tokens. Please reduce the length of the prompt.",
        param="prompt",
    )


class DecisionService:
    def __init__(
        self,
        config: Config,
        fleet: FleetState,
        pool: WorkerPool,
        tokenizers: TokenizerSet,
        metrics: RouterMetrics,
        profiles: dict[str, Profile],
        clock: Clock,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.pool = pool
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.profiles = profiles
        self.picker = Picker(fleet, timer=time.perf_counter)
        self.clock = clock
        self.started = False
        self.draining = False  # SIGTERM: stop taking new traffic
        self._remote_cache = TokenCache()
        self._burst_log = BurstLog(clock)
        # told (endpoint, block hashes) of every request sent: the replicas' placement link
        # (and whether its prefix was new: the link sends those at once)
        self.on_sent: list[Callable[[str, Sequence[int], bool], None]] = []
        # told (worker, prompt's block hashes) when a request placed there was served
        # elsewhere: the placement link takes it back on the other replicas
        self.on_withdrawn: list[Callable[[str, Sequence[int]], None]] = []
        # called just before each pick: the placement link applies what the peers sent
        self.before_pick: list[Callable[[], object]] = []
        # seconds to wait before placing a new prefix (the placement link: a replica that
        # is not the first of its peers waits to see what they placed meanwhile)
        self.placement_wait: Callable[[], float] = lambda: 0.0
        # router replicas: linked to the peers (router/peers.py PlacementLink.linked)
        self.peers_linked: Callable[[], bool] = lambda: True

    # ---- the decision ----------------------------------------------------------------

    @staticmethod
    def route_path(path: str) -> str | None:
        """ "completion" | "chat" for the POST paths whose body is a prompt to route by."""
        return PROMPT_PATHS.get(path)

    async def decide(
        self,
        rin: RoutingInput,
        *,
        profile: str | None = None,
        constraints: Constraints | None = None,
        dry_run: bool = False,
    ) -> Decision:
        t0 = time.perf_counter()
        self._check_model(rin.model)
        base = self.fleet.base_of(rin.model)
        limit = self.fleet.max_model_len(rin.model)
        try:
            keep = rin.keep_tokens(limit)
        except BadRequest:  # a cut longer than the context: vLLM's pooling may allow it
            if not rin.engine_judges_length:
                raise
            keep = None
        if limit is not None and keep is None:  # vLLM checks the length after truncating
            try:
                self._precheck_length(rin, base, limit)
            except BadRequest:
                if not rin.engine_judges_length:
                    raise
                rin = RoutingInput.bodyless(rin.model)  # too long to tokenize: model and load
        tokens = await self.tokens(rin, base, keep)
        if limit is not None and len(tokens) > limit and not rin.engine_judges_length:
            raise _too_long(limit, len(tokens), "")
        req = RouteRequest(
            model=rin.model,
            namespace=self.namespace(rin, base),
            prompt_tokens=len(tokens),
            constraints=constraints or NO_CONSTRAINTS,
            max_tokens=rin.max_tokens,
            n=rin.n,
            dry_run=dry_run,
        )
        chosen = self.profiles[profile or self.door_profile]
        decision = self._pick(chosen, req, tokens)
        wait = 0.0 if dry_run else self.placement_wait()
        if wait > 0 and decision.new_prefix:
            # Two replicas placing new prefixes at one instant both see the same least
            # demanded worker and both send there; the one that waits sees the other's
            # placement (multi-turn, two replicas: 27 of 51 uneven homes came within 2 ms
            # of the other replica's pick of the same worker). Decision time excludes it.
            first = decision.best.worker
            t_wait = time.perf_counter()
            await asyncio.sleep(wait)
            t0 += time.perf_counter() - t_wait
            decision = self._pick(chosen, req, tokens)
            changed = "true" if decision.best.worker != first else "false"
            self.metrics.child(self.metrics.placement_waits, changed).inc()
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        return decision

    def _pick(self, profile: Profile, req: RouteRequest, tokens: Sequence[int]) -> Decision:
        for catch_up in self.before_pick:
            catch_up()
        try:
            decision = self.picker.pick(profile, req, tokens)
        except Overloaded:
            self.metrics.child(self.metrics.shed, self.model_label(req.model)).inc()
            raise
        if not decision.ranked:
            raise NoWorkerAvailable("no worker is eligible for this request")
        return decision

    def _check_model(self, model: str) -> None:
        """A model nobody serves is a 404 before any tokenizer is asked about it."""
        via = self.fleet.resolver_base(model)
        if model and not any(serves(w, model, via) for w in self.fleet.workers.values()):
            raise unknown_model(model, self.fleet)

    def _precheck_length(self, rin: RoutingInput, base: str | None, limit: int) -> None:
        """Refuse a prompt certainly over the model's context length before tokenizing it
        (a 20 MB prompt must not cost seconds of CPU and hundreds of MB)."""
        if rin.prompt_ids is not None:
            if len(rin.prompt_ids) > limit:
                raise _too_long(limit, len(rin.prompt_ids), "")
            return
        tok = self.tokenizers.local(rin.model, base)
        if tok is None:
            return
        texts = [rin.prompt_text or ""]
        if rin.messages is not None:
            texts = [
                str(m.get("content")) for m in rin.messages if isinstance(m.get("content"), str)
            ]
        floor = self.tokenizers.min_tokens(tok, texts)
        if floor > limit:
            raise _too_long(limit, floor, "at least ")

    def namespace(self, rin: RoutingInput, base: str | None) -> Namespace:
        lora = rin.model if base is not None else None
        return Namespace(self.config.model, lora, rin.cache_salt)

    async def tokens(
        self, rin: RoutingInput, base: str | None, keep: int | None = None
    ) -> Sequence[int]:
        """The prompt's tokens as vLLM will run them: cut to `keep` when the request asks
        for truncation (`RoutingInput.keep_tokens`)."""
        tokens = await self._all_tokens(rin, base)
        if keep is None or len(tokens) <= keep:
            return tokens
        ends = (0, 0)
        if rin.prompt_ids is None and rin.add_special_tokens and rin.truncation_side is None:
            ends = await self._special_ends(rin, base, tokens)
        return truncate(tokens, keep, rin.truncation_side, ends, tokenizer_side=rin.tokenizer_side)

    async def _special_ends(
        self, rin: RoutingInput, base: str | None, tokens: Sequence[int]
    ) -> tuple[int, int]:
        tok = self.tokenizers.local(rin.model, base)
        if tok is not None:
            return tok.special_ends
        bare = await self._remote_tokens(dataclasses.replace(rin, add_special_tokens=False))
        return special_ends(tokens, bare)

    async def _all_tokens(self, rin: RoutingInput, base: str | None) -> Sequence[int]:
        if rin.prompt_ids is not None:
            return rin.prompt_ids
        if rin.kind == "none":
            return ()
        tok = self.tokenizers.local(rin.model, base)
        if tok is None:
            return await self._remote_tokens(rin)
        try:
            if rin.kind == "chat":
                assert rin.messages is not None
                return await tok.achat(
                    rin.messages,
                    add_generation_prompt=rin.add_generation_prompt,
                    extra=rin.template_kwargs(self.config.exclude_tools_when_tool_choice_none),
                    add_special_tokens=rin.add_special_tokens,
                    continue_final_message=rin.continue_final_message,
                    template_source=self._request_template(rin),
                )
            return await tok.acompletion(
                rin.prompt_text or "", add_special_tokens=rin.add_special_tokens
            )
        except (TypeError, ValueError, RecursionError) as exc:  # a template choking on odd messages
            raise BadRequest(f"the request cannot be tokenized: {exc}", param="messages") from None

    def _request_template(self, rin: RoutingInput) -> str | None:
        """The request's own chat template, where the engines render it (both trust it)."""
        if rin.chat_template is None:
            return None
        if self.config.trust_request_chat_template:
            return rin.chat_template
        self._burst_log.warn(
            "untrusted-template",
            "chat requests carry their own chat_template, which kvroute renders with the "
            "model's template instead (their prefixes may not match the engines'): if the "
            "engines run with --trust-request-chat-template, give kvroute the same flag",
        )
        return None

    async def _remote_tokens(self, rin: RoutingInput) -> Sequence[int]:
        """A worker of the model's pool tokenizes (its own /tokenize), cached by content."""
        if rin.kind == "chat":
            body: dict[str, Any] = {
                "model": rin.model,
                "messages": rin.messages,
                "add_generation_prompt": rin.add_generation_prompt,
                "add_special_tokens": rin.add_special_tokens,
            }
            if rin.continue_final_message:
                body["continue_final_message"] = True
            template = self._request_template(rin)
            if template is not None:  # the worker renders it as it will for the request
                body["chat_template"] = template
            # the worker's own /tokenize normalises them as here, but never leaves them out
            # for a tool_choice "none" as its chat completions may
            tools = rin.rendered_tools(self.config.exclude_tools_when_tool_choice_none)
            if tools is not None:
                body["tools"] = tools
            if rin.template_extra:
                body["chat_template_kwargs"] = rin.template_extra
        else:
            body = {
                "model": rin.model,
                "prompt": rin.prompt_text,
                "add_special_tokens": rin.add_special_tokens,
            }
        # an adapter loaded on demand tokenizes as its base: asked by its own name, a worker
        # would load it for /tokenize, and a name no resolver finds would read as a worker
        # failing /tokenize rather than the engine's 404 for the request itself
        model = self.fleet.resolver_base(rin.model) or rin.model
        body["model"] = model
        key = msgspec.json.encode(body)
        cached = self._remote_cache.get(key)
        if cached is not None:
            return cached
        asked = []
        for h in self.pool.handles.values():
            if not h.available or not any(serves(s, model) for s in h.states):
                continue
            asked.append(h.name)
            try:
                resp = await self.pool.client.post(
                    f"{h.url}/tokenize",
                    content=key,
                    headers={"content-type": "application/json", **h.auth},
                )
            except httpx.HTTPError:
                continue
            if resp.status_code == 400:
                raise BadRequest(f"the worker could not tokenize the request: {resp.text[:300]}")
            if resp.status_code == 200:
                return self._remote_cache.put(key, list(resp.json().get("tokens", [])))
        raise NoWorkerAvailable(
            f"no worker serving {rin.model or 'the model'!r} answered /tokenize",
            detail=f"asked {', '.join(asked) or 'none'}; give kvroute the model's tokenizer "
            "folder (--tokenizer) to tokenize locally",
        )

    # ---- the request's life ----------------------------------------------------------

    def start(
        self, decision: Decision, worker: str, profile: str | None = None, handoff: bool = False
    ) -> Ticket:
        """The door sends the request to `worker` (one of `decision.ranked`). `handoff`:
        the decode worker of a split, which holds the prompt only once it pulled the KV
        (`pulled`); until then it is counted for its decode step alone."""
        state = self.fleet.workers[worker]
        extra = output_blocks(decision.request, state.block_size, state.max_model_len)
        prof = self.profiles[profile or decision.profile]
        load = self.picker.commit(prof, decision, worker, extra_blocks=extra, handoff=handoff)
        self.metrics.child(self.metrics.inflight, worker).inc()
        if not handoff:
            self._tell_sent(worker, decision)
        return Ticket(decision, worker, load, believed=not handoff)

    def pulled(self, ticket: Ticket) -> None:
        """A split's decode worker answered with its first token: it pulled the prompt's KV
        and holds its blocks now, as a worker that prefilled it would."""
        if ticket.believed or ticket.done or ticket.worker not in self.fleet.workers:
            return
        ticket.believed = True
        expects, _ = self.picker.remember(ticket.decision, ticket.worker)
        ticket.load.expects_events = expects
        self._tell_sent(ticket.worker, ticket.decision)

    def _tell_sent(self, worker: str, decision: Decision) -> None:
        if self.on_sent:
            hashes = decision.hashes.get(self.fleet.workers[worker].block_size, ())
            for tell in self.on_sent:
                tell(worker, hashes, decision.new_prefix)

    def passed_over(self, worker: str, why: str) -> None:
        """A gateway served a later fallback than `worker`: probed at once, out of rotation
        if it cannot be reached (`WorkerPool.probe_passed_over`)."""
        self.pool.probe_passed_over(worker, why)

    def reassign(self, ticket: Ticket, worker: str) -> Ticket:
        """The request was served by another endpoint than the one started (a gateway's
        fallback, perhaps one that joined the fleet after the decision: it is counted with
        no overlap): move its load and prediction there. The endpoint started keeps only
        what others left in its approximate or predicted entries, and its event health
        expects no blocks for it."""
        if worker == ticket.worker or worker not in self.fleet.workers:
            return ticket
        self.picker.score_late(ticket.decision, worker)
        self._release(ticket)
        self.unbelieve(ticket)
        return self.start(ticket.decision, worker)

    def unbelieve(self, ticket: Ticket) -> None:
        """The endpoint started stores nothing for this request (another one served it, or
        its engine refused it): what the pick made this router and its peers believe of
        that endpoint's cache goes, and its event health expects no blocks for it."""
        self.picker.withdraw(ticket.load)
        if not ticket.believed:
            return  # a handoff before its pull, or taken back already: nothing to take
        ticket.believed = False  # once: a second take-back would be a sibling's claim
        w = self.fleet.workers.get(ticket.worker)
        if w is None or not w.caching:
            return
        hashes = ticket.decision.hashes.get(w.block_size, ())
        believed = self.fleet.predictions if w.mode == EVENTS else self.fleet.approx
        believed.withdraw(w.name, hashes)
        for tell in self.on_withdrawn:
            tell(w.name, hashes)

    def release(self, ticket: Ticket) -> None:
        """The request will not be served there after all (a split whose prefill leg failed
        is sent the proxy's way, which counts it anew): its load goes, no outcome counts."""
        if not ticket.done:
            self._release(ticket)
            self.unbelieve(ticket)

    def first_token(self, ticket: Ticket) -> None:
        if ticket.first_token_at is None:
            ticket.first_token_at = time.perf_counter()
        self.fleet.load.first_token(ticket.load)

    def finish(
        self,
        ticket: Ticket,
        *,
        status: int,
        cached_tokens: int | None = None,
        outcome: str | None = None,
    ) -> None:
        """The request ended. `outcome` names failures that never produced a response
        (connect_failed, client_disconnected); otherwise the status decides."""
        if ticket.done:
            return
        self._finish(ticket, status, cached_tokens, outcome)
        self.forget_if_gone(ticket.worker)

    def forget_if_gone(self, worker: str) -> None:
        """A request that was in flight when its worker left the fleet has ended and been
        counted: the series that brought back go again (the in-flight gauge only with the
        last such request)."""
        if worker not in self.fleet.workers:
            self.metrics.forget_worker([worker])

    def _finish(
        self, ticket: Ticket, status: int, cached_tokens: int | None, outcome: str | None
    ) -> None:
        self._release(ticket)
        model = self.model_label(ticket.decision.request.model)
        label = outcome or ("ok" if status < 400 else "http_error")
        self.metrics.count(model, ticket.worker, status, label)
        if outcome in ("connect_failed", "worker_failed"):
            # never reached the engine, or the engine failed it before a first token: what
            # the pick believed of its cache goes, and its KV events are not waited on (a
            # block it did store still shows in them)
            self.unbelieve(ticket)
        if outcome is not None:
            return
        if 400 <= status < 500:
            # the engine refused the request (too long, bad parameters, an adapter no
            # resolver found): it stored nothing, and its silence must not count against
            # its KV events (vLLM may answer a non-streaming request 400 for an error
            # raised after its prefill stored blocks: its KV events still show them, and an
            # approximate worker's belief is short of them until they are asked again)
            self.unbelieve(ticket)
            return
        if cached_tokens and ticket.load.expects_events and ticket.decision.request.n == 1:
            bs = ticket.decision.score_of(ticket.worker).block_size
            full = ticket.decision.prompt_tokens // bs
            if full and cached_tokens // bs >= full:
                # its cache held every full block of the prompt, which the index did not
                # show (a router started after the engine cached it, entries past the
                # index's cap): the engine stores nothing new, and its silence is right. A
                # prompt of whole blocks never qualifies: vLLM recomputes and stores its
                # last block again. Nor do n > 1 requests: their count is a sibling's hits
                self.picker.withdraw(ticket.load)
        self._observe(ticket, cached_tokens, model)

    def _release(self, ticket: Ticket) -> None:
        ticket.done = True
        self.fleet.load.finish(ticket.load)
        self.metrics.inflight_done(ticket.worker)

    def model_label(self, model: str) -> str:
        """Metric labels only take names the fleet serves: clients choose the model field.
        Adapters loaded on demand (--lora-resolver) count under their base model: a fleet
        may load thousands, each on any worker of the base."""
        if not model:
            return "none"
        base = self.fleet.resolver_base(model)
        if base is not None:
            return base
        served = any(w.models and model in w.models for w in self.fleet.workers.values())
        return model if served else "other"

    def _observe(self, ticket: Ticket, cached_tokens: int | None, model: str) -> None:
        """Timings, and predicted vs the engine's reported cached tokens (fidelity)."""
        d, worker = ticket.decision, ticket.worker
        m = self.metrics
        if ticket.first_token_at is not None:
            m.child(m.ttft, model, worker).observe(ticket.first_token_at - ticket.started)
        m.child(m.duration, model, worker).observe(time.perf_counter() - ticket.started)
        if d.request.n > 1:
            # several sequences (n, or a batch of prompts): the engine reports the cached
            # tokens of sequences that found what a sibling had just computed, which no
            # prediction of this prompt's overlap can be held to
            return
        s = d.score_of(worker)
        bs = s.block_size
        # an engine never serves a prompt's last token from cache
        predicted = min(s.overlap_blocks, max(d.prompt_tokens - 1, 0) // bs)
        if d.prompt_tokens:
            m.predicted_overlap.observe(predicted * bs / d.prompt_tokens)
        m.child(m.predicted_tokens, worker).inc(predicted * bs)
        if cached_tokens is None:
            return
        m.child(m.reported_tokens, worker).inc(cached_tokens)
        reported = cached_tokens // bs
        result = "exact" if reported == predicted else "over" if predicted > reported else "under"
        m.child(m.fidelity, worker, result).inc()

    # ---- what doors need to know -----------------------------------------------------

    def models_doc(self) -> dict[str, Any]:
        return self.pool.models_doc()

    def address_of(self, worker: str) -> str:
        return self.fleet.workers[worker].address

    def rank_of(self, worker: str) -> int | None:
        """The data-parallel rank a request for this endpoint must ask for (None: the
        engine chooses); endpoints of one worker share its address."""
        return self.fleet.workers[worker].rank

    def worker_at(self, address: str) -> str | None:
        return next((w.name for w in self.fleet.workers.values() if w.address == address), None)

    @property
    def door_profile(self) -> str:
        """The profile a door uses by default: with prefill-only workers in the fleet,
        `decode` (prefill workers never take a whole request), else `default`."""
        has_prefill = any(w.role == "prefill" for w in self.fleet.workers.values())
        return "decode" if has_prefill and "decode" in self.profiles else "default"

    @property
    def ready(self) -> bool:
        """Can route: started, not draining, some endpoint passes health checks and is not
        drained by an operator, and a replica has heard its peers (or waited LINK_WAIT_S
        for them)."""
        return (
            self.started
            and not self.draining
            and any(w.available and not w.draining for w in self.fleet.workers.values())
            and self.peers_linked()
        )

    @property
    def live(self) -> bool:
        """The process is alive (never depends on workers)."""
        return True
