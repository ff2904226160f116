"""Forwarding one request to one worker: pooled keep-alive connections, headers cleaned both
ways (hop-by-hop and `Connection`-listed headers dropped, `X-Forwarded-*` added), responses
streamed through as they arrive (SSE first byte latency preserved; the proxy holds an event
stream's head until its first chunk), the engine's reported cached tokens sniffed on the way.

A worker that fails before anything reached the client raises a retryable error
(`ConnectFailed`, `WorkerTimedOut`); one that fails mid-stream ends the client's stream with
an OpenAI-shaped error event and `[DONE]`, so a truncated answer never looks complete (a
body that is no event stream is cut short instead: `Outcome.cut`). Error
texts sent to clients never name internal addresses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from router.asgi import Send, sse_error
from router.core.errors import UpstreamError, UpstreamTimeout
from router.upstream import (
    Response,
    Timeouts,
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamPool,
)

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        # the router has read the whole body: a worker asked to confirm it first would
        # answer 100 Continue to a request that is already complete
        b"expect",
    }
)
RANK_HEADER = b"x-data-parallel-rank"  # vLLM routes a request to this data-parallel rank
# Routing decisions belong to the router; a client must not be able to steer them (a
# client's rank header came first, and vLLM reads the first: the index and load counted
# the router's rank while another one served)
ROUTING_HEADERS = frozenset(
    {
        b"x-kvroute-worker",
        b"x-gateway-destination-endpoint",
        b"x-gateway-destination-endpoint-subset",
        b"x-gateway-destination-endpoint-served",
        RANK_HEADER,
    }
)
_json = msgspec.json.Decoder()


FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host")


def with_rank(headers: list[tuple[bytes, bytes]], rank: int | None) -> list[tuple[bytes, bytes]]:
    """The headers for an endpoint that is a data-parallel rank (None: the engine picks)."""
    return headers if rank is None else [*headers, (RANK_HEADER, b"%d" % rank)]


class ConnectFailed(Exception):
    """Nothing reached the client, and the worker did not take the request (or was given up
    on before it answered): safe to retry elsewhere."""

    def __init__(self, worker: str, detail: str) -> None:
        super().__init__(f"{worker}: {detail}")
        self.worker = worker
        self.detail = detail


FIRST_CHUNK_LATE = "no first chunk in time"  # an event stream's head came, its first chunk not


class WorkerTimedOut(ConnectFailed):
    """The worker did not answer in time and nothing reached the client yet."""


class WorkerBrokeOff(ConnectFailed):
    """The worker took the request, sent an event stream's head and closed before its first
    chunk, while nothing had reached the client: this request failed there (a proxy's idle
    timeout in between, a generator that raised), not the worker's every connection."""


@dataclass
class Outcome:
    status: int
    cached_tokens: int | None = None
    bytes_out: int = 0
    broken: str | None = None  # why a response that had started was cut short
    # a stream cut for the worker's silence: how long it had been silent (the timeout that
    # expired), so the door can ask whether the engine generated anything meanwhile
    silent_s: float = 0.0
    # a cut body with no in-band end (not an event stream): its last chunk was held back,
    # and the door closes the client's connection (`CUT_RESPONSE`)
    cut: bool = False


def relative_location(value: bytes, origin: bytes) -> bytes:
    """A redirect the worker points at itself (vLLM's trailing-slash 307 names the host it
    was asked as: the worker's address) goes back to the client as a path on the router:
    an absolute one would send the client past the router, and name an internal address."""
    for scheme in (b"http://", b"https://"):
        prefix = scheme + origin
        if origin and value.lower().startswith(prefix.lower()):
            rest = value[len(prefix) :]
            if not rest or rest[:1] in (b"/", b"?", b"#"):
                return rest if rest[:1] == b"/" else b"/" + rest
    return value


