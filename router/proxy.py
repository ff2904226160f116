"""The HTTP proxy door: parse the request, ask the decision service, forward to the pick
(one retry on the next one when nothing reached the worker), report the outcome back.

Completions and chat are routed by their prompt; every other path the workers serve
(`/v1/embeddings`, `/v1/responses`, `/tokenize`, `/v1/score`, `/v1/rerank`, ...) passes
through, routed by the body's `model`, never answered 404 by the router."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from router.asgi import Receive, Scope, Send, header, read_body
from router.core.decision import Decision
from router.core.errors import MethodNotAllowed, UpstreamError
from router.forward import ConnectFailed, Forwarder, upstream_headers
from router.metrics import RouterMetrics
from router.openai_req import parse, parse_passthrough
from router.routing import DecisionService
from router.workers import WorkerPool

log = logging.getLogger("kvroute.proxy")

RANK_HEADER = b"x-data-parallel-rank"  # vLLM routes a request to this data-parallel rank


class ProxyDoor:
    def __init__(
        self,
        svc: DecisionService,
        pool: WorkerPool,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        max_body_bytes: int,
    ) -> None:
        self.svc = svc
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        kind = self.svc.route_path(path)
        if kind is not None and method != "POST":
            raise MethodNotAllowed(f"{path} takes POST")
        body = await read_body(receive, self.max_body_bytes)
        rin = parse(kind, body) if kind is not None else parse_passthrough(path, body)
        decision = await self.svc.decide(rin)
        request_id = header(scope, b"x-request-id") or uuid.uuid4().hex.encode()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %s (scorers %s us)\n%s",
                request_id.decode(errors="replace"),
                decision.best.worker,
                {k: round(v, 1) for k, v in decision.scorer_us.items()},
                decision.explain(),
            )
        headers = upstream_headers(scope["headers"], request_id, self.forwarder.worker_header)
        target = path.encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        me = asyncio.current_task()
        assert me is not None
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, me))
        try:
            await self._attempts(decision, method.encode(), target, headers, body, send, request_id)
        except asyncio.CancelledError:
            if not watch.done():
                raise
            me.uncancel()  # the client went away: closing upstream already aborted the request
        finally:
            watch.cancel()

    async def _attempts(
        self,
        decision: Decision,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        send: Send,
        request_id: bytes,
    ) -> None:
        failures: list[str] = []
        for choice in decision.ranked[:2]:  # one retry, on the next best endpoint
            h = self.pool.handle_of(choice.worker)
            if h is None:
                continue
            rank = self.svc.fleet.workers[choice.worker].rank
            sent = headers if rank is None else [*headers, (RANK_HEADER, b"%d" % rank)]
            ticket = self.svc.start(decision, choice.worker)
            outcome: str | None = "error"
            try:
                result = await self.forwarder.forward(
                    worker=choice.worker,
                    host=h.host,
                    port=h.port,
                    tls=h.tls,
                    method=method,
                    path=target,
                    headers=sent,
                    body=body,
                    send=send,
                    request_id=request_id,
                    on_first_byte=lambda t=ticket: self.svc.first_token(t),  # type: ignore[misc]
                )
                outcome = None
                self.svc.finish(ticket, status=result.status, cached_tokens=result.cached_tokens)
                return
            except ConnectFailed as exc:
                outcome = "connect_failed"
                failures.append(str(exc))
                self.pool.eject(choice.worker, f"connect failed: {exc.detail}")
                self.metrics.child(self.metrics.retries, choice.worker).inc()
            except asyncio.CancelledError:
                outcome = "client_disconnected"
                raise
            finally:
                if outcome is not None:
                    self.svc.finish(ticket, status=0, outcome=outcome)
        raise UpstreamError("could not connect to any worker: " + "; ".join(failures))


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task when its client disconnects; closing the upstream connection
    on the way out makes the engine abort the request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return
