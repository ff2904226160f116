"""The HTTP proxy door: parse the request, ask the decision service, forward to the pick,
report the outcome back.

Completions and chat are routed by their prompt; every other path the workers serve
(`/v1/embeddings`, `/v1/responses`, `/tokenize`, `/v1/score`, `/v1/rerank`, ...) passes
through, routed by the body's `model`, never answered 404 by the router.

A request that reached no client byte yet is retried once on the next endpoint of another
worker (a worker's data-parallel ranks share its API server) when its worker refused the
connection, was given up on (ejected as dead or hung), or did not answer within the
first-byte timeout (an event stream's head is held until its first chunk: vLLM sends it
before its engine produced anything); a worker that times out `eject_after_timeouts` times
in a row, its engine generating nothing meanwhile, is ejected until its health check
passes. A non-streaming request that reaches the request
timeout is answered 504, not retried, and held against its worker only where its engine
generated nothing meanwhile (`_whole_timeout`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Protocol

from router.access import AccessLog
from router.asgi import (
    CLIENT_GONE,
    CUT_RESPONSE,
    Receive,
    Scope,
    Send,
    cancelled_outcome,
    check_length,
    header,
    read_body,
)
from router.core.config import Config
from router.core.decision import Constraints, Decision, WorkerScore
from router.core.errors import (
    BadRequest,
    KvrouteError,
    MethodNotAllowed,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from router.forward import (
    FIRST_CHUNK_LATE,
    ConnectFailed,
    Forwarder,
    Outcome,
    WorkerBrokeOff,
    WorkerTimedOut,
    upstream_headers,
    with_rank,
)
from router.metrics import RouterMetrics
from router.openai_req import RoutingInput, parse_request
from router.routing import DecisionService, Ticket
from router.tracing import DecisionTracer
from router.upstream import Timeouts
from router.workers import WorkerPool

if TYPE_CHECKING:
    from router.pd.door import PDDoor

log = logging.getLogger("kvroute.proxy")

# Request ids unique across processes and restarts (engines match a P/D handoff's legs by
# them): 64 random bits per process, then a counter. uuid4 per request read /dev/urandom
# and built a UUID object: ~4% of the event loop's time at a thousand requests a second.
_ID_PREFIX = os.urandom(8).hex().encode()
_ID_COUNT = itertools.count(1)


def new_request_id() -> bytes:
    """32 hex characters, like a uuid4's hex."""
    return b"%s%016x" % (_ID_PREFIX, next(_ID_COUNT))


