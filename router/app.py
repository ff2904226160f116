"""The router process's ASGI app: dispatch to the doors, and the lifecycle that owns every
background task. The request decision lives in `router.routing` (the decision service);
forwarding in `router.proxy`; the router's own endpoints in `router.control`.

    request -> ProxyDoor -> DecisionService.decide -> Picker.pick -> Forwarder -> worker
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from typing import Any

import httpx

from indexer.clock import Clock, MonotonicClock
from router.access import AccessLog
from router.asgi import (
    DRAIN_EXPIRED,
    ClientGone,
    Message,
    Receive,
    ResponseState,
    Scope,
    Send,
    end_with_error,
    send_error,
)
from router.control import Control, is_control
from router.core.config import Config
from router.core.errors import ConfigError, KvrouteError, NotFound, ShuttingDown
from router.core.fleet import FleetState
from router.forward import Forwarder
from router.metrics import RouterMetrics
from router.pd.door import PDDoor
from router.peers import PlacementLink
from router.processes import ProcessRole
from router.proxy import ProxyDoor
from router.routing import DecisionService
from router.sources import WorkerSources
from router.tokenize import LocalTokenizer
from router.tokenizers import TokenizerSet
from router.tracing import DecisionTracer
from router.upstream import Timeouts, UpstreamPool
from router.worker_checks import CONTROL_KEEPALIVE_S, CONTROL_TIMEOUT_S
from router.workers import WorkerHandle, WorkerPool

log = logging.getLogger("kvroute.proxy")


class RouterApp:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        tokenizer: LocalTokenizer | None = None,
        client: httpx.AsyncClient | None = None,
        tracer_provider: Any = None,
        role: ProcessRole | None = None,
    ) -> None:
        self.config = config.validate()
        self.role = role  # one of `kvroute serve --processes N` (router/processes.py)
        self.clock = clock or MonotonicClock()
        self.fleet = FleetState(
            self.clock,
            prediction_ttl_s=config.prediction_ttl_s,
            approx_ttl_s=config.approx_ttl_s,
            max_index_entries=config.max_index_entries,
        )
        self.fleet.lora_resolver = config.lora_resolver
        self.tokenizers = TokenizerSet.from_config(config, preloaded=tokenizer)
        # the control plane (discovery, probes, scraping, remote /tokenize): a hung worker must
        # never stall the rounds that would notice it
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=1024,
                max_keepalive_connections=256,
                # under vLLM's 5 s keep-alive: a probe never goes out on a connection the
                # engine is closing that moment (a failed probe counts against the worker)
                keepalive_expiry=CONTROL_KEEPALIVE_S,
            ),
        )
        self.pool = WorkerPool(config, self.fleet, self.client, self.clock, self.tokenizers)
        self.sources = WorkerSources(
            config, self.pool, role.admin_state if role is not None else None
        )
        self.metrics = RouterMetrics(str(role.metrics_dir) if role is not None else None)
        self.metrics.attach(self.pool)
        rng = random.Random(config.seed)
        profiles = {name: config.profile(name, rng) for name in ("default", "decode", "prefill")}
        self.routing = DecisionService(
            config, self.fleet, self.pool, self.tokenizers, self.metrics, profiles, self.clock
        )
        c = config
        self.upstream = UpstreamPool(
            c.connect_timeout_s,
            Timeouts(c.request_timeout_s, c.inter_chunk_timeout_s, c.inter_chunk_timeout_s),
        )
        self.pool.on_down.append(lambda h, why: self._abort(h.host, h.port, why))
        self.pool.on_removed.append(self._forget_worker)
        forwarder = Forwarder(self.upstream, config.worker_header.lower().encode())
        access = AccessLog() if config.access_log else None
        tracer = DecisionTracer(tracer_provider) if config.otel else None
        self.proxy = ProxyDoor(
            self.routing, self.pool, forwarder, self.metrics, config, access, tracer
        )
        self.pd = PDDoor(
            self.routing,
            self.upstream,
            forwarder,
            config,
            self.metrics.registry,
            self.proxy.answered,
        )
        self.proxy.pd = self.pd
        self.control = Control(self.routing, self.sources, self.metrics, role)
        self.control.pd = self.pd
        self.peers: PlacementLink | None = None
        publish, peers = config.peer_publish, list(config.peers)
        relay_publish, relay_from = None, []
        if role is not None:
            # the sibling processes are peers too; the first process speaks for all of them
            # to the other replicas (router/peers.py)
            siblings = [role.link(i) for i in role.siblings]
            publish = role.link(role.index)
            if role.index == 0:
                relay_publish, relay_from = config.peer_publish, siblings
            else:
                peers = siblings + peers
        if publish or peers or config.peers_dns:
            counter = self.metrics.peer_placements
            self.peers = PlacementLink(
                self.fleet,
                publish,
                peers,
                on_result=lambda result: counter.labels(result).inc(),
                peers_dns=config.peers_dns,
                dns_interval_s=config.dns_interval_s,
                on_peers=self.metrics.peer_replicas.set,
                relay_publish=relay_publish,
                relay_from=relay_from,
                # between replicas only: the processes of one replica alone stay as fast
                # as one process
                wait_s=config.peer_wait_ms / 1000 if config.has_replica_peers else 0.0,
            )
            self.routing.on_sent.append(self.peers.sent)
            self.routing.on_withdrawn.append(self.peers.withdrawn)
            self.routing.before_pick.append(self.peers.drain)
            self.routing.placement_wait = self.peers.placement_wait
            self.routing.peers_linked = self.peers.linked
        # other doors served by this process (the Envoy picker): started after the fleet,
        # stopped before it
        self.doors: list[Any] = []
        self._warm: asyncio.Task[None] | None = None

    def _forget_worker(self, h: WorkerHandle, names: list[str]) -> None:
        """Endpoints left the fleet: their metric series, and the worker's idle connections
        where the worker itself left (not where its data-parallel ranks changed)."""
        self.metrics.forget_worker(names)
        if self.pool.handles.get(h.name) is not h:
            self.upstream.forget(h.host, h.port)

    def _abort(self, host: str, port: int, why: str) -> None:
        n = self.upstream.abort(host, port, why)
        if n:
            log.warning("%d requests in flight to %s:%d failed over: %s", n, host, port, why)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        server_scope = scope  # the server marks this one (DRAIN_EXPIRED)
        if scope["method"] == "HEAD":  # answered like GET, without the body
            scope = {**scope, "method": "GET"}
            send = _without_body(send)
        if self.routing.draining:  # no idle keep-alive connection may outlive the drain
            send = _closing(send)
        send = response = ResponseState(send)
        try:
            if is_control(scope["path"]):
                await self.control.handle(scope, receive, send)
            else:
                await self.proxy.handle(scope, receive, send)
        except ClientGone:
            return
        except asyncio.CancelledError:
            if not server_scope.get(DRAIN_EXPIRED):
                raise
            # the server cancelled it at the drain timeout and waits a moment for this answer
            me = asyncio.current_task()
            if me is not None:
                me.uncancel()
            await self._cut(scope, response)
        except KvrouteError as err:
            self._refused(scope, err)
            await send_error(send, err)
        except Exception:
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            internal = KvrouteError("internal error in kvroute (logged)")
            self._refused(scope, internal)
            await send_error(send, internal)

    async def _cut(self, scope: Scope, response: ResponseState) -> None:
        """End a request still running when the drain timeout expired."""
        err = ShuttingDown(
            "the router was shutting down and the request did not finish within its drain "
            f"timeout ({self.config.drain_timeout_s:g} s); retry it"
        )
        if not response.started:
            self._refused(scope, err)
        await end_with_error(response, err)

    def _refused(self, scope: Scope, err: KvrouteError) -> None:
        """The router answered itself: counted, and the internal detail logged."""
        if not is_control(scope["path"]):
            self.metrics.count("none", "none", err.status, "router")
        if err.detail and err.status >= 500:
            log.warning("%s %s: %s (%s)", scope["method"], scope["path"], err.message, err.detail)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except ConfigError as exc:  # names the flag to fix: no traceback to read
                    log.error("start-up failed: %s", exc.message)
                    await send({"type": "lifespan.startup.failed", "message": exc.message})
                    return
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        await self.sources.start()
        if self.peers is not None:
            await self.peers.start()
        await self.pd.start()
        if self.config.warm_connections > 0:  # open before the first request can need them
            await self._top_up()
            self._warm = asyncio.create_task(self._keep_warm(), name="kvroute-warm-connections")
        self.routing.started = True
        for door in self.doors:
            await door.start()
        # the start-up heap (imports, tokenizers) never becomes garbage: keep full
        # collections from walking it on the request path (measured ~30 ms -> ~0)
        gc.collect()
        gc.freeze()

    async def _keep_warm(self) -> None:
        """Every second, top each routable worker's idle connections up (`warm_connections`)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._top_up()
            except Exception:  # a failing top-up must not end the loop
                log.exception("keeping connections to the workers open failed")

    async def _top_up(self) -> None:
        handles = [h for h in self.pool.handles.values() if h.available and not h.draining]
        n = self.config.warm_connections
        await asyncio.gather(*(self.upstream.keep_warm(h.host, h.port, h.tls, n) for h in handles))

    def start_draining(self) -> None:
        """SIGTERM: /ready turns 503 and every connection closes after its response."""
        self.routing.draining = True
        for door in self.doors:
            if hasattr(door, "start_draining"):
                door.start_draining()

    async def shutdown(self) -> None:
        for door in reversed(self.doors):  # in-flight picker streams get the drain timeout
            await door.stop(grace_s=self.config.drain_timeout_s)
        await self.pd.stop()
        if self.peers is not None:
            await self.peers.stop()
        await self.sources.stop()
        if self._warm is not None:
            self._warm.cancel()
            await asyncio.gather(self._warm, return_exceptions=True)
        self.upstream.close()
        await self.client.aclose()


class ProbesOnly:
    """`--no-proxy`: the HTTP port serves only the probes and metrics (the picker is the
    door); everything else is a 404 that says so."""

    PATHS = frozenset({"/live", "/ready", "/health", "/metrics"})

    def __init__(self, app: RouterApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.PATHS:
            await send_error(
                send,
                NotFound(
                    f"no route for {scope['path']}: this kvroute runs the Envoy picker only "
                    "(--no-proxy); send requests through the gateway"
                ),
            )
            return
        await self.app(scope, receive, send)


def _closing(send: Send) -> Send:
    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send


def _without_body(send: Send) -> Send:
    async def head_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head_send
