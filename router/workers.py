"""The worker pool: the fleet's workers, their discovery (event publishers per data-parallel
rank, cache config, served models), KV event subscriptions and ejection. Periodic probes live
in `router.worker_checks`, the per-worker verdicts behind /health in `router.verdicts`.

Every background task is started in `start()` and cancelled in `stop()` (the app lifespan
owns both). Worker lists from every source (config, file, DNS, admin API) arrive through
`set_workers`, already validated (`router.sources`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq.asyncio

from engines import ADAPTERS
from engines.base import EngineAdapter, EngineMetrics, EventSource, connectable
from indexer.clock import Clock
from indexer.health import HealthTracker
from indexer.ingest import WorkerIngest
from indexer.subscriber import EventSubscriber
from router.core.config import Config, WorkerConfig
from router.core.fleet import APPROX, EVENTS, FleetState, WorkerState
from router.tokenizers import TokenizerSet
from router.worker_checks import restarted

log = logging.getLogger("kvroute.workers")

DEFAULT_BLOCK_SIZE = 16
EJECT_AFTER_FAILURES = 2
# a worker ejected for timeouts again and again is held out timeout_hold_s, doubling with
# each ejection in a row to 2**HOLD_DOUBLINGS times it
HOLD_DOUBLINGS = 5
# how long a worker list change (start-up included) waits for its new workers' discovery;
# the rest goes on in the background
DISCOVERY_WAIT_S = 5.0


@dataclass
class Feed:
    """One endpoint of a worker (the worker itself, or one data-parallel rank) and its KV
    event subscription."""

    state: WorkerState
    source: EventSource | None = None
    ingest: WorkerIngest | None = None
    subscriber: EventSubscriber | None = None
    task: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class Hold:
    """Why and how long a worker ejected for timeouts stays out though /health answers."""

    endpoint: str  # whose timeouts ejected it
    since: float  # the pool's clock at the ejection
    until: float


@dataclass
class WorkerHandle:
    config: WorkerConfig
    mode_setting: str  # events | approx | auto, as configured
    adapter: EngineAdapter
    feeds: list[Feed]
    api_key: str | None = field(default=None, repr=False)
    models: list[dict[str, Any]] = field(default_factory=list)  # the worker's /v1/models cards
    metrics: EngineMetrics | None = None
    failures: int = 0  # consecutive failed health checks
    # consecutive requests that timed out, by endpoint: a data-parallel rank hung behind a
    # server whose other ranks answer is counted on its own, not reset by its siblings'
    # answers (`timeouts`: its worst endpoint's)
    timeouts_by: dict[str, int] = field(default_factory=dict)
    # when a scrape last showed its engine's generated-token count move (None: never seen)
    progressed_at: float | None = None
    # the same, by data-parallel rank, where its engine counts them apart (vLLM's `engine`
    # label): one hung rank stays hung while its siblings generate
    rank_progressed_at: dict[int, float] = field(default_factory=dict)
    # ejections for timeouts since the endpoint last answered a request, by endpoint
    timeout_ejections: dict[str, int] = field(default_factory=dict)
    # an engine hung behind a live API server passes every /health: from its second
    # ejection for timeouts in a row it stays out until this time (the pool's clock) or
    # until its engine generates a token, not just until /health answers
    hold: Hold | None = None
    draining: bool = False  # taken out of rotation by an operator (admin API)
    ejections: int = 0  # times taken out of rotation by a fault (a health check in flight
    # then must not put it back on an answer that came before)
    last_error: str = ""
    problems: dict[str, str] = field(default_factory=dict)  # config problems found by probes
    discovered: bool = False
    address: str = ""  # ip:port, resolved at discovery; every endpoint of the worker shares it
    # its event publishers as last answered (None: not asked since its engine started)
    sources: list[EventSource] | None = None
    # discovery, rediscovery and removal one at a time: the health and scrape loops can both
    # rediscover a restarted engine, and each subscribes anew after awaiting the worker
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def timeouts(self) -> int:
        """Consecutive requests that timed out on its worst endpoint."""
        return max(self.timeouts_by.values(), default=0)

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def host(self) -> str:
        return urlsplit(self.config.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.config.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def tls(self) -> bool:
        return self.config.url.startswith("https:")

    @property
    def auth(self) -> dict[str, str]:
        """Headers for the router's own calls to this worker (the engine's --api-key)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def available(self) -> bool:
        return self.feeds[0].state.available

    def set_available(self, value: bool) -> None:
        for f in self.feeds:
            f.state.available = value

    def set_draining(self, value: bool) -> None:
        self.draining = value
        for f in self.feeds:
            f.state.draining = value

    @property
    def states(self) -> list[WorkerState]:
        return [f.state for f in self.feeds]