class ProxyDoor:
    def __init__(
        self,
        svc: DecisionService,
        pool: WorkerPool,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        config: Config,
        access: AccessLog | None = None,
        tracer: DecisionTracer | None = None,
    ) -> None:
        self.svc = svc
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = metrics
        self.config = config
        self.access = access
        self.tracer = tracer
        c = config
        self.streaming = Timeouts(
            c.first_byte_timeout_s, c.first_byte_timeout_s, c.inter_chunk_timeout_s
        )
        self.whole = Timeouts(c.request_timeout_s, c.inter_chunk_timeout_s, c.inter_chunk_timeout_s)
        self.pd: PDDoor | None = None  # completions and chat of a fleet with prefill workers

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        t0_ns = time.time_ns()
        path, method = scope["path"], scope["method"]
        kind = self.svc.route_path(path)
        if kind is not None and method != "POST":
            raise MethodNotAllowed(f"{path} takes POST")
        check_length(scope, self.config.max_body_bytes)
        body = await read_body(receive, self.config.max_body_bytes, self.config.body_timeout_s)
        # watch for the client hanging up from here on: a decision can wait (a remote
        # tokenizer, a placement wait), and a hang-up the server reports before anyone
        # listens would leave the worker generating an answer for nobody
        me = asyncio.current_task()
        assert me is not None
        gone = scope.get(CLIENT_GONE)
        watch: _Watch
        writes: _ClientWrites | None = None
        if gone is None:  # not kvroute's own server (an in-process ASGI transport)
            watch = asyncio.ensure_future(_cancel_on_disconnect(receive, me))
        else:
            watch = hangup = _Hangup(me)
            gone.append(hangup.fire)
            writes = _ClientWrites(send, self.config.inter_chunk_timeout_s, scope, hangup)
            send = writes
        try:
            await self._route(scope, send, path, kind, body, t0, t0_ns)
        except asyncio.CancelledError:
            if not watch.done():
                raise
            me.uncancel()  # the client went away: closing upstream already aborted the request
        finally:
            watch.cancel()
            if writes is not None:
                writes.close()

    async def _route(
        self,
        scope: Scope,
        send: Send,
        path: str,
        kind: str | None,
        body: bytes,
        t0: float,
        t0_ns: int,
    ) -> None:
        rin = parse_request(kind, path, body)
        pd_fleet = self.pd is not None and self.pd.active
        pd = kind is not None and pd_fleet
        # with prefill workers, a request that passes through (embeddings, responses, ...)
        # must not land on one either: prefill workers take only prefill legs
        decision = await self.svc.decide(rin, profile="decode" if pd_fleet else "default")
        if self.tracer is not None:
            self.tracer.record(scope["headers"], decision, t0_ns)
        request_id = header(scope, b"x-request-id") or new_request_id()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %s (scorers %s us)\n%s",
                request_id.decode(errors="replace"),
                decision.best.worker,
                {k: round(v, 1) for k, v in decision.scorer_us.items()},
                decision.explain(),
            )
        headers = upstream_headers(
            scope["headers"],
            request_id,
            self.forwarder.worker_header,
            _forwarded(scope, self.config),
        )
        target = request_target(scope)
        request = _Request(
            decision, rin, scope["method"].encode(), target, headers, body, request_id, t0, scope
        )
        if pd and self.pd is not None:
            await self.pd.serve(request, send, self._attempts)
        else:
            await self._attempts(request, send)

    async def _attempts(self, r: _Request, send: Send) -> None:
        failures: list[str] = []
        timeouts = 0
        tried: set[str] = set()
        for _ in range(2):  # one retry, on the next best endpoint
            choice = await self._next_choice(r, tried)
            if choice is None:
                break
            tried.add(choice.worker)
            h = self.pool.handle_of(choice.worker)
            if h is None:
                continue
            r.tries.append(choice.worker)
            rank = self.svc.fleet.workers[choice.worker].rank
            sent = with_rank(r.headers, rank)
            ticket = self.svc.start(r.decision, choice.worker)
            sent_at = self.pool.clock.now()
            outcome: str | None = "error"
            try:
                result = await self.forwarder.forward(
                    worker=choice.worker,
                    host=h.host,
                    port=h.port,
                    tls=h.tls,
                    method=r.method,
                    path=r.target,
                    headers=sent,
                    body=r.body,
                    send=send,
                    request_id=r.request_id,
                    on_first_byte=lambda t=ticket: self._first_byte(t, r),  # type: ignore[misc]
                    timeouts=self.streaming if r.rin.stream else self.whole,
                    hold_head=True,
                )
                outcome = None
                self._done(ticket, r, result)
                return
            except ConnectFailed as exc:
                timed_out = isinstance(exc, WorkerTimedOut)
                broke_off = isinstance(exc, WorkerBrokeOff)
                outcome = (
                    "timeout" if timed_out else "worker_failed" if broke_off else "connect_failed"
                )
                if timed_out and not r.rin.stream:
                    raise self._whole_timeout(choice.worker, sent_at, exc.detail) from None
                failures.append(str(exc))
                timeouts += timed_out
                self._worker_failed(choice.worker, exc, sent_at)
                # its data-parallel ranks share its API server, hung, unreachable or
                # breaking off too (a server that crashed closes every stream it held)
                tried.update(f.state.name for f in h.feeds)
            except asyncio.CancelledError:
                outcome = r.cancelled_outcome()
                raise
            finally:
                if outcome is not None:
                    self.svc.finish(ticket, status=0, outcome=outcome)
        if failures and timeouts == len(failures):  # a gateway timeout, as the client sees it
            raise UpstreamTimeout(
                f"no worker answered within --first-byte-timeout "
                f"({self.config.first_byte_timeout_s:g} s) on {len(failures)} tries",
                detail="; ".join(failures),
            )
        raise UpstreamError("no worker could take the request", detail="; ".join(failures))

    def _whole_timeout(self, worker: str, sent_at: float, detail: str) -> UpstreamTimeout:
        """A non-streaming answer has no head until it is whole (vLLM's way), so its wait is
        the request timeout, which a long generation reaches on a healthy worker. Retrying
        would run it again elsewhere, and counting it as a hang would eject healthy workers
        (and cut their streams) one long request at a time. It counts as one only where the
        worker's engine generated no token meanwhile (its scrapes): an engine hung behind a
        live API server passes health checks, and non-streaming traffic must still find it."""
        self.pool.timed_out(worker, sent_at, "no answer")
        if detail == FIRST_CHUNK_LATE:  # a path that answers an event stream all the same
            return UpstreamTimeout(
                "the worker's event stream sent no first chunk within the inter-chunk "
                f"timeout ({self.config.inter_chunk_timeout_s:g} s); raise "
                "--inter-chunk-timeout",
                detail=f"worker {worker}",
            )
        return UpstreamTimeout(
            f"no answer within the request timeout ({self.config.request_timeout_s:g} s): "
            "a non-streaming answer comes whole; stream it, or raise --request-timeout",
            detail=f"worker {worker}",
        )

    async def _next_choice(self, r: _Request, tried: set[str]) -> WorkerScore | None:
        """The best endpoint not tried yet. The first decision's runners-up are the retry
        order; when the filters left none (a load bound can rule out every endpoint but the
        one that just failed), the request is decided again without the ones tried. A
        runner-up taken out of rotation since (the failure that ejected the first choice
        ejects every data-parallel rank of its worker, and ranks rank side by side) or
        drained is skipped."""
        workers = self.svc.fleet.workers
        for choice in r.decision.ranked:
            w = workers.get(choice.worker)
            if choice.worker not in tried and w is not None and w.available and not w.draining:
                return choice
        try:
            r.decision = await self.svc.decide(
                r.rin, profile=r.decision.profile, constraints=Constraints(exclude=frozenset(tried))
            )
        except Overloaded:
            raise  # shedding is on and every worker left is busy: the client may retry later
        except KvrouteError:
            return None
        return r.decision.ranked[0]

    def _first_byte(self, ticket: Ticket, r: _Request) -> None:
        self.svc.first_token(ticket)
        r.first_byte = time.perf_counter()

    def _done(self, ticket: Ticket, r: _Request, result: Outcome) -> None:
        self.svc.finish(ticket, status=result.status, cached_tokens=result.cached_tokens)
        self.answered(ticket, r, result)

    def answered(
        self, ticket: Ticket, r: _Request, result: Outcome, prefill: str | None = None
    ) -> None:
        """What an answer relayed from `ticket.worker` leaves behind, whichever door sent
        it (the P/D door's decode legs too): the worker's health, stream errors, a cut
        body's closed connection, the access log line."""
        if result.broken == "timeout":
            # a worker that sends a stream's head and then hangs is hung all the same
            since = self.pool.clock.now() - result.silent_s
            self.pool.timed_out(ticket.worker, since, "no chunk within the timeout")
        elif result.broken is None and result.status < 400:
            # a refusal proves nothing: vLLM's API server validates without its engine
            self.pool.note_answered(ticket.worker)
        if result.broken is not None:
            self.metrics.child(self.metrics.stream_errors, ticket.worker, result.broken).inc()
        if result.cut and (cut := r.scope.get(CUT_RESPONSE)) is not None:
            cut()
        if self.access is not None:
            self.access.write(r.rin.model, ticket, result, r.started, r.first_byte, prefill)
        if result.broken is not None:
            self.svc.forget_if_gone(ticket.worker)

    def _worker_failed(self, worker: str, exc: ConnectFailed, sent_at: float) -> None:
        self.metrics.child(self.metrics.retries, worker).inc()
        if isinstance(exc, WorkerTimedOut):
            self.pool.timed_out(worker, sent_at, exc.detail)
        elif not isinstance(exc, WorkerBrokeOff):  # one request's failure: the others stay
            self.pool.eject(worker, f"connect failed: {exc.detail}")