def connection_listed(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a `Connection` header declares hop-by-hop (RFC 9110 7.6.1)."""
    out: set[bytes] = set()
    for k, v in headers:
        if k == b"connection":
            out.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return out


def upstream_headers(
    client_headers: list[tuple[bytes, bytes]],
    request_id: bytes,
    extra_strip: bytes,
    forwarded: tuple[bytes, bytes, bytes] | None = None,
) -> list[tuple[bytes, bytes]]:
    """The client's headers as the worker gets them. `forwarded`: (client address, scheme,
    host) for X-Forwarded-For/-Proto/-Host, appended to what a proxy in front already set."""
    listed = connection_listed(client_headers)
    out = [
        (k, v)
        for k, v in client_headers
        if k not in HOP_BY_HOP
        and k not in ROUTING_HEADERS
        and k not in listed
        and k != extra_strip
        and k != b"x-request-id"
        and (forwarded is None or k not in FORWARDED)
    ]
    if forwarded is not None:
        before = next((v for k, v in client_headers if k == b"x-forwarded-for"), None)
        address, scheme, host = forwarded
        out.append((b"x-forwarded-for", before + b", " + address if before else address))
        out.append((b"x-forwarded-proto", scheme))
        if host:
            out.append((b"x-forwarded-host", host))
    out.append((b"x-request-id", request_id))
    return out


class Forwarder:
    def __init__(self, pool: UpstreamPool, worker_header: bytes) -> None:
        self.pool = pool
        self.worker_header = worker_header

    async def forward(
        self,
        *,
        worker: str,
        host: str,
        port: int,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        send: Send,
        request_id: bytes,
        on_first_byte: Callable[[], None],
        tls: bool = False,
        method: bytes = b"POST",
        timeouts: Timeouts | None = None,
        hold_head: bool = False,
    ) -> Outcome:
        """Relay the worker's answer. `hold_head`: an event stream's head waits for its
        first chunk (`_first_chunk`), so that a worker hanging before it can still be left
        for another (`WorkerTimedOut`)."""
        timeouts = timeouts or self.pool.timeouts
        try:
            response = await self.pool.request(
                host, port, method, path, headers, body, tls, timeouts
            )
        except UpstreamConnectError as exc:
            raise ConnectFailed(worker, str(exc)) from None
        except UpstreamClosed as exc:
            if exc.before_response:
                raise ConnectFailed(worker, str(exc)) from None
            raise UpstreamError(
                "the worker broke off its response", detail=f"{worker}: {exc}"
            ) from None
        except TimeoutError:
            raise WorkerTimedOut(worker, "no response head in time") from None
        try:
            origin = b"%s:%d" % (host.encode(), port)
            outcome = await self._relay(
                worker, response, send, request_id, on_first_byte, origin, timeouts, hold_head
            )
        except BaseException:
            response.close()
            raise
        return outcome

    async def _relay(
        self,
        worker: str,
        response: Response,
        send: Send,
        request_id: bytes,
        on_first_byte: Callable[[], None],
        origin: bytes,  # the worker's host:port, as its Location headers name it
        timeouts: Timeouts,
        hold_head: bool,
    ) -> Outcome:
        listed = connection_listed(response.headers)
        headers = [
            (k, relative_location(v, origin) if k == b"location" else v)
            for k, v in response.headers
            if k not in HOP_BY_HOP and k not in listed and k != b"x-request-id"
        ]
        if self.worker_header:
            headers.append((self.worker_header, worker.encode()))
        headers.append((b"x-request-id", request_id))
        ctype = next((v for k, v in response.headers if k == b"content-type"), b"")
        outcome = Outcome(response.status)
        if ctype.startswith(b"application/json"):
            return await self._relay_buffered(
                worker, response, send, headers, outcome, on_first_byte
            )
        if hold_head and ctype.startswith(b"text/event-stream"):
            await _first_chunk(worker, response)
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        sniffer = UsageSniffer()
        first = True
        tail = b""  # the last bytes relayed: an event a cut leaves open is ended first
        try:
            async for chunk in response.chunks():
                if first:
                    on_first_byte()
                    first = False
                sniffer.feed(chunk)
                tail = (tail + chunk)[-2:]
                outcome.bytes_out += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (UpstreamClosed, TimeoutError) as exc:
            # the response already started: end it so the client can tell it was cut short
            outcome.status = 502
            outcome.broken = "timeout" if isinstance(exc, TimeoutError) else "worker_failed"
            outcome.silent_s = timeouts.first_chunk if first else timeouts.between_chunks
            response.close()
            if not ctype.startswith(b"text/event-stream"):
                outcome.cut = True
                return outcome
            await send(
                {
                    "type": "http.response.body",
                    "body": _sse_error(outcome.broken, tail),
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b""})
        outcome.cached_tokens = sniffer.cached_tokens
        return outcome

    async def _relay_buffered(
        self,
        worker: str,
        response: Response,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: Outcome,
        on_first_byte: Callable[[], None],
    ) -> Outcome:
        try:
            body = await response.read()
        except TimeoutError:
            response.close()
            raise UpstreamTimeout(
                "the worker timed out sending its response", detail=f"worker {worker}"
            ) from None
        except UpstreamClosed as exc:
            raise UpstreamError(
                "the worker broke off its response", detail=f"worker {worker}: {exc}"
            ) from None
        on_first_byte()
        outcome.cached_tokens = cached_tokens_of(body)
        outcome.bytes_out = len(body)
        headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return outcome


async def _first_chunk(worker: str, response: Response) -> None:
    """Wait for an event stream's first chunk before relaying its head. vLLM sends a
    stream's head at once, before its engine produced anything: relayed then, a worker
    hanging behind it (an engine stuck behind a live API server) would leave the client a
    started stream to cut, where nothing has reached it yet and another worker can still
    serve it. The client's first token comes no later."""
    try:
        await response.started()
    except TimeoutError:
        raise WorkerTimedOut(worker, FIRST_CHUNK_LATE) from None
    except UpstreamClosed as exc:
        raise WorkerBrokeOff(worker, f"closed before the first chunk: {exc}") from None


def _sse_error(cause: str, tail: bytes) -> bytes:
    """The last events of a stream cut short (`asgi.sse_error`): the worker's failure."""
    message = (
        "the worker stopped responding mid-stream"
        if cause == "timeout"
        else "the worker failed mid-stream"
    )
    return sse_error(UpstreamError(message + "; the answer is incomplete"), tail)


def cached_tokens_of(body: bytes) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of an OpenAI response, if reported."""
    if b"prompt_tokens_details" not in body:
        return None
    try:
        doc = _json.decode(body)
        details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
    except (msgspec.DecodeError, AttributeError):
        return None
    return value if isinstance(value, int) else None


class UsageSniffer:
    """Finds the usage chunk of an SSE stream (stream_options.include_usage) without parsing
    the rest."""

    def __init__(self) -> None:
        self.cached_tokens: int | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if b"prompt_tokens_details" not in chunk and not self._tail:
            return
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop() if not data.endswith(b"\n") else b""
        if len(self._tail) > 65536:
            self._tail = b""
        for line in lines:
            if line.startswith(b"data: {") and b"prompt_tokens_details" in line:
                found = cached_tokens_of(line[6:])
                if found is not None:
                    self.cached_tokens = found