class WorkerPool:
    def __init__(
        self,
        config: Config,
        fleet: FleetState,
        client: httpx.AsyncClient,
        clock: Clock,
        tokenizers: TokenizerSet,
    ) -> None:
        from router.worker_checks import WorkerChecks

        self.config = config
        self.fleet = fleet
        self.client = client
        self.clock = clock
        self.tokenizers = tokenizers
        self.handles: dict[str, WorkerHandle] = {}
        # one list change at a time: one that removes a worker waits for its feeds to stop,
        # and another (DNS, the file, the admin API) adding it back meanwhile would have its
        # new endpoints taken out of the fleet by the first one's removal
        self._reconciling = asyncio.Lock()
        # discoveries under way, and their workers: a list change waits DISCOVERY_WAIT_S for
        # its own, and a removal stops the removed worker's
        self._discovering: dict[asyncio.Task[None], WorkerHandle] = {}
        self._probing: set[str] = set()  # workers probed after a gateway passed them over
        self._probes: set[asyncio.Task[None]] = set()
        self.checks = WorkerChecks(self)
        # called when a worker is taken out of rotation as dead or hung (the app fails the
        # requests in flight to it, so they can be retried elsewhere)
        self.on_down: list[Callable[[WorkerHandle, str], None]] = []
        # told each worker removed from the list (its endpoints' names), and the endpoints a
        # worker's new rank layout dropped: what is kept per endpoint elsewhere goes with
        # them, or pods that come and go under new addresses grow it without bound
        self.on_removed: list[Callable[[WorkerHandle, list[str]], None]] = []
        self._zmq: zmq.asyncio.Context | None = None  # made in start(), destroyed in stop()
        self._loops: list[asyncio.Task[None]] = []

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, workers: tuple[WorkerConfig, ...]) -> None:
        self._zmq = zmq.asyncio.Context()
        await self.set_workers(workers)
        c = self.config
        self._loops = [
            asyncio.create_task(self._every(c.health_check_interval_s, self.checks.health)),
            asyncio.create_task(self._every(c.scrape_interval_s, self.checks.scrape)),
            asyncio.create_task(self._every(1.0, self.checks.refresh_modes)),
        ]

    async def stop(self) -> None:
        stopping = [*self._discovering, *self._probes]
        for task in [*self._loops, *stopping]:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        await self.checks.stop()
        for h in list(self.handles.values()):
            await self._stop_feeds(h)
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    @staticmethod
    async def _every(seconds: float, fn: Any) -> None:
        while True:
            try:
                await fn()
            except Exception:  # a failing probe must not kill the loop
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(seconds)

    async def set_workers(self, workers: tuple[WorkerConfig, ...]) -> None:
        """Reconcile to a new, validated worker list (start-up, file, DNS, admin API)."""
        wanted = {w.name: w for w in workers}
        async with self._reconciling:
            for name in [
                n for n in self.handles if n not in wanted or self.handles[n].config != wanted[n]
            ]:
                h = self.handles.pop(name)
                # its first discovery may be waiting on a hung worker's timeouts, holding
                # the lock: this change, and every one queued behind it, would wait too
                ours = [t for t, of in self._discovering.items() if of is h]
                for task in ours:
                    task.cancel()
                await asyncio.gather(*ours, return_exceptions=True)
                async with h.lock:  # a rediscovery in flight subscribes first, then stops here
                    await self._stop_feeds(h)
                names = [state.name for state in h.states]
                for name in names:
                    self.fleet.remove(name)
                self._removed(h, names)
            new = [self._handle(w) for name, w in wanted.items() if name not in self.handles]
            for h in new:
                self.handles[h.name] = h
        # discovery (HTTP, seconds on a slow worker) outside the lock; `discover_once` skips a
        # worker a later change removed meanwhile. Waited for DISCOVERY_WAIT_S at most: a
        # worker that accepts connections and never answers (each call up to its 10 s
        # timeout) would hold start-up, and with it /live, past a liveness probe's patience;
        # it goes on in the background, and the worker is routed to as answers come
        tasks = []
        for h in new:
            task = asyncio.create_task(self.discover_once(h))
            self._discovering[task] = h
            task.add_done_callback(self._discovered)
            tasks.append(task)
        if tasks:
            # not cancelled with this call (a watcher stopped mid-change): the pool's stop
            # cancels them, and a removal its worker's
            await asyncio.wait(tasks, timeout=DISCOVERY_WAIT_S)

    def _discovered(self, task: asyncio.Task[None]) -> None:
        self._discovering.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("discovering a worker failed", exc_info=task.exception())

    async def discover_once(self, h: WorkerHandle) -> None:
        """`discover`, unless another caller did it or the worker was removed meanwhile."""
        async with h.lock:
            if self.handles.get(h.name) is h and not h.discovered:
                await self.discover(h)

    def _removed(self, h: WorkerHandle, names: list[str]) -> None:
        """Endpoints gone from the fleet: what is kept of them elsewhere goes too."""
        self.checks.forget(names)
        for hook in self.on_removed:
            hook(h, names)

    def _handle(self, w: WorkerConfig) -> WorkerHandle:
        h = WorkerHandle(
            config=w,
            mode_setting=self.config.worker_mode(w),
            adapter=ADAPTERS[w.engine],
            feeds=[],
            api_key=self.config.api_key_for(w),
        )
        h.feeds = [self._feed(h, w.name, None)]
        return h

    def _feed(self, h: WorkerHandle, name: str, rank: int | None) -> Feed:
        w = h.config
        state = WorkerState(
            name=name,
            mode=APPROX if h.mode_setting == APPROX else EVENTS,
            block_size=w.block_size or self.config.block_size or DEFAULT_BLOCK_SIZE,
            health=self.health_tracker(name, h),
            worker=w.name,
            rank=rank,
            role=w.role,
            address=h.address,  # ranks made after discovery resolved it dial the same IP
        )
        self.fleet.add(state, model=self.config.model)
        return Feed(state)

    def health_tracker(self, name: str, h: WorkerHandle) -> HealthTracker:
        return HealthTracker(
            name, self.clock, grace_s=self.config.event_grace_s, fixes=h.adapter.hints.health
        )

    async def _stop_feeds(self, h: WorkerHandle) -> None:
        for f in h.feeds:
            if f.task is not None:
                f.task.cancel()
                # gather, not `await f.task` under suppress(CancelledError): that would
                # swallow a cancellation of the caller too (a loop stopped mid-rediscovery
                # would carry on, and the pool's stop wait for it forever)
                await asyncio.gather(f.task, return_exceptions=True)
                f.task = None

    def handle_of(self, endpoint: str) -> WorkerHandle | None:
        state = self.fleet.workers.get(endpoint)
        return self.handles.get(state.worker) if state is not None else None

    # ---- discovery -------------------------------------------------------------------

    async def discover(self, h: WorkerHandle) -> None:
        """Ask the worker for its cache config, models and event publishers; subscribe.
        Asked again (back from an ejection), what is known of its cache is kept unless the
        answers show a new engine process: vLLM never announces again the blocks it holds."""
        m = await self.checks.fetch_metrics(h)
        await self._resolve_address(h)
        asked = await self._event_sources(h) if h.mode_setting != APPROX else None
        why = self._new_engine(h, m, asked)
        if why:
            log.warning("worker %s: forgetting its cache because %s", h.name, why)
            await self._forget(h)
        if m is not None:  # unanswered, the last counters still tell a restart later
            h.metrics = m
        answered = True  # it said which event publishers it has (or none were asked for)
        if h.mode_setting != APPROX:
            answered = asked is not None
            self._follow_sources(h, asked)
        # after the ranks: each rank's endpoint serves the models (and LoRA adapters) too
        await self.checks.refresh_models(h)
        self.checks.apply_cache_config(h)
        await self.checks.check_tokenizers(h)
        h.discovered = answered
        for f in h.feeds:
            self.checks.refresh_mode(h, f)

    @staticmethod
    def _new_engine(
        h: WorkerHandle, m: EngineMetrics | None, asked: list[EventSource] | None
    ) -> str:
        """Why the worker's answers show a new engine process ("" when they do not)."""
        if m is not None and restarted(h.metrics, m):
            return "its /metrics counters went back (engine restart)"
        if asked is not None and h.sources is not None and asked != h.sources:
            return "its KV event publishers changed (engine restart)"
        return ""

    def _follow_sources(self, h: WorkerHandle, asked: list[EventSource] | None) -> None:
        """One endpoint per publisher, each subscribed once; a subscription that still
        feeds the index is kept (a new one would start its event sequence afresh)."""
        h.problems.pop("events", None)
        if asked is None:
            # down, or still loading its model: no verdict on its flags, and no answer says
            # nothing of its ranks either (it is asked again at its next passing health check)
            h.problems["events"] = (
                f"worker {h.name}: could not ask for its KV event publishers "
                f"({h.last_error}); asked again once it answers its health check"
            )
            return
        h.sources = asked
        self._set_ranks(h, asked)
        for feed, src in zip(h.feeds, asked, strict=False):
            if feed.task is None or feed.source != src:
                self._subscribe(h, feed, src)
        if not asked:
            h.problems["events"] = (
                f"worker {h.name} has no KV event publisher: "
                + h.adapter.hints.events_missing.format(url=h.url)
            )

    async def _event_sources(self, h: WorkerHandle) -> list[EventSource] | None:
        """The worker's KV event publishers; None when it could not be asked (unreachable,
        or a server error): not the same as a worker that publishes none."""
        w = h.config
        if w.events:  # as vLLM's own config would say it: tcp://*:5557 dials the worker
            replay = connectable(w.replay, h.host) if w.replay else None
            return [EventSource(connectable(w.events, h.host), replay, w.topic or "")]
        path = h.adapter.event_sources_path
        try:
            resp = await self.client.get(h.url + path, headers=h.auth)
            doc = resp.json() if resp.status_code == 200 else None
        except httpx.HTTPError as exc:
            h.last_error = f"GET {path}: {type(exc).__name__}: {exc}"
            return None
        except ValueError:
            doc = None
        if resp.status_code >= 500:
            h.last_error = f"GET {path}: HTTP {resp.status_code}"
            return None
        found = h.adapter.event_sources(doc, h.url)
        if w.topic is not None:
            found = [EventSource(s.endpoint, s.replay_endpoint, w.topic, s.rank) for s in found]
        return found

    def _set_ranks(self, h: WorkerHandle, sources: list[EventSource]) -> None:
        """One endpoint per data-parallel rank when the engine runs several."""
        ranks = [s.rank for s in sources] if len(sources) > 1 else [None]
        if [f.state.rank for f in h.feeds] == ranks:
            return
        available, gone = h.available, [f.state.name for f in h.feeds]
        for f in h.feeds:
            if f.task is not None:  # never a subscription feeding an endpoint that is gone
                f.task.cancel()
            self.fleet.remove(f.state.name)
        h.feeds = [self._feed(h, h.name if r is None else f"{h.name}#dp{r}", r) for r in ranks]
        # its new endpoints are in rotation as the worker is: drained by an operator, or
        # ejected, they are too
        h.set_available(available)
        h.set_draining(h.draining)
        dropped = [name for name in gone if name not in self.fleet.workers]
        if dropped:
            self._removed(h, dropped)
        if len(ranks) > 1:
            log.warning(
                "worker %s runs %d data-parallel ranks: routing to each", h.name, len(ranks)
            )

    async def _resolve_address(self, h: WorkerHandle) -> None:
        """host:port with the host as an IP address (a gateway's override_host matches IPs):
        of a dual-stack name its IPv4 address, where vLLM's default --host 0.0.0.0 listens,
        not whichever family getaddrinfo ranks first."""
        address = f"{h.host}:{h.port}"
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                h.host, h.port, type=socket.SOCK_STREAM
            )
            ips, _ = one_family(infos)
            ip = ips[0] if ips else h.host
            address = f"[{ip}]:{h.port}" if ":" in ip else f"{ip}:{h.port}"
        except (OSError, UnicodeError):  # unresolvable now: the name, until it resolves
            pass
        h.address = address
        for state in h.states:
            state.address = address

    def _subscribe(self, h: WorkerHandle, feed: Feed, src: EventSource) -> None:
        state = feed.state
        assert state.health is not None
        if feed.task is not None:  # never two subscriptions feeding one index
            feed.task.cancel()
        state.health.endpoint = src.endpoint
        feed.source = src
        make_decoder = h.adapter.stream_decoder
        feed.ingest = WorkerIngest(
            state.name,
            self.fleet.index,
            make_decoder() if make_decoder is not None else h.adapter.decode_batch,
            self.clock,
            health=state.health,
            has_replay=src.replay_endpoint is not None,
            block_size=h.config.block_size or self.config.block_size,
            demand=state.demand,
            refetched=state.refetched,
        )
        feed.subscriber = EventSubscriber(
            feed.ingest,
            src.endpoint,
            replay_endpoint=src.replay_endpoint,
            topic=src.topic,
            ctx=self._context(),
            on_batch=lambda: self._learned_block_size(feed),
        )
        feed.task = asyncio.create_task(feed.subscriber.run(), name=f"events-{state.name}")

    def _context(self) -> zmq.asyncio.Context:
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        return self._zmq

    @staticmethod
    def _learned_block_size(feed: Feed) -> None:
        if feed.ingest is not None and feed.ingest.learned_block_size:
            feed.state.block_size = feed.ingest.learned_block_size

    async def rediscover(self, h: WorkerHandle, why: str) -> None:
        """Forget what we knew of a worker (its index, subscriptions, findings) and discover
        it again: its engine restarted, and may have lost its cache or changed its flags."""
        async with h.lock:
            if self.handles.get(h.name) is not h:
                return  # removed (or replaced) while an earlier discovery held the lock
            log.warning("worker %s: rediscovering because %s", h.name, why)
            await self._forget(h)
            await self.discover(h)

    async def ask_again(self, h: WorkerHandle) -> None:
        """`discover` a worker back from an ejection, unless it was removed meanwhile: its
        flags, models and publishers may have changed; its cache is forgotten only where
        the answers show a new engine process."""
        async with h.lock:
            if self.handles.get(h.name) is h:
                for f in h.feeds:  # its requests from before were failed over or cut
                    if f.state.health is not None:
                        f.state.health.forget_pending()
                await self.discover(h)

    async def _forget(self, h: WorkerHandle) -> None:
        """Drop its subscriptions, findings and everything believed of its cache."""
        await self._stop_feeds(h)
        h.problems.clear()
        h.hold = None  # a new engine process: the hung one is gone
        h.timeout_ejections.clear()
        h.sources = None
        for f in h.feeds:
            f.ingest = f.subscriber = f.source = None
            self.fleet.forget_cache(f.state.name)
            self.fleet.load.forget_batch(f.state.name)  # its batch limit may differ too
            f.state.health = self.health_tracker(f.state.name, h)

    def probe_passed_over(self, endpoint: str, why: str) -> None:
        """A gateway went past `endpoint` to a later fallback: it could not connect there,
        or the address is not yet in its cluster (a worker new to the fleet, before the
        gateway's own resolve sees it). Probed at once: out of rotation only where a
        connection fails too, so a dead worker stops ranking first for new prefixes within
        a request and a healthy one the gateway has not met yet stays in."""
        h = self.handle_of(endpoint)
        if h is None or not h.available or h.name in self._probing:
            return
        self._probing.add(h.name)
        task = asyncio.create_task(self._probe(h, why))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, h: WorkerHandle, why: str) -> None:
        try:
            await self.client.get(
                f"{h.url}/health", headers=h.auth, timeout=self.config.health_timeout_s
            )
            return  # it answers: whatever its status, the health checks judge it
        except httpx.HTTPError as exc:
            why = f"{why}, and /health failed too: {type(exc).__name__}"
        finally:
            self._probing.discard(h.name)
        if self.handles.get(h.name) is h:
            self.set_down(h, why)

    def eject(self, endpoint: str, why: str) -> None:
        """A request could not connect: stop routing there until a health check passes."""
        h = self.handle_of(endpoint)
        if h is not None:
            self.set_down(h, why)

    def set_down(self, h: WorkerHandle, why: str) -> None:
        """Out of rotation until a health check passes; requests in flight there fail now."""
        h.failures = max(h.failures, EJECT_AFTER_FAILURES)
        h.last_error = why
        if not h.available:
            return
        log.error("worker %s ejected: %s", h.name, why)
        h.ejections += 1
        h.set_available(False)
        for hook in self.on_down:
            hook(h, why)

    def note_timeout(self, endpoint: str, why: str) -> None:
        """A request timed out there; `eject_after_timeouts` in a row eject the worker."""
        h = self.handle_of(endpoint)
        if h is None:
            return
        h.timeouts_by[endpoint] = h.timeouts_by.get(endpoint, 0) + 1
        if h.timeouts < self.config.eject_after_timeouts:
            return
        why = f"{h.timeouts} requests in a row timed out ({why})"
        if h.available:  # late timeouts of requests cut at the ejection count no further
            # every endpoint that timed out with no answer since counts it: a whole engine
            # hung spreads its timeouts over its data-parallel ranks, and counted by the
            # tipping rank alone it would be held only once some rank came round again
            for e in h.timeouts_by:  # entries go at an answer: each has timed out since
                h.timeout_ejections[e] = h.timeout_ejections.get(e, 0) + 1
            n = max(h.timeout_ejections.values())
            if n > 1 and self.config.timeout_hold_s > 0:
                hold_s = self.config.timeout_hold_s * 2 ** min(n - 2, HOLD_DOUBLINGS)
                now = self.clock.now()
                h.hold = Hold(endpoint, now, now + hold_s)
                why += (
                    f"; ejected for timeouts {n} times in a row with no answer between: held "
                    f"out {hold_s:g} s (--timeout-hold), or until its engine generates a token"
                )
        self.set_down(h, why)

    def held(self, h: WorkerHandle) -> float:
        """Seconds the worker stays out though its /health answers (0: none): it was
        ejected for timeouts again, and its engine generated no token since."""
        hold = h.hold
        if hold is None:
            return 0.0
        left = hold.until - self.clock.now()
        if left <= 0 or self.progressed_since(hold.endpoint, hold.since):
            h.hold = None
            return 0.0
        return left

    def timed_out(self, endpoint: str, since: float, why: str) -> None:
        """A request waited on the endpoint past its timeout. It counts toward ejecting the
        worker only where its engine generated no token since `since` (its scrapes): a busy
        engine queues new streams past the first-byte timeout while it generates for the
        others, and ejecting it would cut those streams too."""
        if not self.progressed_since(endpoint, since):
            self.note_timeout(endpoint, f"{why}, and its engine generated no token meanwhile")

    def progressed_since(self, endpoint: str, since: float) -> bool:
        """Whether a scrape since `since` (the pool's clock) showed the endpoint's engine
        generate tokens: it was alive then, whatever a request waiting on it met. A
        data-parallel rank is judged by its own count where the engine reports one."""
        h = self.handle_of(endpoint)
        if h is None:
            return False
        state = self.fleet.workers.get(endpoint)
        rank = state.rank if state is not None else None
        own = h.metrics.by_rank.get(rank) if h.metrics is not None and rank is not None else None
        at = h.progressed_at
        if rank is not None and own is not None and own.generation_tokens is not None:
            at = h.rank_progressed_at.get(rank)
        return at is not None and at >= since

    def note_answered(self, endpoint: str) -> None:
        h = self.handle_of(endpoint)
        if h is not None:
            h.timeouts_by.pop(endpoint, None)
            h.timeout_ejections.pop(endpoint, None)

    def models_doc(self) -> dict[str, Any]:
        """The union of the workers' /v1/models cards, each name once."""
        seen: dict[str, dict[str, Any]] = {}
        for h in self.handles.values():
            for m in h.models:
                seen.setdefault(str(m.get("id")), m)
        return {"object": "list", "data": list(seen.values())}


def one_family(infos: list[tuple[Any, ...]]) -> tuple[list[str], str]:
    """The addresses of one family among getaddrinfo's answers, and what to say of the
    choice ("" when there was none to make). A dual-stack headless Service answers each pod
    twice, its A and its AAAA record: one worker per pod is one per IPv4 address, as vLLM's
    default --host 0.0.0.0 listens on IPv4 only; IPv6 where no A record came."""
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
    if v4 and v6:
        return v4, (
            "answers IPv4 and IPv6 addresses (a dual-stack Service): one worker per IPv4 "
            "address, as vLLM's default --host 0.0.0.0 listens on IPv4 only"
        )
    if v6:
        return v6, (
            "answers IPv6 addresses only: one worker per IPv6 address (vLLM must listen on "
            "IPv6: --host ::)"
        )
    return v4, ""