class _Request:
    """One client request on its way through the door."""

    __slots__ = (
        "body",
        "decision",
        "first_byte",
        "headers",
        "method",
        "request_id",
        "rin",
        "scope",
        "started",
        "target",
        "tries",
    )

    def __init__(
        self,
        decision: Decision,
        rin: RoutingInput,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        request_id: bytes,
        started: float,
        scope: Scope,
    ) -> None:
        self.scope = scope  # the server's: the drain marks a request it cuts there
        self.decision = decision
        self.rin = rin
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.request_id = request_id
        self.started = started
        self.first_byte: float | None = None
        self.tries: list[str] = []  # the endpoints sent it, in order (a retry adds one)

    def cancelled_outcome(self) -> str:
        return cancelled_outcome(self.scope)


_NOT_IN_TARGET = re.compile(rb"[\x00-\x20\x7f]")  # spaces and control bytes


def request_target(scope: Scope) -> bytes:
    """The path and query to send the worker, as the client encoded them. The decoded
    `path` must never be written into the request line: a `%0D%0A` in it would become a
    line break there, letting a client add headers or a whole request of its own on a
    pooled connection (whose answer the next client would get), and `%3F` would become a
    query."""
    raw = scope.get("raw_path")
    target = raw if raw else urllib.parse.quote(scope["path"]).encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    if _NOT_IN_TARGET.search(target) is not None:
        raise BadRequest("the request target has spaces or control characters")
    return target


