"""The simulated engine: an asyncio step loop around the pure scheduler.

Each step: schedule -> start the step's remote KV pulls (P/D decode side; they run beside
the steps, as vLLM's async loads) -> sleep for the latency model's step time -> sample
tokens -> hand them to the requests' streams -> publish the step's KV events as one batch. Time is
injected: production uses the event loop's clock and `asyncio.sleep` (the demo measures
wall-clock TTFT), tests pass a `VirtualClock` and assert on simulated time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engines.sim.blockpool import NO_KEYS, CacheKeys
from engines.sim.latency import LatencyModel
from engines.sim.model import FakeModel
from engines.sim.request import Sampling, SimRequest
from engines.sim.scheduler import LoadResult, Scheduler, StepPlan, TokenEvent
from engines.vllm.events import WireEvent
from indexer.clock import Clock, MonotonicClock

log = logging.getLogger("kvroute.sim.engine")

Sleeper = Callable[[float], Awaitable[None]]
_CATCH_UP_S = 0.005  # a step's lateness up to this is made up by the next back-to-back step
Publish = Callable[[float, list[WireEvent]], Awaitable[None]]


class VirtualClock:
    """Simulated time for tests: `sleep` advances the clock instead of waiting, then yields
    once so that other tasks see the step's results."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    async def sleep(self, seconds: float) -> None:
        self._t += max(seconds, 0.0)
        await asyncio.sleep(0)


class EngineObserver(Protocol):
    """Metrics hooks (see `engines.sim.metrics`); the engine itself keeps no histograms.
    As vLLM's output processor counts: the prompt at its first token, every token as it is
    sampled, and every finish except a client's abort (vLLM drops that request's state
    without recording a finish)."""

    def first_token(self, req: SimRequest, ttft_s: float) -> None: ...

    def generated(self, req: SimRequest) -> None: ...

    def finished(self, req: SimRequest, e2e_s: float) -> None: ...


class KVLoader(Protocol):
    """Pulls a request's prompt KV from a prefill worker (`engines.sim.pd_connector`)."""

    recompute_failed_loads: bool

    def on_submit(self, req: SimRequest) -> None: ...

    async def load(self, req: SimRequest) -> LoadResult: ...


@dataclass(frozen=True, slots=True)
class Output:
    """One generated token as the request's stream sees it."""

    token_id: int | None  # None on the terminal output of an aborted request
    index: int  # position in the output
    time: float  # engine clock when the step that sampled it ended
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    request_id: str = ""  # which request: several may share one queue (n > 1, a batch)


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    steps: int
    # of `waiting`, those held for something other than a batch slot: here the requests
    # whose prompt KV a pull from a prefill worker brings, and those passed over for a LoRA
    # slot (--max-loras). vLLM counts them as waiting, and as "deferred" in
    # num_requests_waiting_by_reason from the pull's start or the first pass until they are
    # scheduled (its `deferred_waiting`), so after the pull too
    deferred: int = 0


