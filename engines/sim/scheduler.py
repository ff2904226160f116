"""vLLM v1's scheduling loop, reduced to what changes cache contents and latency. Pure.

Per step: running requests first (one decode token each, or the next prefill chunk), in
order; when the pool cannot hold a running request's next token the most recently admitted
running request is preempted (blocks freed tail first, request back at the head of the
queue, recomputed later). Then, if nothing was preempted, waiting requests are admitted in
FCFS order while the batch has room (`max_num_seqs`), the token budget
(`max_num_batched_tokens`) lasts and the pool can hold the whole prompt; the first that does
not fit blocks the queue. A request for a LoRA adapter when the step already runs
`max_loras` others is passed over instead (the requests behind it may run) and counted
"deferred" until it is scheduled, as vLLM's `deferred_waiting`.

Prefill -> decode (vLLM's NixlConnector, pull mode): a waiting request whose prompt KV is to
be pulled from a prefill worker gets blocks for its whole prompt, adopts its local prefix
hit, and leaves the queue for WAITING_FOR_REMOTE_KVS (the step plan lists it in `loads`;
the engine runs the pull). When the pull is done (`finish_load`) the pulled blocks are cached
(BlockStored) and the request re-enters the queue with all but its last prompt token
computed. A finished request whose blocks a connector keeps for a decode worker (`retain`)
is not freed here; the connector frees it later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engines.sim.blockpool import Block
from engines.sim.kvcache import KVCacheManager
from engines.sim.request import SimRequest, Status


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one request computed in a step, and the context they attend to."""

    request: SimRequest
    num_new: int
    context: int  # tokens already computed before this chunk
    prefill: bool  # False for a decode step: one token after the request's last output


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    loads: list[SimRequest] = field(default_factory=list)  # remote KV pulls to start

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token sampled for a request at the end of a step."""

    request: SimRequest
    token_id: int
    finished: bool


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens of newly admitted requests
    hits: int = 0  # of which came from the prefix cache
    preemptions: int = 0


Sampler = Callable[[SimRequest], int]
Retain = Callable[[SimRequest], bool]
LoadResult = Literal["ok", "failed", "fatal"]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_id: int,
        max_loras: int = 1,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: list[SimRequest] = []  # WAITING_FOR_REMOTE_KVS
        self.lora_deferred: set[SimRequest] = set()  # passed over for a LoRA slot, waiting
        self.stats = PrefixStats()
        self.retain: Retain | None = None  # a connector keeping finished requests' blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: SimRequest) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: SimRequest, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request now (finished, aborted or stopped by a stop string)."""
        if req.finished:
            return
        loading = req.status is Status.WAITING_FOR_REMOTE_KVS
        self.lora_deferred.discard(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        # A pull in flight still writes into the blocks: `finish_load` frees them.
        if not loading and not (self.retain is not None and self.retain(req)):
            self.kv.free(req)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    return budget
            decode = n == 1 and bool(req.output_ids) and req.num_computed == req.num_tokens - 1
            plan.chunks.append(Chunk(req, n, req.num_computed, not decode))
            req.num_computed += n
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        # the adapters of the running requests this step runs (vLLM: scheduled_running_reqs)
        loras = {c.request.keys.lora_id for c in plan.chunks if c.request.keys.lora_id}
        passed: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            lora = req.keys.lora_id
            if lora and lora not in loras and len(loras) >= self.max_loras:
                passed.append(self.waiting.popleft())
                self.lora_deferred.add(req)
                continue
            if req.blocks:  # KV pulled from a prefill worker: all but the last token
                hit, num_hit = [], req.num_computed
            else:
                hit = self.kv.computed_blocks(req)
                num_hit = len(hit) * self.kv.block_size
                if req.sampling.report_cached:  # as vLLM, at every lookup of its prefix
                    self.kv.pool.report_cached(req.block_hashes, len(hit), req.all_ids(), req.keys)
            if req.remote_prefill:
                if not self._start_load(plan, req, hit, num_hit):
                    break
                continue
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hit, full_sequence_must_fit=True):
                break
            self.waiting.popleft()
            self.lora_deferred.discard(req)
            if lora:
                loras.add(lora)
            if req.num_cached_tokens < 0:  # first admission: what the response reports
                req.num_cached_tokens = num_hit
                self.stats.queries += req.num_tokens
                self.stats.hits += num_hit
            req.status = Status.RUNNING
            self.running.append(req)
            plan.admitted.append(req)
            plan.chunks.append(Chunk(req, n, num_hit, True))
            req.num_computed = num_hit + n
            budget -= n
        self.waiting.extendleft(reversed(passed))  # back at the head, in their order

    def _start_load(self, plan: StepPlan, req: SimRequest, hit: list[Block], num_hit: int) -> bool:
        """Allocate the whole prompt and hand the request to the engine's pull (vLLM:
        `load_kv_async`); it takes no token budget and no batch slot while it waits."""
        external = req.num_tokens - num_hit
        if not self.kv.allocate_slots(req, external, hit, full_sequence_must_fit=True, cache=False):
            return False
        self.waiting.popleft()
        req.remote_prefill = False  # one transfer per request, as vLLM
        req.status = Status.WAITING_FOR_REMOTE_KVS
        req.num_computed = num_hit
        req.num_external_tokens = external
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit + external  # vLLM: local + external
            self.stats.queries += req.num_tokens
            self.stats.hits += num_hit
        self.loading.append(req)
        plan.loads.append(req)
        return True

    def finish_load(self, req: SimRequest, result: LoadResult, recompute: bool) -> bool:
        """The pull for `req` ended. "ok": cache the pulled blocks and queue the request to
        compute its last prompt token; a failure with `recompute`: queue it to compute the
        prompt locally. Returns False when the request must fail (the caller finishes it)."""
        self.loading.remove(req)
        if req.finished:  # aborted while pulling
            self.kv.free(req)
            return True
        if result == "ok":
            self.kv.cache_blocks(req, req.num_prompt_tokens)
            req.num_computed = req.num_tokens - 1  # its logits must be computed here
        else:
            self.kv.free(req)
            req.num_computed = 0
            req.num_external_tokens = 0
            req.num_cached_tokens = -1
            if result == "fatal" or not recompute:
                req.status = Status.WAITING  # `finish` takes it from here
                return False
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def update(self, plan: StepPlan, sample: Sampler) -> list[TokenEvent]:
        """After the step ran: sample a token for every request whose tokens are all
        computed, and finish those that hit EOS, a stop token, max_tokens or the context."""
        out: list[TokenEvent] = []
        for chunk in plan.chunks:
            req = chunk.request
            if req.status is not Status.RUNNING or req.num_computed < req.num_tokens:
                continue  # aborted meanwhile, or a prefill chunk with more to go
            token = sample(req)
            req.output_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, *reason)
            out.append(TokenEvent(req, token, req.finished))
        return out

    def _stop_reason(self, req: SimRequest, token: int) -> tuple[str, int | None] | None:
        sp = req.sampling
        n_out = len(req.output_ids)
        if n_out >= sp.min_tokens:
            if token == self.eos_token_id and not sp.ignore_eos:
                return "stop", None
            if token in sp.stop_token_ids:
                return "stop", token
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None

    # ---- cache control -------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Drop the prefix cache; with `reset_running`, preempt every running request first
        (vLLM's `reset_running_requests`), otherwise refuse while any block is held."""
        if reset_running:
            while self.running:
                self._preempt(self.running.pop())
        return self.kv.pool.reset()
