"""One HTTP request as Envoy's ext_proc filter shows it to the picker: request headers, body,
response headers, response body, on one gRPC stream. The exchange decides where the request
goes (the same decision service the HTTP proxy calls) and accounts for its load until the
response ends. It never forwards bytes: Envoy does.

A request with a body is decided on its body, as the proxy decides it: completions and chat
by their prompt, any other path by the body's `model` (`parse_passthrough`); one without a
body at its headers, by load. Body modes (Envoy's `processing_mode.request_body_mode`, told
in `protocol_config`):
- BUFFERED: the body arrives whole, in one message, after the headers were answered; the
  decision rides on the body answer. The message says end_of_stream false when trailers
  follow (HTTP/2), and it is the whole body all the same.
- FULL_DUPLEX_STREAMED (GIE's): headers, body chunks and trailers arrive without waiting;
  the headers answer (with the decision) is deferred until the body's end, then the body is
  handed back in chunks of at most 62 KB. A body that trailers end (HTTP/2) goes back whole
  inside the headers answer instead, which also lets the trailers through.
Response bodies are only read (STREAMED) or handed back as they come (FULL_DUPLEX_STREAMED),
or skipped (NONE: the headers are the first sign of output, the stream's close the end).
A stream that closes before its response ended in band is concluded from Envoy's access log
(`endings`): a client hang-up is the outcome `client_disconnected`, a worker that broke off
its response a 502, each as the proxy counts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from router.core.errors import ConfigError, KvrouteError, NoWorkerAvailable, PayloadTooLarge
from router.envoy.bootstrap import ACCESS_LOG_MARK, FALLBACK_RETRIES
from router.extproc import endings as ends
from router.extproc import gie
from router.extproc.cli import DEFAULT_MAX_BODY  # bodies the picker takes (413 above)
from router.forward import RANK_HEADER, UsageSniffer, cached_tokens_of
from router.openai_req import RoutingInput, parse_request
from router.routing import Constraints, DecisionService

log = logging.getLogger("kvroute.extproc")

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
# Bodies in pieces each answered before the next (STREAMED): the route is chosen before the
# body is whole, and chunks the picker holds back wait for Envoy's message_timeout. A request
# with a body is refused, naming the fix; one without is decided at its headers as in any
# mode. BUFFERED_PARTIAL sends a body within the gateway's buffer whole, as BUFFERED does;
# only one cut at that buffer is refused, naming the limit.
# NONE sends no body at all: a request with one would go unrouted (no decision, no load
# counted), so it is refused too, where the gateway says its mode (protocol_config; a
# gateway that says nothing may still send the body, and is waited for).
UNSUPPORTED_BODY_MODES = {processing_mode_pb2.ProcessingMode.STREAMED: "STREAMED", NO_BODY: "NONE"}
PARTIAL = processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL
_told_modes: set[int] = set()  # unsupported modes logged already (once a process each)
# Ordered fallbacks sent to the gateway: one per attempt it makes (`kvroute envoy-config`'s
# route retries FALLBACK_RETRIES times). Envoy's override-host policy takes the next one per
# retry and, once they run out, its fallback policy's pick over the whole cluster: a worker
# of another model, a prefill worker, one outside the subset. So the list is always this
# long, the eligible endpoints repeated in order where fewer.
MAX_FALLBACKS = FALLBACK_RETRIES + 1
# JSON responses are kept only to read usage.cached_tokens; a larger one is not usage-bearing.
MAX_KEPT_RESPONSE = 1 << 20
# The picker's first choice, on the response: with the gateway's served-endpoint header, a
# client (router-check --gateway) sees whether the gateway followed the pick.
WORKER_HEADER = "x-kvroute-worker"
RANK = RANK_HEADER.decode()

Responses = list[gie.ProcessingResponse]
_REQUEST_HEADERS = frozenset({":method", ":path", "x-request-id", ACCESS_LOG_MARK})
_RESPONSE_HEADERS = frozenset({":status", "content-type"})
_encode = msgspec.json.encode


class Exchange:
    """The state of one gRPC stream; `handle` answers each message Envoy sends."""

    def __init__(
        self,
        svc: DecisionService,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        endings: ends.Endings | None = None,
    ) -> None:
        self.svc = svc
        self.max_body_bytes = max_body_bytes
        self.endings = endings or ends.Endings()
        self.rid = ""  # Envoy's x-request-id, the access log's name for this request
        self.logged = False  # the gateway marked it: its access log comes to the picker
        self.listening = False  # the endings will say how it ended
        self.body_bytes = 0
        self.duplex_request = False
        self.buffered_request = False
        self.duplex_response = False
        self.reads_response = True  # response bodies come to the picker
        self.kind: str | None = None
        self.path = "/"
        self.subset: frozenset[str] | None = None
        self.decided = False
        self.body: list[bytes] = []
        self.got_body = False
        self.worker: str | None = None  # where the load is counted (the served one, once known)
        self.picked: str | None = None  # the first choice, named to the client
        self.sent: dict[str, str] = {}  # address -> endpoint, of the fallback list sent
        self.ticket: Any = None
        self.status = 0
        self.streaming = False
        self.first = True
        self.sniffer = UsageSniffer()
        self.kept: list[bytes] = []
        self.kept_bytes = 0

    async def handle(self, req: gie.ProcessingRequest) -> Responses:
        which = req.WhichOneof("request")
        if which == "request_headers":
            return await self._request_headers(req)
        if which == "request_body":
            return await self._request_body(req.request_body)
        if which == "request_trailers":
            return await self._request_trailers()
        if which == "response_headers":
            return self._response_headers(req)
        if which == "response_body":
            return self._response_body(req.response_body)
        if which == "response_trailers" and self.ticket is not None:
            self._safely(self._account, b"", True)  # FULL_DUPLEX_STREAMED: the trailers end it
        return [gie.passthrough(which)] if which else []

    # ---- request ------------------------------------------------------------------------

    async def _request_headers(self, req: gie.ProcessingRequest) -> Responses:
        cfg = req.protocol_config
        self.duplex_request = cfg.request_body_mode == DUPLEX
        self.buffered_request = cfg.request_body_mode == BUFFERED
        self.partial_request = cfg.request_body_mode == PARTIAL
        self.duplex_response = cfg.response_body_mode == DUPLEX
        self.reads_response = cfg.response_body_mode != NO_BODY
        self.subset = gie.subset_of(req)
        headers = gie.headers_of(req.request_headers, _REQUEST_HEADERS)
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/").split("?", 1)[0]
        self.rid = headers.get("x-request-id", "")
        self.logged = headers.get(ACCESS_LOG_MARK) == "1"
        if method == "GET" and path == "/v1/models":
            return [gie.immediate(200, _encode(self.svc.models_doc()))]
        self.path = path
        self.kind = self.svc.route_path(path) if method == "POST" else None
        if req.request_headers.end_of_stream:  # no body: any healthy worker, by load
            return await self._decide(RoutingInput.bodyless(), "request_headers")
        if cfg.request_body_mode in UNSUPPORTED_BODY_MODES and req.HasField("protocol_config"):
            self.decided = True  # answered: any chunk that still comes goes through
            return [_error(_unsupported_mode(cfg.request_body_mode))]
        return [] if self.duplex_request else [gie.passthrough("request_headers")]

    async def _request_body(self, msg: Any) -> Responses:
        if self.decided:  # the body of a request decided on its headers
            if self.duplex_request:
                return [gie.streamed_body(msg.body, end=msg.end_of_stream)]
            return [gie.passthrough("request_body")]
        self.got_body = True
        self.body.append(msg.body)
        self.body_bytes += len(msg.body)
        if self.body_bytes > self.max_body_bytes:
            self.body, self.decided = [], True  # answered: later chunks are dropped
            limit = PayloadTooLarge(f"request body over {self.max_body_bytes} bytes")
            return [_error(limit)]
        if msg.end_of_stream or self.buffered_request:
            return await self._decide_on_body(trailers=False)
        if self.partial_request:
            # not the stream's end: trailers follow a whole body, or the gateway cut it at
            # its buffer (then the prompt is not all here, nor is the JSON whole)
            if _whole_json(b"".join(self.body)):
                return await self._decide_on_body(trailers=False)
            self.body, self.decided = [], True
            return [_error(_cut_body(self.body_bytes))]
        return []  # FULL_DUPLEX_STREAMED: more chunks, or the trailers, follow

    async def _request_trailers(self) -> Responses:
        if self.decided or not self.duplex_request:
            return [gie.passthrough("request_trailers")]
        return await self._decide_on_body(trailers=True)

    async def _decide_on_body(self, *, trailers: bool) -> Responses:
        body = b"".join(self.body)
        self.body = []
        try:
            rin = parse_request(self.kind, self.path, body)
        except KvrouteError as exc:
            return [_error(exc)]
        phase = "request_headers" if self.duplex_request else "request_body"
        return await self._decide(rin, phase, body, trailers=trailers)

    async def _decide(
        self, rin: RoutingInput, phase: str, body: bytes = b"", *, trailers: bool = False
    ) -> Responses:
        try:
            endpoints, headers = await self._pick(rin)
        except KvrouteError as exc:
            return [_error(exc)]
        self.decided = True
        if trailers:
            return [gie.decision_with_body(endpoints, body, headers=headers)]
        out = [gie.decision(endpoints, phase=phase, headers=headers)]
        if self.duplex_request and phase == "request_headers" and self.got_body:
            out += gie.streamed_chunks(body)
        return out

    async def _pick(self, rin: RoutingInput) -> tuple[list[str], tuple[tuple[str, str], ...]]:
        """The fallback list and the headers that go with it."""
        decision = await self.svc.decide(rin, constraints=Constraints(subset=self.subset))
        if not decision.ranked:
            raise NoWorkerAvailable("no eligible worker for this request")
        self.worker = self.picked = first = decision.ranked[0].worker
        self.ticket = self.svc.start(decision, first)
        # a non-empty id is told live here, and forgotten or concluded when this ends
        self.listening = self.endings.expect(self.rid)
        # A data-parallel rank is asked for by a header, and the same header reaches
        # whichever fallback serves: the fallbacks are the endpoints it is right for (the
        # same rank, or none), one per address (ranks of one worker share its address).
        rank = self.svc.rank_of(first)
        for s in decision.ranked:
            if len(self.sent) == MAX_FALLBACKS:
                break
            if s.worker == first or self.svc.rank_of(s.worker) == rank:
                self.sent.setdefault(self.svc.address_of(s.worker), s.worker)
        eligible = list(self.sent)
        attempts = [eligible[i % len(eligible)] for i in range(MAX_FALLBACKS)]
        return attempts, (() if rank is None else ((RANK, str(rank)),))

    # ---- response: load accounting only ---------------------------------------------------

    def _response_headers(self, req: gie.ProcessingRequest) -> Responses:
        self._safely(self._note_response, req)
        if self.picked is None:
            return [gie.passthrough("response_headers")]
        return [gie.with_headers("response_headers", ((WORKER_HEADER, self.picked),))]

    def _note_response(self, req: gie.ProcessingRequest) -> None:
        headers = gie.headers_of(req.response_headers, _RESPONSE_HEADERS)
        self.status = int(headers.get(":status", "0") or 0)
        self.streaming = headers.get("content-type", "").startswith("text/event-stream")
        served = gie.served_of(req)
        # the endpoint sent to that address (the rank header asked for it); an address the
        # picker did not send (the gateway ignored the pick) maps to any endpoint there
        worker = (self.sent.get(served) or self.svc.worker_at(served)) if served else None
        if self.ticket is not None and worker is not None and worker != self.worker:
            self.ticket = self.svc.reassign(self.ticket, worker)
            self.worker = worker
        if served in self.sent:
            self._probe_passed_over(served)
        if req.response_headers.end_of_stream:
            self._finish(None)
        elif not self.reads_response and self.ticket is not None:
            # no body will come: the headers are the first sign of output; the end is
            # the stream's close (Envoy holds the stream until the response is done)
            self.first = False
            self.svc.first_token(self.ticket)

    def _probe_passed_over(self, served: str) -> None:
        """The gateway moved down the fallback list: the addresses before the one that
        served failed to connect, refused the stream or reset it (the route's retry_on), or
        are not in its cluster yet (override_host passes over those without a try). Each is
        probed, and out of rotation if it cannot be reached either: left in, a dead worker
        holds no load and takes no cache, so it would rank first for every new prefix until
        its health checks fail."""
        for address, endpoint in self.sent.items():
            if address == served:
                return
            self.svc.passed_over(endpoint, f"the gateway went past {address}")

    def _response_body(self, msg: Any) -> Responses:
        if self.ticket is not None:
            self._safely(self._account, msg.body, msg.end_of_stream)
        if self.duplex_response:
            return [gie.streamed_body(msg.body, end=msg.end_of_stream, phase="response_body")]
        return [gie.passthrough("response_body")]

    def _safely(self, note: Callable[..., None], *args: Any) -> None:
        """Bookkeeping of a response a worker served: a failure is logged, never let to fail
        the stream (Envoy would answer the client an error in the response's place). A
        ticket it left open is concluded when the stream closes."""
        try:
            note(*args)
        except Exception:
            log.exception("ext_proc: accounting for request %s failed", self.rid or "(no id)")

    def _account(self, chunk: bytes, end: bool) -> None:
        if self.first and chunk:
            self.first = False
            self.svc.first_token(self.ticket)
        if self.streaming:
            self.sniffer.feed(chunk)
        elif self.kept_bytes + len(chunk) <= MAX_KEPT_RESPONSE:
            self.kept.append(chunk)
            self.kept_bytes += len(chunk)
        if end:
            cached = (
                self.sniffer.cached_tokens
                if self.streaming
                else cached_tokens_of(b"".join(self.kept))
            )
            self._finish(cached)

    def _finish(self, cached_tokens: int | None) -> None:
        if self.ticket is None:
            return
        ticket, self.ticket = self.ticket, None
        if self.rid:
            self.endings.ended_in_band(self.rid)
        self.svc.finish(ticket, status=self.status, cached_tokens=cached_tokens)

    def close(self) -> None:
        """The stream ended with a ticket open: Envoy closes it the same way whether the
        response completed (response bodies skipped), the client hung up or the worker broke
        off, so Envoy's access log says which (`endings`)."""
        if self.ticket is None:
            return
        if self.listening:
            self.endings.when_known(self.rid, self._ended, logged=self.logged)
            return
        if self.rid:
            self.endings.forget(self.rid)
        self._ended(None)

    def _ended(self, ending: str | None) -> None:
        if self.ticket is None:
            return
        if ending is None:
            # No access log (or no verdict): the safer guess. Bodies skipped, the close is
            # the only end Envoy shows, and most responses complete: their headers' status.
            # Otherwise a hang-up: a guess must never count against a worker.
            done = not self.reads_response and self.status > 0
            ending = ends.COMPLETED if done else ends.CLIENT_GONE
        ticket, self.ticket = self.ticket, None
        if ending == ends.UPSTREAM_BROKE:
            # as the proxy counts a response its worker cut short (forward.py: 502)
            cached = self.sniffer.cached_tokens if self.streaming else None
            self.svc.finish(ticket, status=502, cached_tokens=cached)
        elif ending == ends.COMPLETED and self.status:
            self.svc.finish(ticket, status=self.status)
        else:
            self.svc.finish(ticket, status=0, outcome=ends.CLIENT_GONE)


def _unsupported_mode(mode: int) -> ConfigError:
    name = UNSUPPORTED_BODY_MODES[mode]
    said = (
        "the gateway sends the endpoint picker no request body (request_body_mode NONE), so "
        "no prompt to route on"
        if mode == NO_BODY
        else f"the gateway sends request bodies to the endpoint picker {name}, which it cannot "
        "route on"
    )
    err = ConfigError(
        said + ": set the ext_proc filter's processing_mode.request_body_mode to BUFFERED "
        "or FULL_DUPLEX_STREAMED (kvroute envoy-config writes BUFFERED)",
        param="request_body_mode",
    )
    return _said_once(mode, err)


def _whole_json(body: bytes) -> bool:
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return True


def _cut_body(got: int) -> ConfigError:
    err = ConfigError(
        f"the gateway sent the endpoint picker the first {got} bytes of a request body "
        "(request_body_mode BUFFERED_PARTIAL cuts a body at its buffer limit), which it "
        "cannot route on: set request_body_mode to BUFFERED, or raise the listener's "
        "per_connection_buffer_limit_bytes above the largest request body",
        param="request_body_mode",
    )
    return _said_once(PARTIAL, err)


def _said_once(mode: int, err: ConfigError) -> ConfigError:
    """The gateway's setting is wrong for every request alike: logged once a process."""
    if mode not in _told_modes:
        _told_modes.add(mode)
        log.error("ext_proc: %s", err.message)
    return err


def _error(exc: KvrouteError) -> gie.ProcessingResponse:
    log.debug("immediate %d: %s", exc.status, exc.message)
    return gie.immediate(
        exc.status, _encode(exc.body()), details=type(exc).__name__, headers=exc.headers()
    )
