"""Apps pass one trace id to several sequential LLM calls, and Envoy keeps a client's
x-request-id by default: a call that ended in band must not lend its late access-log entry
to the next call with its id. The picker on real gRPC (ext_proc and access log on one
port), Envoy's messages written by hand, the stand-in decision service recording each
accounting call."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import extproc_standin
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from gateway_harness import until

extproc_standin.install()

from router.envoy.bootstrap import ACCESS_LOG_MARK  # noqa: E402
from router.extproc.server import ExtProcServer  # noqa: E402

pytestmark = pytest.mark.timeout(30)

ENDPOINTS = ["127.0.0.1:18001"]
RID = "trace-42"


def _headers(pairs: dict[str, str], end: bool) -> pb.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)


REQUEST = pb.ProcessingRequest(
    request_headers=_headers(
        {":method": "POST", ":path": "/v1/completions", "x-request-id": RID, ACCESS_LOG_MARK: "1"},
        end=True,
    )
)
RESPONSE = pb.ProcessingRequest(response_headers=_headers({":status": "200"}, end=False))
BODY_END = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))


def log_entry(details: str, **flags: bool) -> als_pb2.StreamAccessLogsMessage:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = RID
    entry.response.response_code_details = details
    for name, value in flags.items():
        setattr(entry.common_properties.response_flags, name, value)
    logs = als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[entry])
    return als_pb2.StreamAccessLogsMessage(http_logs=logs)


@contextlib.asynccontextmanager
async def picker() -> AsyncIterator[tuple[ExtProcServer, Any, grpc.aio.Channel]]:
    svc = extproc_standin.DecisionService(list(ENDPOINTS))
    server = ExtProcServer(svc, "127.0.0.1", 0)  # type: ignore[arg-type]  # the stand-in
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield server, svc, ch
    finally:
        await server.stop(0)


async def exchange(ch: grpc.aio.Channel, *messages: pb.ProcessingRequest) -> None:
    """One request's stream: each message answered, then closed as Envoy closes it."""
    call = pb_grpc.ExternalProcessorStub(ch).Process()
    for m in messages:
        await call.write(m)
        await call.read()
    await call.done_writing()
    await call.read()  # the end of the stream


def waiting(server: ExtProcServer) -> bool:
    """The closed stream waits for its verdict."""
    slot = server.endings._slots.get(RID)
    return slot is not None and slot.waiter is not None


async def test_a_late_entry_of_a_call_that_ended_in_band_does_not_settle_the_next() -> None:
    async with picker() as (server, svc, ch):
        log = als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs()
        await log.write(log_entry("via_upstream"))  # an earlier request's: the log is open
        await until(lambda: server.endings.streamed)
        await exchange(ch, REQUEST, RESPONSE, BODY_END)  # call 1 ends in band
        # call 2, same id: its worker breaks off mid-response, and Envoy closes the stream
        await exchange(ch, REQUEST, RESPONSE)
        await until(lambda: waiting(server))
        await log.write(log_entry("via_upstream"))  # call 1's entry, late
        await log.write(log_entry("upstream_reset_after_response_started{remote_reset}"))
        await until(lambda: svc.inflight() == 0)
        await log.done_writing()
        await log
    first, second = svc.tickets
    assert first.events[-1] == ("finish", (200, None))
    assert second.events[-1] == ("finish", (502, None)), second.events
