"""The gateway's side of ext_proc, played by a test client: build the ProcessingRequests
Envoy would send and read the picker's answers. Self-contained (Envoy's protos and grpcio
only) so that the kit drives any picker, not just kvroute's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

DEST = "x-gateway-destination-endpoint"
LB = "envoy.lb"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
Mode = processing_mode_pb2.ProcessingMode
BUFFERED = Mode.BUFFERED
DUPLEX = Mode.FULL_DUPLEX_STREAMED
STREAMED = Mode.STREAMED


def _config(body_mode: int) -> pb.ProtocolConfiguration:
    response = DUPLEX if body_mode == DUPLEX else STREAMED
    return pb.ProtocolConfiguration(request_body_mode=body_mode, response_body_mode=response)


def request_headers(
    method: str,
    path: str,
    *,
    body_mode: int = BUFFERED,
    end_of_stream: bool = False,
    extra: Iterable[tuple[str, str]] = (),
    subset: list[str] | None = None,
) -> pb.ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gateway"), (":scheme", "http")]
    if not end_of_stream:
        pairs.append(("content-type", "application/json"))
    hdrs = pb.HttpHeaders(headers=_header_map([*pairs, *extra]), end_of_stream=end_of_stream)
    req = pb.ProcessingRequest(request_headers=hdrs, protocol_config=_config(body_mode))
    if subset is not None:
        ns = req.metadata_context.filter_metadata[SUBSET_NS]
        values = ns.fields[SUBSET_KEY].list_value
        values.SetInParent()  # an empty list is a hint too: nothing is eligible
        for ep in subset:
            values.values.add().string_value = ep
    return req


def _header_map(pairs: Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    # Envoy sends raw_value (bytes) by default; so does the kit.
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def request_body(body: bytes, *, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end))


def response_headers(
    status: int, served: str | None, content_type: str = "application/json"
) -> pb.ProcessingRequest:
    hdrs = pb.HttpHeaders(
        headers=_header_map([(":status", str(status)), ("content-type", content_type)])
    )
    req = pb.ProcessingRequest(response_headers=hdrs)
    if served is not None:
        req.metadata_context.filter_metadata[LB].fields[SERVED_KEY].string_value = served
    return req


def response_body(body: bytes, *, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end))


def chat_body(model: str, text: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


def completion_body(model: str, prompt: str, **extra: Any) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, **extra}).encode()


@dataclass
class Answer:
    """What the picker said to one message, decoded."""

    kind: str  # the ProcessingResponse oneof: request_headers, request_body, immediate_response
    msg: pb.ProcessingResponse
    header: str | None = None  # x-gateway-destination-endpoint set by a header mutation
    metadata: str | None = None  # envoy.lb / x-gateway-destination-endpoint
    clear_route_cache: bool = False
    status: int | None = None  # immediate response
    body: bytes = b""  # immediate body, or the streamed body bytes of this answer
    end_of_stream: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def endpoints(self) -> list[str]:
        value = self.header or self.metadata or ""
        return [p.strip() for p in value.split(",") if p.strip()]

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def decode(msg: pb.ProcessingResponse) -> Answer:
    kind = msg.WhichOneof("response") or ""
    ans = Answer(kind, msg)
    ns = msg.dynamic_metadata.fields.get(LB)
    if ns is not None and DEST in ns.struct_value.fields:
        ans.metadata = ns.struct_value.fields[DEST].string_value
    if kind == "immediate_response":
        ans.status = msg.immediate_response.status.code
        ans.body = msg.immediate_response.body
        return ans
    common = getattr(msg, kind).response if kind else pb.CommonResponse()
    ans.clear_route_cache = common.clear_route_cache
    for opt in common.header_mutation.set_headers:
        value = opt.header.value or opt.header.raw_value.decode("latin-1")
        if opt.header.key.lower() == DEST:
            ans.header = value
        else:
            ans.extra[opt.header.key.lower()] = value
    streamed = common.body_mutation.streamed_response
    ans.body, ans.end_of_stream = streamed.body, streamed.end_of_stream
    return ans


class Stream:
    """One ext_proc stream: write a message, read the answers it causes, bounded in time."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()
        self.timeout_s = timeout_s

    async def send(self, req: pb.ProcessingRequest) -> None:
        await asyncio.wait_for(self.call.write(req), self.timeout_s)

    async def read(self) -> Answer:
        msg = await asyncio.wait_for(self.call.read(), self.timeout_s)
        if msg is grpc.aio.EOF:
            raise EOFError("the picker closed the stream")
        return decode(msg)

    async def ask(self, req: pb.ProcessingRequest) -> Answer:
        await self.send(req)
        return await self.read()

    async def read_body(self) -> tuple[bytes, bool]:
        """FULL_DUPLEX_STREAMED: read streamed request-body answers up to end_of_stream."""
        parts = []
        while True:
            ans = await self.read()
            if ans.kind != "request_body":
                raise AssertionError(f"expected a streamed request_body answer, got {ans.kind}")
            parts.append(ans.body)
            if ans.end_of_stream:
                return b"".join(parts), True

    async def close(self) -> None:
        self.call.cancel()
