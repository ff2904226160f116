"""The two legs of a split request, and what each failure means for the client.

Prefill leg: sent to the prefill worker, read whole (it is `stream=false`, one token). Any
failure here happens before a byte reached the client: the door then prefills on the decode
worker instead (counted by cause). Decode leg: the client's request plus the params, relayed
to the client as it streams. Its timeouts leave room for the KV pull, and a decode leg that
times out even so counts against the decode worker only where its engine generated no token
meanwhile (`WorkerPool.timed_out`); once a byte reached the client a failure is one error,
never a second stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router.asgi import Message, Send
from router.core.config import Config
from router.core.decision import Decision
from router.forward import ConnectFailed, Forwarder, Outcome, WorkerTimedOut, with_rank
from router.openai_req import RoutingInput
from router.pd.model import Plan
from router.pd.wire import params_problem, prefill_body, response_params
from router.upstream import Timeouts, UpstreamClosed, UpstreamConnectError, UpstreamPool
from router.workers import WorkerHandle

log = logging.getLogger("kvroute.pd")

HANDSHAKE_S = 10.0  # a decode leg's first pull from an engine handshakes (vLLM: up to 5 s)
PULL_SLACK = 4.0  # times the predicted transfer a decode leg may take beyond its prefill
UNKNOWN_MS_PER_TOKEN = 1.0  # transfer time assumed while the link is unknown (~1 GbE, 88 KB)
# a prefill leg's statuses that judge the request, not the worker: the request is still
# sent the proxy's way (a leg-only cause, such as a prefill worker's shorter context,
# must not lose it), without counting against the prefill worker
REQUEST_REFUSED = frozenset({400, 413, 422})


class ClientRequest(Protocol):
    """What the proxy door hands over (router.proxy._Request)."""

    decision: Decision
    rin: RoutingInput
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    request_id: bytes
    started: float
    first_byte: float | None
    tries: list[str]  # the endpoints the proxy's way sent it, in order

    def cancelled_outcome(self) -> str: ...


class LegFailed(Exception):
    """The prefill leg gave nothing usable; `cause` is the fallback's metric label and
    `orphan` says whether the prefill worker holds blocks no one will read."""

    def __init__(self, cause: str, detail: str, orphan: bool = False, status: int = 0) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail
        self.orphan = orphan
        self.status = status  # the prefill worker's HTTP status, when it answered


@dataclass
class PrefillAnswer:
    params: dict[str, Any]
    cached_tokens: int | None
    seconds: float


async def prefill_leg(
    upstream: UpstreamPool,
    h: WorkerHandle,
    r: ClientRequest,
    doc: dict[str, Any],
    rank: int | None,
    config: Config,
    block_size: int,
) -> PrefillAnswer:
    """Raises LegFailed; never sends anything to the client."""
    body = prefill_body(doc, r.rin.kind == "chat")
    c = config
    timeouts = Timeouts(c.first_byte_timeout_s, c.first_byte_timeout_s, c.inter_chunk_timeout_s)
    start = time.perf_counter()
    try:
        resp = await upstream.request(
            h.host, h.port, b"POST", r.target, with_rank(r.headers, rank), body, h.tls, timeouts
        )
        try:
            data = await resp.read()
        except BaseException:
            # closing tells the engine to abort the request, and frees its KV now rather
            # than when its lease ends
            resp.close()
            raise
    except UpstreamConnectError as exc:
        raise LegFailed("prefill_failed", f"connect: {exc}") from None
    except UpstreamClosed as exc:
        raise LegFailed("prefill_failed", f"closed: {exc}") from None
    except TimeoutError:
        raise LegFailed("prefill_timeout", "no answer in time") from None
    if resp.status in REQUEST_REFUSED:
        # the engine judged the request itself (vLLM's 400 for `temperature: -5`): no fault
        # of the prefill worker's, and the decode worker's answer is the client's
        raise LegFailed(
            "prefill_refused", f"HTTP {resp.status}: {data[:200]!r}", status=resp.status
        )
    if resp.status != 200:
        raise LegFailed("prefill_failed", f"HTTP {resp.status}: {data[:200]!r}", status=resp.status)
    params, cached = response_params(data)
    problem = params_problem(params, r.decision.prompt_tokens, block_size)
    if problem is not None:
        holds = isinstance(params, dict) and params.get("do_remote_prefill") is True
        raise LegFailed("prefill_bad_params", problem, orphan=holds, status=200)
    assert isinstance(params, dict)
    return PrefillAnswer(params, cached, time.perf_counter() - start)


def decode_timeouts(
    config: Config, stream: bool, transfer_ms: float | None, tokens: int
) -> Timeouts:
    """The proxy's timeouts plus room for the pull: a handshake and a few times the
    predicted transfer (a slow link is not a hung worker)."""
    ms = transfer_ms if transfer_ms is not None else tokens * UNKNOWN_MS_PER_TOKEN
    allowance = HANDSHAKE_S + PULL_SLACK * ms / 1000
    c = config
    first = (c.first_byte_timeout_s if stream else c.request_timeout_s) + allowance
    return Timeouts(first, first, c.inter_chunk_timeout_s)


async def decode_leg(
    forwarder: Forwarder,
    h: WorkerHandle,
    worker: str,
    r: ClientRequest,
    body: bytes,
    rank: int | None,
    send: Send,
    timeouts: Timeouts,
    on_first_byte: Callable[[], None],
) -> Outcome:
    """Relays the decode worker's answer. Raises ConnectFailed only when the worker never
    took the request (WorkerTimedOut: it took it and did not answer in time)."""
    return await forwarder.forward(
        worker=worker,
        host=h.host,
        port=h.port,
        tls=h.tls,
        path=r.target,
        headers=with_rank(r.headers, rank),
        body=body,
        send=send,
        request_id=r.request_id,
        on_first_byte=on_first_byte,
        timeouts=timeouts,
    )


def reached_worker(exc: ConnectFailed) -> bool:
    """The decode worker took the request before it failed. Only a failed connect (the
    upstream pool's "connect to ..." error) sent nothing."""
    return isinstance(exc, WorkerTimedOut) or not exc.detail.startswith("connect to")


DECODE_FALLBACKS = frozenset(
    {"decode_removed", "decode_unavailable", "decode_unreachable", "decode_closed"}
)


def tagged(send: Send, plan: Plan, fallback: str | None = None) -> Send:
    """The response names the P/D decision: `x-kvroute-pd: split prefill=W`, `local
    reason=R`, for a split whose prefill leg failed `local reason=prefill_fallback cause=C
    prefill=W` (it was prefilled on the decode worker after all), and for one whose decode
    worker left or could not be reached `local reason=decode_fallback cause=C decode=D`
    (served the proxy's way, on another endpoint)."""
    if fallback in DECODE_FALLBACKS:
        value = f"local reason=decode_fallback cause={fallback} decode={plan.decode}".encode()
    elif fallback is not None:
        value = f"local reason=prefill_fallback cause={fallback} prefill={plan.prefill}".encode()
    elif plan.split:
        value = f"split prefill={plan.prefill} reason={plan.reason}".encode()
    else:
        value = f"local reason={plan.reason}".encode()

    async def tagged_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"x-kvroute-pd", value)]
            message = {**message, "headers": headers}
        await send(message)

    return tagged_send
