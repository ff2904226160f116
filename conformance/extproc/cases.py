"""The GIE endpoint-picker cases, each a coroutine that plays the gateway against a picker
and raises CaseFailed (or AssertionError) naming what was wrong; returns a short detail."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conformance.extproc import wire
from conformance.extproc.wire import DUPLEX, Answer, Stream

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class CaseFailed(AssertionError):
    pass


class CaseSkipped(Exception):
    pass


@dataclass
class Kit:
    channel: grpc.aio.Channel
    endpoints: list[str]
    model: str
    timeout_s: float = 5.0

    def stream(self) -> Stream:
        return Stream(self.channel, self.timeout_s)


Case = Callable[[Kit], Awaitable[str]]


def need(ok: bool, message: str) -> None:
    if not ok:
        raise CaseFailed(message)


def check_decision(kit: Kit, ans: Answer, allowed: list[str] | None = None) -> list[str]:
    """GIE: header and envoy.lb metadata both set, equal, an ordered comma-separated list of
    known endpoints, and the route cache cleared. The list may repeat its endpoints only in
    order (a, b, a, b): one entry per attempt the gateway makes, so that Envoy's override
    host policy never runs out of picks and falls through to its round robin."""
    need(ans.kind != "immediate_response", f"immediate response {ans.status}: {ans.body[:200]!r}")
    need(ans.header is not None, f"no {wire.DEST} header mutation in the {ans.kind} answer")
    need(ans.metadata is not None, f"no dynamic metadata {wire.LB}/{wire.DEST}")
    need(ans.header == ans.metadata, f"header {ans.header!r} != metadata {ans.metadata!r}")
    need(ans.clear_route_cache, "clear_route_cache is not set with the decision")
    eps = ans.endpoints
    need(bool(eps), "the decision names no endpoint")
    distinct = list(dict.fromkeys(eps))
    cycled = [distinct[i % len(distinct)] for i in range(len(eps))]
    need(eps == cycled, f"endpoints repeated out of order in {eps}")
    pool = allowed if allowed is not None else kit.endpoints
    need(all(e in pool for e in eps), f"{eps} names endpoints outside {pool}")
    return eps


async def buffered(kit: Kit, path: str, body: bytes, **kw: object) -> Answer:
    s = kit.stream()
    try:
        first = await s.ask(wire.request_headers("POST", path, **kw))  # type: ignore[arg-type]
        if first.kind == "immediate_response" or first.header is not None:
            return first
        need(first.kind == "request_headers", f"headers answered with {first.kind}")
        return await s.ask(wire.request_body(body))
    finally:
        await s.close()


def check_error(ans: Answer, status: int) -> str:
    need(ans.kind == "immediate_response", f"expected ImmediateResponse {status}, got {ans.kind}")
    need(ans.status == status, f"status {ans.status}, expected {status}")
    doc = ans.json()
    err = doc.get("error") if isinstance(doc, dict) else None
    need(
        isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err,
        f"body is not OpenAI's error shape: {ans.body[:200]!r}",
    )
    assert isinstance(err, dict)
    return f"{status} {err.get('type')}: {str(err.get('message'))[:80]}"


# ---- the cases -------------------------------------------------------------------------------


async def health(kit: Kit) -> str:
    stub = health_pb2_grpc.HealthStub(kit.channel)
    seen = []
    for name in ("", "liveness", "readiness", SERVICE):
        req = health_pb2.HealthCheckRequest(service=name)
        resp = await stub.Check(req, timeout=kit.timeout_s)
        need(resp.status == health_pb2.HealthCheckResponse.SERVING, f"{name!r}: {resp.status}")
        seen.append(name or '""')
    return "SERVING: " + ", ".join(seen)


async def buffered_completion(kit: Kit) -> str:
    ans = await buffered(kit, "/v1/completions", wire.completion_body(kit.model, "hello " * 50))
    return f"picked {','.join(check_decision(kit, ans))}"


async def buffered_chat(kit: Kit) -> str:
    ans = await buffered(kit, "/v1/chat/completions", wire.chat_body(kit.model, "hi " * 50))
    return f"picked {','.join(check_decision(kit, ans))}"


async def duplex_completion(kit: Kit) -> str:
    # > one 64 KiB chunk, with a short prompt: JSON whitespace pads it (any model accepts it)
    short = wire.completion_body(kit.model, "stream me " * 20)
    body = short[:1] + b" " * 100_000 + short[1:]
    s = kit.stream()
    try:
        await s.send(wire.request_headers("POST", "/v1/completions", body_mode=DUPLEX))
        half = len(body) // 2
        await s.send(wire.request_body(body[:half], end=False))
        await s.send(wire.request_body(body[half:], end=True))
        ans = await s.read()
        need(ans.kind == "request_headers", f"first answer is {ans.kind}, not the headers'")
        eps = check_decision(kit, ans)
        echoed, _ = await s.read_body()
        need(echoed == body, f"body handed back differs: {len(echoed)} vs {len(body)} bytes")
    finally:
        await s.close()
    return f"picked {','.join(eps)}; {len(body)} body bytes handed back intact"


async def subset_hint(kit: Kit) -> str:
    need(len(kit.endpoints) >= 2, "needs two --endpoints")
    for target in kit.endpoints[:2]:
        for _ in range(5):
            body = wire.completion_body(kit.model, f"subset {target} " * 20)
            ans = await buffered(kit, "/v1/completions", body, subset=[target])
            check_decision(kit, ans, allowed=[target])
    return "10 picks, each inside its one-endpoint subset"


async def empty_subset(kit: Kit) -> str:
    body = wire.completion_body(kit.model, "nothing eligible")
    return check_error(await buffered(kit, "/v1/completions", body, subset=[]), 503)


async def unparsable_body(kit: Kit) -> str:
    return check_error(await buffered(kit, "/v1/completions", b"{not json"), 400)


async def unknown_model(kit: Kit) -> str:
    body = wire.completion_body("no-such-model-kit", "hello")
    return check_error(await buffered(kit, "/v1/completions", body), 404)


async def models(kit: Kit) -> str:
    s = kit.stream()
    try:
        ans = await s.ask(wire.request_headers("GET", "/v1/models", end_of_stream=True))
    finally:
        await s.close()
    need(ans.kind == "immediate_response", f"GET /v1/models answered with {ans.kind}")
    need(ans.status == 200, f"status {ans.status}")
    doc = ans.json()
    ids = [m.get("id") for m in doc.get("data", [])] if isinstance(doc, dict) else []
    need(doc.get("object") == "list" and bool(ids), f"not a model list: {ans.body[:200]!r}")
    return f"models {ids}"


async def bodyless_get(kit: Kit) -> str:
    s = kit.stream()
    try:
        ans = await s.ask(wire.request_headers("GET", "/health", end_of_stream=True))
    finally:
        await s.close()
    need(ans.kind == "request_headers", f"answered with {ans.kind}")
    return f"picked {','.join(check_decision(kit, ans))} on the headers"


async def client_header_ignored(kit: Kit) -> str:
    rogue = "192.0.2.1:1"  # TEST-NET-1: never a pool member
    body = wire.completion_body(kit.model, "steer me")
    ans = await buffered(kit, "/v1/completions", body, extra=[(wire.DEST, rogue)])
    eps = check_decision(kit, ans)
    need(rogue not in eps, f"the client's {wire.DEST} steered the pick: {eps}")
    return f"picked {','.join(eps)}, not the client's {rogue}"


async def response_side(kit: Kit) -> str:
    """A whole exchange with the served endpoint read back on the response: every response
    message answered, none of them altering the body in STREAMED mode."""
    s = kit.stream()
    try:
        body = wire.completion_body(kit.model, "account me " * 10)
        first = await s.ask(wire.request_headers("POST", "/v1/completions"))
        ans = first if first.header is not None else await s.ask(wire.request_body(body))
        eps = check_decision(kit, ans)
        served = list(dict.fromkeys(eps))[-1]  # the last fallback (the list may cycle)
        ans = await s.ask(wire.response_headers(200, served, "text/event-stream"))
        need(ans.kind == "response_headers", f"response headers answered with {ans.kind}")
        for i, chunk in enumerate((b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n")):
            ans = await s.ask(wire.response_body(chunk, end=i == 1))
            need(ans.kind == "response_body", f"response body answered with {ans.kind}")
            need(not ans.body, "STREAMED response body altered")
    finally:
        await s.close()
    return f"picked {eps[0]}, served by {served}: response answered"


async def duplex_response(kit: Kit) -> str:
    s = kit.stream()
    try:
        body = wire.completion_body(kit.model, "echo")
        await s.send(wire.request_headers("POST", "/v1/completions", body_mode=DUPLEX))
        await s.send(wire.request_body(body))
        check_decision(kit, await s.read())
        await s.read_body()
        await s.ask(wire.response_headers(200, None, "text/event-stream"))
        chunk = b'data: {"choices":[]}\n\n'
        ans = await s.ask(wire.response_body(chunk, end=True))
    finally:
        await s.close()
    need(ans.kind == "response_body", f"response body answered with {ans.kind}")
    need(ans.body == chunk and ans.end_of_stream, "response chunk not handed back as it came")
    return "response chunk handed back in FULL_DUPLEX_STREAMED"


CASES: dict[str, Case] = {
    "health": health,
    "buffered-completion": buffered_completion,
    "buffered-chat": buffered_chat,
    "full-duplex-completion": duplex_completion,
    "subset-hint": subset_hint,
    "empty-subset-503": empty_subset,
    "unparsable-body-400": unparsable_body,
    "unknown-model-404": unknown_model,
    "models-200": models,
    "bodyless-get": bodyless_get,
    "client-header-ignored": client_header_ignored,
    "served-endpoint-readback": response_side,
    "full-duplex-response": duplex_response,
}
