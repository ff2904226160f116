"""The simulated worker's HTTP surface: vLLM's endpoints and shapes, plus `/sim/cached_tokens`.

Routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /health, /version,
/load, /tokenize, /detokenize, /metrics, /kv_event_sources, POST /reset_prefix_cache,
/server_info, /model_info, /get_model_info, /v1/completions/render,
/v1/chat/completions/render, the simulator's GET /sim/stats, and the ground truth
POST /sim/cached_tokens
`{prompt | messages | token_ids, model?, cache_salt?}` ->
`{"cached_tokens", "cached_blocks", "prompt_tokens", "block_size"}` (no state change;
`cached_tokens` is what a request would be served from cache, capped like vLLM below the last
prompt token; `cached_blocks` counts every leading full block held).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engines.sim import respond
from engines.sim.asgi import (
    EventStream,
    Json,
    error_response,
    json_body,
    unless_disconnected,
)
from engines.sim.errors import ApiError, bad_request
from engines.sim.metrics import CONTENT_TYPE
from engines.sim.pd_http import decode_leg
from engines.sim.routes_info import info_routes

if TYPE_CHECKING:
    from engines.sim.worker import SimWorker

Handler = Callable[[Request], Awaitable[Response]]


def build_app(worker: SimWorker) -> Starlette:
    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await worker.startup()
        try:
            yield
        finally:
            await worker.shutdown()

    def route(
        path: str, fn: Callable[[SimWorker, Request], Awaitable[Response]], method: str
    ) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(worker, request)
            except ApiError as err:
                return error_response(err)

        return Route(path, endpoint, methods=[method])

    routes = [
        route("/v1/completions", completions, "POST"),
        route("/v1/chat/completions", chat_completions, "POST"),
        route("/tokenize", tokenize, "POST"),
        route("/detokenize", detokenize, "POST"),
        route("/metrics", metrics, "GET"),
        route("/reset_prefix_cache", reset_prefix_cache, "POST"),
        route("/sim/cached_tokens", cached_tokens, "POST"),
        *(route(p, f, m) for p, f, m in info_routes()),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
    if worker.config.api_key:
        app.add_middleware(ApiKeyGuard, api_key=worker.config.api_key)
    return app


class ApiKeyGuard:
    """vLLM's --api-key: paths under /v1, /v2, /inference, /cohere need the bearer key;
    /health, /metrics, /tokenize and the rest do not."""

    GUARDED = ("/v1", "/v2", "/inference", "/cohere")

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if scope["path"].startswith(self.GUARDED) and given != self.expected:
                await Json({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def not_found(request: Request, exc: Exception) -> Response:
    return Json({"detail": "Not Found"}, status_code=404)  # FastAPI's body, as vLLM sends


# ---- generation ------------------------------------------------------------------------


async def completions(w: SimWorker, request: Request) -> Response:
    return await _generate(w, request, chat=False)


async def chat_completions(w: SimWorker, request: Request) -> Response:
    return await _generate(w, request, chat=True)


async def _generate(w: SimWorker, request: Request, chat: bool) -> Response:
    gen = w.renderer.generate_request(await json_body(request), chat)
    gen.remote = decode_leg(w, gen)
    prefix = "chatcmpl" if chat else "cmpl"
    rid = f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
    created = int(time.time())
    if gen.stream:
        return EventStream(respond.stream(w, gen, rid, created, chat))
    body = await unless_disconnected(request.receive, respond.collect(w, gen, rid, created, chat))
    if body is None:
        return Json(bad_request("Client disconnected").body(), status_code=400)
    return Json(body)


# ---- tokenization and cache ------------------------------------------------------------


async def tokenize(w: SimWorker, request: Request) -> Response:
    body = await json_body(request)
    w.renderer.keys_for(body)
    ids = w.renderer.tokenize_ids(body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": w.max_model_len, "tokens": ids}
    out["token_strs"] = w.tokenizer.token_strs(ids) if body.get("return_token_strs") else None
    return Json(out)


async def detokenize(w: SimWorker, request: Request) -> Response:
    body = await json_body(request)
    w.renderer.keys_for(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise bad_request("tokens must be a list of non-negative token ids", "tokens")
    return Json({"prompt": w.tokenizer.decode(tokens)})


async def metrics(w: SimWorker, request: Request) -> Response:
    return Response(w.metrics.render(w.engine.stats()), media_type=CONTENT_TYPE)


async def reset_prefix_cache(w: SimWorker, request: Request) -> Response:
    reset_running = request.query_params.get("reset_running_requests", "false").lower()
    ok = w.engine.reset_prefix_cache(reset_running in ("1", "true", "yes"))
    return Json({"success": ok})


async def cached_tokens(w: SimWorker, request: Request) -> Response:
    body = await json_body(request)
    keys = w.renderer.keys_for(body)
    ids = w.renderer.prompt_ids(body)
    bs = w.config.block_size
    held = w.engine.cached_tokens(ids, keys)
    # What a request would be served: never the last token, whole blocks only.
    capped = min(held, ((len(ids) - 1) // bs) * bs) if ids else 0
    return Json(
        {
            "cached_tokens": capped,
            "cached_blocks": held // bs,
            "prompt_tokens": len(ids),
            "block_size": bs,
        }
    )
