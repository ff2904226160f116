"""The OpenAI-compatible reverse proxy (an ASGI app served by uvicorn).

POST /v1/completions, /v1/chat/completions   routed by prefix, forwarded, streamed back
GET  /v1/models                              union of the workers' models
GET  /health                                 503 naming each broken worker and its fix
GET  /ready                                  200 once a worker can take traffic
GET  /metrics                                Prometheus
GET  /admin/workers, POST /admin/workers     the worker list (POST reloads it; admin token)
GET|POST /debug/route                        how a prompt would be routed (admin token)
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from typing import Any

import httpx
import msgspec

from indexer.clock import Clock, MonotonicClock
from indexer.hashing import Namespace
from router.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from router.core.config import Config, WorkerConfig, from_mapping
from router.core.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    KvrouteError,
    MethodNotAllowed,
    NotFound,
    NoWorkerAvailable,
    UpstreamError,
)
from router.core.picker import Decision, RoutingCore
from router.forward import ConnectFailed, Forwarder, Outcome, upstream_headers
from router.metrics import RouterMetrics
from router.openai_req import RoutingInput, parse
from router.tokenize import LocalTokenizer, TokenCache
from router.upstream import UpstreamPool
from router.workers import WorkerPool

log = logging.getLogger("kvroute.proxy")

ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class RouterApp:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        tokenizer: LocalTokenizer | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config.validate()
        self.clock = clock or MonotonicClock()
        rng = random.Random(config.seed)
        self.core = RoutingCore(
            self.clock,
            scoring=config.scoring,
            policy=config.policy,
            prediction_ttl_s=config.prediction_ttl_s,
            approx_ttl_s=config.approx_ttl_s,
            max_index_entries=config.max_index_entries,
            rng=rng,
            timer=time.perf_counter,
        )
        if tokenizer is None and config.tokenizer not in (None, "remote"):
            tokenizer = LocalTokenizer(config.tokenizer)  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self._remote_cache = TokenCache()
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.pool = WorkerPool(config, self.core, self.client, self.clock, tokenizer)
        self.metrics = RouterMetrics()
        self.metrics.attach(self.pool)
        self.upstream = UpstreamPool(config.connect_timeout_s, config.request_timeout_s)
        self.forwarder = Forwarder(self.upstream, config.worker_header.lower().encode())
        self.started = False
        self._file_task: asyncio.Task[None] | None = None  # started in startup()

    # ---- ASGI ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            kind = ROUTES.get(path)
            if kind is not None:
                if method != "POST":
                    raise MethodNotAllowed(f"{path} takes POST")
                await self._proxy(scope, receive, send, kind)
            else:
                await self._control(scope, receive, send, path, method)
        except ClientGone:
            return
        except KvrouteError as err:
            await send_error(send, err)
        except Exception:
            log.exception("unexpected error on %s %s", method, path)
            await send_error(send, KvrouteError("internal error in kvroute (logged)"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
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
        await self.pool.start()
        self.started = True
        self._file_task = (
            asyncio.create_task(self._watch_workers_file()) if self.config.workers_file else None
        )

    async def shutdown(self) -> None:
        if self._file_task is not None:
            self._file_task.cancel()
        await self.pool.stop()
        self.upstream.close()
        await self.client.aclose()

    # ---- the request path ------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        t0 = time.perf_counter()
        body = await read_body(receive, self.config.max_body_bytes)
        rin = parse(kind, body)
        tokens = await self.tokens(rin)
        decision = self.core.route(tokens, self.namespace(rin))
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
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
        me = asyncio.current_task()
        assert me is not None
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, me))
        try:
            await self._attempts(decision, rin, scope["path"], headers, body, send, request_id)
        except asyncio.CancelledError:
            if not watch.done():
                raise
            me.uncancel()  # the client went away: closing upstream already aborted the request
        finally:
            watch.cancel()

    async def _attempts(
        self,
        decision: Decision,
        rin: RoutingInput,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        send: Send,
        request_id: bytes,
    ) -> None:
        failures: list[str] = []
        for choice in decision.ranked[:2]:  # one retry, on the next best worker
            handle = self.pool.handles.get(choice.worker)
            if handle is None:
                continue
            extra = math.ceil(rin.max_tokens / max(choice.block_size, 1))
            ticket = self.core.commit(decision, choice.worker, extra_blocks=extra)
            inflight = self.metrics.child(self.metrics.inflight, choice.worker)
            inflight.inc()
            outcome_label = "error"
            try:
                outcome = await self.forwarder.forward(
                    worker=choice.worker,
                    host=handle.host,
                    port=handle.port,
                    tls=handle.config.url.startswith("https:"),
                    path=path.encode(),
                    headers=headers,
                    body=body,
                    send=send,
                    request_id=request_id,
                    on_first_byte=lambda t=ticket: self.core.load.first_token(t),  # type: ignore[misc]
                )
                outcome_label = "ok" if outcome.status < 400 else f"http_{outcome.status}"
                self._observe(decision, choice.worker, outcome)
                return
            except ConnectFailed as exc:
                outcome_label = "connect_failed"
                failures.append(str(exc))
                self.pool.eject(choice.worker, f"connect failed: {exc.detail}")
                self.metrics.retries.labels(choice.worker).inc()
            except asyncio.CancelledError:
                outcome_label = "client_disconnected"
                raise
            finally:
                self.core.load.finish(ticket)
                inflight.dec()
                self.metrics.count(choice.worker, outcome_label)
        raise UpstreamError("could not connect to any worker: " + "; ".join(failures))

    def _observe(self, decision: Decision, worker: str, outcome: Outcome) -> None:
        s = decision.score_of(worker)
        bs = s.block_size
        # an engine never serves a prompt's last token from cache
        predicted = min(s.overlap_blocks, max(decision.prompt_tokens - 1, 0) // bs)
        if decision.prompt_tokens:
            self.metrics.predicted_overlap.observe(predicted * bs / decision.prompt_tokens)
        m = self.metrics
        m.child(m.predicted_tokens, worker).inc(predicted * bs)
        if outcome.cached_tokens is None:
            return
        m.child(m.reported_tokens, worker).inc(outcome.cached_tokens)
        reported = outcome.cached_tokens // bs
        result = "exact" if reported == predicted else "over" if predicted > reported else "under"
        m.child(m.fidelity, worker, result).inc()

    def namespace(self, rin: RoutingInput) -> Namespace:
        lora = rin.model if rin.model and rin.model in self._adapters() else None
        return Namespace(self.config.model, lora, rin.cache_salt)

    def _adapters(self) -> set[str]:
        return {
            str(m["id"])
            for h in self.pool.handles.values()
            for m in h.models
            if m.get("parent") and m.get("parent") != m.get("id")
        }

    async def tokens(self, rin: RoutingInput) -> list[int]:
        if rin.prompt_ids is not None:
            return rin.prompt_ids
        if self.tokenizer is not None:
            if rin.kind == "chat":
                assert rin.messages is not None
                return self.tokenizer.chat(
                    rin.messages,
                    add_generation_prompt=rin.add_generation_prompt,
                    extra=rin.template_extra,
                )
            return self.tokenizer.completion(rin.prompt_text or "")
        return await self._remote_tokens(rin)

    async def _remote_tokens(self, rin: RoutingInput) -> list[int]:
        """--tokenizer remote: the worker's own /tokenize, cached by content."""
        if rin.kind == "chat":
            body: dict[str, Any] = {
                "model": rin.model,
                "messages": rin.messages,
                "add_generation_prompt": rin.add_generation_prompt,
            }
        else:
            body = {"model": rin.model, "prompt": rin.prompt_text}
        key = msgspec.json.encode(body)
        cached = self._remote_cache.get(key)
        if cached is not None:
            return cached
        for h in self.pool.handles.values():
            if not h.state.available:
                continue
            try:
                resp = await self.client.post(
                    f"{h.config.url.rstrip('/')}/tokenize",
                    content=key,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError:
                continue
            if resp.status_code == 400:
                raise BadRequest(f"the worker could not tokenize the request: {resp.text[:300]}")
            if resp.status_code == 200:
                return self._remote_cache.put(key, list(resp.json().get("tokens", [])))
        raise NoWorkerAvailable("no worker answered /tokenize (--tokenizer remote)")

    # ---- control endpoints -----------------------------------------------------------

    async def _control(
        self, scope: Scope, receive: Receive, send: Send, path: str, method: str
    ) -> None:
        if method == "GET" and path == "/health":
            status, doc = self.health()
            await send_json(send, status, doc)
        elif method == "GET" and path == "/ready":
            ready = self.started and any(h.state.available for h in self.pool.handles.values())
            await send_json(send, 200 if ready else 503, {"ready": ready})
        elif method == "GET" and path == "/metrics" and self.config.metrics:
            await send_bytes(send, 200, self.metrics.render(), b"text/plain; version=0.0.4")
        elif method == "GET" and path == "/v1/models":
            await send_json(send, 200, self.models())
        elif path == "/admin/workers":
            self._authorize(scope)
            if method == "POST":
                await self._reload_workers(await read_body(receive, 1 << 20))
            elif method != "GET":
                raise MethodNotAllowed("/admin/workers takes GET or POST")
            await send_json(send, 200, {"workers": self.worker_list()})
        elif path == "/debug/route":
            self._authorize(scope)
            body = await read_body(receive, self.config.max_body_bytes) if method == "POST" else b""
            await send_json(send, 200, await self.debug_route(scope, body))
        else:
            raise NotFound(f"no route for {method} {path}")

    def _authorize(self, scope: Scope) -> None:
        token = self.config.admin_token
        if token is None:
            return
        given = header(scope, b"authorization") or b""
        if given != f"Bearer {token}".encode():
            raise Forbidden("admin endpoint: send 'Authorization: Bearer <admin_token>'")

    def health(self) -> tuple[int, dict[str, Any]]:
        reports = [self.pool.worker_report(h) for h in self.pool.handles.values()]
        statuses = {r["status"] for r in reports}
        if "unhealthy" in statuses:
            status = "unhealthy"
        elif "degraded" in statuses:
            status = "degraded"
        elif not any(r["available"] for r in reports):
            status = "unhealthy"
        else:
            status = "ok"
        code = (
            200
            if status == "ok" or (status == "degraded" and self.config.health_degraded_ok)
            else 503
        )
        doc = {
            "status": status,
            "unhealthy_workers": [r["name"] for r in reports if r["status"] != "ok"],
            "workers": reports,
        }
        return code, doc

    def models(self) -> dict[str, Any]:
        seen: dict[str, dict[str, Any]] = {}
        for h in self.pool.handles.values():
            for m in h.models:
                seen.setdefault(str(m.get("id")), m)
        return {"object": "list", "data": list(seen.values())}

    def worker_list(self) -> list[dict[str, Any]]:
        return [
            {
                "name": h.name,
                "url": h.config.url,
                "available": h.state.available,
                "mode": h.state.mode,
                "block_size": h.state.block_size,
                "configured_block_size": h.config.block_size or self.config.block_size,
                "mode_setting": h.mode_setting,
                "topic": h.source.topic if h.source else None,
                "events_endpoint": h.source.endpoint if h.source else None,
                "replay_endpoint": h.source.replay_endpoint if h.source else None,
            }
            for h in self.pool.handles.values()
        ]

    async def _reload_workers(self, body: bytes) -> None:
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("workers"), list):
            raise BadRequest('send {"workers": [URL or {url, events?, replay?, ...}, ...]}')
        try:
            new = from_mapping({"workers": doc["workers"]}, self.config).validate()
        except ConfigError as err:
            raise BadRequest(err.message, param=err.param) from None
        await self.pool.set_workers(new.workers)
        log.warning("worker list reloaded: %s", ", ".join(w.name for w in new.workers))

    async def _watch_workers_file(self) -> None:
        import os

        import yaml

        path = self.config.workers_file
        assert path is not None
        last = 0.0
        while True:
            try:
                mtime = os.stat(path).st_mtime
                if mtime != last:
                    last = mtime
                    with open(path) as f:
                        raw = yaml.safe_load(f) or {}
                    entries = raw.get("workers", raw) if isinstance(raw, dict) else raw
                    workers = tuple(
                        WorkerConfig(e) if isinstance(e, str) else WorkerConfig(**e)
                        for e in entries
                    )
                    await self.pool.set_workers(workers)
            except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
                log.error("workers file %s: %s (keeping the current list)", path, exc)
            await asyncio.sleep(2.0)

    async def debug_route(self, scope: Scope, body: bytes) -> dict[str, Any]:
        """Score a prompt without sending it anywhere. `?tokens=1` adds the router's token ids
        (`prompt_token_ids`), so router-check can compare them with the engine's /tokenize."""
        from urllib.parse import parse_qs

        qs = parse_qs(scope.get("query_string", b"").decode())
        if body:
            doc = msgspec.json.decode(body)
            kind = "chat" if isinstance(doc, dict) and "messages" in doc else "completion"
        else:
            prompt = (qs.get("prompt") or [""])[0]
            body, kind = msgspec.json.encode({"prompt": prompt}), "completion"
        rin = parse(kind, body)
        tokens = await self.tokens(rin)
        decision = self.core.route(tokens, self.namespace(rin))
        out = self._decision_doc(decision)
        if (qs.get("tokens") or ["0"])[0] in ("1", "true", "yes"):
            out["prompt_token_ids"] = list(tokens)
        return out

    def _decision_doc(self, decision: Decision) -> dict[str, Any]:
        return {
            "policy": decision.policy,
            "prompt_tokens": decision.prompt_tokens,
            "winner": decision.best.worker,
            "weights": dict(self.config.scoring.weights),
            "workers": [
                {
                    "worker": s.worker,
                    "total": round(s.total, 4),
                    "scores": {k: round(v, 4) for k, v in s.raw.items()},
                    "weighted": {k: round(v, 4) for k, v in s.weighted.items()},
                    "overlap_blocks": s.overlap_blocks,
                    "overlap_by_tier": s.overlap_by_tier,
                    "block_size": s.block_size,
                    "requests_in_flight": s.requests,
                    "prefill_tokens_in_flight": s.prefill_tokens,
                    "decode_blocks": s.decode_blocks,
                    "cached_blocks": s.cached_blocks,
                    "capacity_blocks": s.capacity_blocks,
                    "mode": s.mode,
                    "excluded": s.excluded,
                }
                for s in decision.ranked
            ],
            "scorer_us": {k: round(v, 1) for k, v in decision.scorer_us.items()},
            "explain": decision.explain(),
        }


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task when its client disconnects; closing the upstream connection
    on the way out makes the engine abort the request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return
