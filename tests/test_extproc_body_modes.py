"""A gateway that sends request bodies STREAMED waits for an answer to each chunk, and
chooses the route before the body is whole: the picker refuses such a request at its
headers with an error naming the fix, logged once, instead of leaving its chunks to Envoy's
message_timeout. BUFFERED_PARTIAL sends a body within the gateway's buffer whole, as
BUFFERED does: it is decided on; one cut at the buffer is refused, naming the limit. The
picker on real gRPC, Envoy's messages written by hand, the stand-in decision service (real
Envoy in BUFFERED_PARTIAL: tests/test_extproc_envoy.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import extproc_standin
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

extproc_standin.install()

from router.extproc import exchange  # noqa: E402
from router.extproc.server import ExtProcServer  # noqa: E402

pytestmark = pytest.mark.timeout(30)

MODE = processing_mode_pb2.ProcessingMode
ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002"]


def request_headers(mode: int, method: str, path: str, end: bool) -> pb.ProcessingRequest:
    pairs = {":method": method, ":path": path, "x-request-id": "r1"}
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)
    req = pb.ProcessingRequest(request_headers=headers)
    req.protocol_config.request_body_mode = mode
    return req


@pytest.fixture
async def channel(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[grpc.aio.Channel]:
    monkeypatch.setattr(exchange, "_told_modes", set())
    svc = extproc_standin.DecisionService(list(ENDPOINTS))
    server = ExtProcServer(svc, "127.0.0.1", 0)  # type: ignore[arg-type]  # the stand-in
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield ch
    finally:
        await server.stop(0)


async def first_answer(ch: grpc.aio.Channel, req: pb.ProcessingRequest) -> Any:
    call = pb_grpc.ExternalProcessorStub(ch).Process()
    await call.write(req)
    answer = await call.read()
    call.cancel()
    return answer


async def test_a_streamed_body_is_refused_naming_the_fix(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "kvroute.extproc")
    for _ in range(3):
        answer = await first_answer(
            channel, request_headers(MODE.STREAMED, "POST", "/v1/completions", end=False)
        )
        assert answer.HasField("immediate_response"), answer
        refused = answer.immediate_response
        error = json.loads(refused.body)["error"]
        assert refused.status.code == 500 and error["param"] == "request_body_mode"
        assert "BUFFERED or FULL_DUPLEX_STREAMED" in error["message"], error
    said = [r.getMessage() for r in caplog.records if "request_body_mode" in r.getMessage()]
    assert len(said) == 1, said  # once a process


async def test_a_request_without_a_body_is_decided_in_any_mode(channel: grpc.aio.Channel) -> None:
    answer = await first_answer(channel, request_headers(MODE.STREAMED, "GET", "/metrics", True))
    assert answer.HasField("request_headers"), answer
    mutation = answer.request_headers.response.header_mutation
    assert mutation.set_headers[0].header.raw_value.decode().split(",")[0] in ENDPOINTS


def body(data: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


async def answers(ch: grpc.aio.Channel, *reqs: pb.ProcessingRequest) -> list[Any]:
    call = pb_grpc.ExternalProcessorStub(ch).Process()
    out = []
    for req in reqs:
        await call.write(req)
        out.append(await call.read())
    call.cancel()
    return out


@pytest.mark.parametrize("trailers", [False, True], ids=["ends-the-stream", "trailers-follow"])
async def test_a_partial_mode_body_within_the_buffer_is_decided_on(
    channel: grpc.aio.Channel, trailers: bool
) -> None:
    doc = json.dumps({"model": "kvroute-sim", "prompt": "hello " * 50}).encode()
    head, decided = await answers(
        channel,
        request_headers(MODE.BUFFERED_PARTIAL, "POST", "/v1/completions", end=False),
        body(doc, end=not trailers),  # with trailers to come the body does not end it
    )
    assert head.HasField("request_headers"), head  # the route waits for the body
    assert decided.HasField("request_body"), decided
    mutation = decided.request_body.response.header_mutation
    picked = {m.header.key: m.header.raw_value.decode() for m in mutation.set_headers}
    assert picked["x-gateway-destination-endpoint"].split(",")[0] in ENDPOINTS


async def test_a_partial_mode_body_cut_at_the_buffer_is_refused_naming_the_limit(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "kvroute.extproc")
    for _ in range(2):
        _, refused = await answers(
            channel,
            request_headers(MODE.BUFFERED_PARTIAL, "POST", "/v1/completions", end=False),
            body(b'{"model": "m", "prompt": "cut here', end=False),
        )
        assert refused.HasField("immediate_response"), refused
        error = json.loads(refused.immediate_response.body)["error"]
        assert error["param"] == "request_body_mode"
        assert "per_connection_buffer_limit_bytes" in error["message"], error
    said = [r.getMessage() for r in caplog.records if "BUFFERED_PARTIAL" in r.getMessage()]
    assert len(said) == 1, said