def _forwarded(scope: Scope, config: Config) -> tuple[bytes, bytes, bytes] | None:
    if not config.forwarded_headers:
        return None
    client = scope.get("client")
    address = str(client[0]).encode() if client else b"unknown"
    return address, str(scope.get("scheme", "http")).encode(), header(scope, b"host") or b""


class _Watch(Protocol):
    def done(self) -> bool: ...

    def cancel(self) -> object: ...


class _Hangup:
    """Cancels the request's task when the server says its client went away."""

    __slots__ = ("_task", "fired", "live")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self.fired = False
        self.live = True

    def fire(self) -> None:
        if self.live:
            self.live = False
            self.fired = True
            self._task.cancel()

    def done(self) -> bool:
        return self.fired

    def cancel(self) -> bool:
        self.live = False
        return True


class _ClientWrites:
    """The client's `send`, each write bounded by `limit` seconds. A client that stops
    reading without hanging up (its socket buffer full, the server's send waiting for it to
    drain) would hold its request, its worker's load and connection, and the engine's
    work forever; past the limit it is hung up on: its connection is cut, and its request
    ends as a hang-up (the upstream closed, so the engine aborts). A client has as long to
    take a chunk as a worker has to send one. One timer per `limit` seconds, not one per
    chunk."""

    __slots__ = ("_hangup", "_limit", "_loop", "_scope", "_send", "_since", "_timer")

    def __init__(self, send: Send, limit: float, scope: Scope, hangup: _Hangup) -> None:
        self._send = send
        self._limit = limit
        self._scope = scope
        self._hangup = hangup
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the write in progress began
        self._timer = self._loop.call_later(limit, self._check)

    async def __call__(self, message: Any) -> None:
        self._since = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._since = None

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is None or now - since < self._limit:
            left = self._limit if since is None else self._limit - (now - since)
            self._timer = self._loop.call_later(left, self._check)
            return
        log.warning("client stopped reading for %g s: hung up on", self._limit)
        cut = self._scope.get(CUT_RESPONSE)
        if cut is not None:
            cut()
        self._hangup.fire()

    def close(self) -> None:
        self._timer.cancel()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task when its client disconnects; closing the upstream connection
    on the way out makes the engine abort the request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return