class RequestHandle:
    """A submitted request: iterate its outputs (or read the queue it shares); `abort` and
    `cancel` free its blocks at once."""

    def __init__(
        self, engine: Engine, req: SimRequest, queue: asyncio.Queue[Output] | None = None
    ) -> None:
        self.engine = engine
        self.request = req
        self.queue: asyncio.Queue[Output] = queue if queue is not None else asyncio.Queue()

    def abort(self, reason: str = "abort", stop_reason: int | str | None = None) -> None:
        """The front end finished it (a stop string): counted as a finish."""
        self.engine.abort(self.request, reason, stop_reason)

    def cancel(self) -> None:
        """The client went away: aborted, and not counted as a finish (as vLLM)."""
        self.engine.abort(self.request, by_client=True)

    async def outputs(self) -> AsyncIterator[Output]:
        """Outputs until the request finishes; leaving early (client gone, stop string)
        aborts it."""
        try:
            while True:
                out = await self.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if not self.request.finished:
                self.cancel()


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        model: FakeModel,
        latency: LatencyModel,
        *,
        clock: Clock | None = None,
        sleep: Sleeper | None = None,
        wall: Callable[[], float] = time.time,
        publish: Publish | None = None,
        observer: EngineObserver | None = None,
        loader: KVLoader | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.model = model
        self.latency = latency
        self.clock: Clock = clock or MonotonicClock()
        self._sleep: Sleeper = sleep or asyncio.sleep
        self._wall = wall
        self._publish = publish
        self.observer = observer
        self.loader = loader
        self._loads: set[asyncio.Task[None]] = set()
        self._handles: dict[SimRequest, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.steps = 0
        self.last_plan: StepPlan | None = None
        self._deadline: float | None = None

    # ---- lifecycle (owned by the app lifespan) -------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for load in list(self._loads):
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        for req in list(self._handles):
            self.abort(req)

    # ---- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        keys: CacheKeys = NO_KEYS,
        request_id: str | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        remote: object | None = None,
        *,
        variant: int = 0,
        queue: asyncio.Queue[Output] | None = None,
    ) -> RequestHandle:
        """Queue a request; `remote` (decode side of P/D) says where its KV is pulled from,
        `kv_transfer_params` are the client's, kept for the prefill side. `variant` k > 0
        is the k-th sample of a prompt run n times; `queue` is shared by such siblings."""
        prompt = list(prompt_ids)
        req = SimRequest(
            request_id=request_id or f"sim-{next(self._ids)}",
            prompt_ids=prompt,
            sampling=sampling,
            keys=keys,
            arrival=self.clock.now(),
            seed=self.model.digest(prompt, variant),
            kv_transfer_params=kv_transfer_params,
            remote=remote,
            remote_prefill=remote is not None and self.loader is not None,
        )
        if self.loader is not None:
            self.loader.on_submit(req)
        handle = RequestHandle(self, req, queue)
        self._handles[req] = handle
        self.scheduler.add(req)
        self._wake.set()
        return handle

    def abort(
        self,
        req: SimRequest,
        reason: str = "abort",
        stop: int | str | None = None,
        *,
        by_client: bool = False,
    ) -> None:
        """Finish `req` now and free its blocks; its stream ends with a token-less output.
        A finish the client caused (`by_client`) is not counted in the metrics."""
        if req.finished:
            return
        self.scheduler.finish(req, reason, stop)
        now = self.clock.now()
        if self.observer is not None and not by_client:
            self.observer.finished(req, now - req.arrival)
        handle = self._handles.pop(req, None)
        if handle is not None:
            end = Output(None, len(req.output_ids), now, True, reason, stop, 0, req.request_id)
            handle.queue.put_nowait(end)
        self._wake.set()

    def wake(self) -> None:
        """Something outside the loop changed the scheduler's state (freed blocks)."""
        self._wake.set()

    def cached_tokens(self, prompt_ids: Sequence[int], keys: CacheKeys = NO_KEYS) -> int:
        """Leading full blocks of `prompt_ids` cached now, in tokens (no state change)."""
        return self.scheduler.kv.peek(prompt_ids, keys) * self.scheduler.kv.block_size

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        ok = self.scheduler.reset_prefix_cache(reset_running)
        self._wake.set()
        return ok

    def stats(self) -> EngineStats:
        s = self.scheduler
        # a request aborted during its pull stays in `loading` until the pull ends; vLLM
        # drops it from its queues at once
        loading = sum(1 for r in s.loading if not r.finished)
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting) + loading,
            kv_usage=s.kv.pool.usage(),
            prefix_queries=s.stats.queries,
            prefix_hits=s.stats.hits,
            preemptions=s.stats.preemptions,
            steps=self.steps,
            deferred=loading + sum(1 for r in s.waiting if r.blocks or r in s.lora_deferred),
        )

    # ---- the step loop -------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            plan = self.scheduler.schedule() if self.scheduler.has_work else None
            if plan is not None:
                self._start_loads(plan)
            if plan is None or plan.empty:
                self._deadline = None  # idle: the next step starts from its own arrival
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.step(plan)
            except Exception:  # a broken step must not silently stall every request
                log.exception("simulated engine step failed; aborting its requests")
                for chunk in plan.chunks:
                    self.abort(chunk.request)

    def _start_loads(self, plan: StepPlan) -> None:
        for req in plan.loads:
            task = asyncio.create_task(self._load(req), name=f"kv-load-{req.request_id}")
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)

    async def _load(self, req: SimRequest) -> None:
        assert self.loader is not None
        try:
            result = await self.loader.load(req)
        except Exception:
            log.exception("KV pull for %s failed unexpectedly", req.request_id)
            result = "failed"
        if not self.scheduler.finish_load(req, result, self.loader.recompute_failed_loads):
            self.abort(req, "error")  # vLLM: FINISHED_ERROR, the client gets a 500
        self._wake.set()

    async def step(self, plan: StepPlan) -> None:
        """Run one scheduled step: wait its cost, sample, deliver, publish."""
        prefills = [(c.num_new, c.context) for c in plan.chunks if c.prefill]
        decodes = sum(1 for c in plan.chunks if not c.prefill)
        await self._wait(self.latency.step_ms(prefills, decodes) / 1000.0)
        self.steps += 1
        self.last_plan = plan
        now = self.clock.now()
        for event in self.scheduler.update(plan, self.model.sample):
            self._deliver(event, now)
        events = self.scheduler.kv.pool.take_events()
        if events and self._publish is not None:
            await self._publish(self._wall(), events)

    async def _wait(self, seconds: float) -> None:
        """Sleep for one step. Back-to-back steps are timed against a running deadline, so
        the sleeper's lateness (about a millisecond per real `asyncio.sleep`) does not
        accumulate into a slower decode rate."""
        now = self.clock.now()
        prev = self._deadline
        base = prev if prev is not None and now - prev < _CATCH_UP_S else now
        self._deadline = base + seconds
        await self._sleep(max(self._deadline - now, 0.0))

    def _deliver(self, event: TokenEvent, now: float) -> None:
        req = event.request
        handle = self._handles.get(req)
        index = len(req.output_ids) - 1
        if self.observer is not None:
            if index == 0:
                self.observer.first_token(req, now - req.arrival)
            self.observer.generated(req)
            if event.finished:
                self.observer.finished(req, now - req.arrival)
        if event.finished:
            self._handles.pop(req, None)
        if handle is None:
            return
        handle.queue.put_nowait(
            Output(
                token_id=event.token_id,
                index=index,
                time=now,
                finished=event.finished,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                request_id=req.request_id,
            )
        )
