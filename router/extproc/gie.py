"""The Gateway API Inference Extension endpoint-picker protocol (GIE proposal 004) on top of
Envoy's ext_proc messages: the names on the wire, reading what the gateway sends (headers,
subset hint, served endpoint) and building what the picker answers (the decision, an
immediate response). Shared by kvroute's picker, the bench's reference picker and the
conformance kit, so that all three speak exactly the same bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

DEST_HEADER = "x-gateway-destination-endpoint"
DEST_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# What a client must never send: the gateway strips these before ext_proc sees the request.
ROUTING_HEADERS = (DEST_HEADER, SUBSET_KEY, SERVED_KEY)
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# Envoy caps one body message at 64 KiB in streamed modes; stay under it with a margin.
BODY_CHUNK = 62_000

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


def headers_of(msg: pb.HttpHeaders, wanted: frozenset[str] | None = None) -> dict[str, str]:
    """Lower-case name -> value, of every header or only the `wanted` ones (cheaper: field
    access on protobuf messages is what a picker spends its time on). Envoy sends raw_value
    bytes unless told otherwise."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        key = h.key
        if wanted is None or key in wanted:
            raw = h.raw_value
            out[key] = raw.decode("latin-1") if raw else h.value
    return out


def subset_of(req: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset hint: None when absent, possibly empty when present."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    return frozenset(_endpoints(ns.fields[SUBSET_KEY]))


def served_of(req: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy reports as having served the request (response side)."""
    ns = req.metadata_context.filter_metadata.get(DEST_NAMESPACE)
    if ns is not None and SERVED_KEY in ns.fields:
        found = _endpoints(ns.fields[SERVED_KEY])
        if found:
            return found[0]
    if req.HasField("response_headers"):
        value = headers_of(req.response_headers, _SERVED_ONLY).get(SERVED_KEY)
        if value:
            return value.split(",")[0].strip()
    return None


_SERVED_ONLY = frozenset({SERVED_KEY})


def _endpoints(value: struct_pb2.Value) -> list[str]:
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.string_value]
    return [p.strip() for p in value.string_value.split(",") if p.strip()]


def decision(
    endpoints: Iterable[str], *, phase: str, headers: tuple[tuple[str, str], ...] = ()
) -> pb.ProcessingResponse:
    """The pick in the GIE shape: the header and the envoy.lb metadata carry the same ordered
    fallback list, and the route cache is cleared so that routing sees them. `phase` is the
    ProcessingResponse field answered: request_headers or request_body; `headers` are more
    request headers to set (the upstream receives them, whichever fallback serves). Messages
    are never mutated once built, so the same answer is shared (a fleet has few distinct
    lists)."""
    value = ",".join(endpoints)
    return _shared(("decision", phase, (value, headers)), lambda: _decision(value, phase, headers))


def with_headers(phase: str, pairs: tuple[tuple[str, str], ...]) -> pb.ProcessingResponse:
    """Continue, setting these headers (shared like `decision`)."""
    return _shared(("headers", phase, pairs), lambda: _with_headers(phase, pairs))


_SHARED: dict[tuple[str, str, Any], pb.ProcessingResponse] = {}
_SHARED_MAX = 4096


def _shared(
    key: tuple[str, str, Any], build: Callable[[], pb.ProcessingResponse]
) -> pb.ProcessingResponse:
    found = _SHARED.get(key)
    if found is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()  # a churning fleet: start over rather than grow
        found = _SHARED[key] = build()
    return found


def decision_with_body(
    endpoints: Iterable[str], body: bytes, *, headers: tuple[tuple[str, str], ...] = ()
) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED, for a body that trailers ended: the decision as the headers
    answer, carrying the whole body (CONTINUE_AND_REPLACE). It ends the request's processing:
    no body or trailers answer follows. (Envoy 1.40 forwards a body streamed back before the
    trailers answer twice.)"""
    resp = _decision(",".join(endpoints), "request_headers", headers)
    common = resp.request_headers.response
    common.status = pb.CommonResponse.CONTINUE_AND_REPLACE
    common.body_mutation.body = body
    return resp


def _decision(
    value: str, phase: str, headers: tuple[tuple[str, str], ...]
) -> pb.ProcessingResponse:
    common = pb.CommonResponse(clear_route_cache=True)
    _set_headers(common.header_mutation, [(DEST_HEADER, value), *headers])
    resp = pb.ProcessingResponse()
    getattr(resp, phase).response.CopyFrom(common)
    resp.dynamic_metadata.fields[DEST_NAMESPACE].struct_value.fields[
        DEST_HEADER
    ].string_value = value
    return resp


def _set_headers(mutation: pb.HeaderMutation, pairs: Iterable[tuple[str, str]]) -> None:
    for name, value in pairs:
        mutation.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )


def passthrough(phase: str) -> pb.ProcessingResponse:
    """Continue unchanged (`phase`: request_headers, response_headers, response_body, ...).
    One shared message per phase: it is never mutated, and building it costs per message."""
    resp = _PASSTHROUGH.get(phase)
    if resp is None:
        resp = _PASSTHROUGH[phase] = pb.ProcessingResponse()
        getattr(resp, phase).SetInParent()
    return resp


_PASSTHROUGH: dict[str, pb.ProcessingResponse] = {}


def _with_headers(phase: str, pairs: Iterable[tuple[str, str]]) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    _set_headers(getattr(resp, phase).response.header_mutation, pairs)
    return resp


def streamed_body(body: bytes, *, end: bool, phase: str = "request_body") -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the processor hands the body back itself, chunk by chunk."""
    resp = pb.ProcessingResponse()
    mutation = getattr(resp, phase).response.body_mutation
    mutation.streamed_response.body = body
    mutation.streamed_response.end_of_stream = end
    return resp


def streamed_chunks(body: bytes, phase: str = "request_body") -> list[pb.ProcessingResponse]:
    """A whole body as FULL_DUPLEX_STREAMED answers of at most BODY_CHUNK bytes each."""
    if not body:
        return [streamed_body(b"", end=True, phase=phase)]
    chunks = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)]
    return [streamed_body(c, end=i == len(chunks) - 1, phase=phase) for i, c in enumerate(chunks)]


def immediate(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    details: str = "",
    headers: Iterable[tuple[str, str]] = (),
) -> pb.ProcessingResponse:
    """Answer the client without an upstream (errors, GET /v1/models); `headers` are extra
    response headers (an error's Retry-After)."""
    resp = pb.ProcessingResponse()
    imm = resp.immediate_response
    imm.status.code = status  # envoy.type.v3.StatusCode values are the HTTP codes
    imm.body = body
    imm.details = details
    _set_headers(imm.headers, [("content-type", content_type), *headers])
    return resp
