"""A gateway's fallback may serve a request on an endpoint that joined the fleet after the
picker decided it (a scale-up while the request waited). The worker's answer must reach the
client and be counted where it was served: kvroute's own DecisionService over simulated
workers, the picker on real gRPC, Envoy's messages written by hand."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from gateway_harness import FAST, address, real_service, until
from prometheus_client.parser import text_string_to_metric_families

from router.extproc.gie import SERVED_KEY
from router.extproc.server import ExtProcServer
from router.procs import FleetProcess

pytestmark = pytest.mark.timeout(60)

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
BODY = {"model": "kvroute-sim", "prompt": "a prompt decided before the scale-up"}
USAGE = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)


def request_headers() -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/completions", "x-request-id": "late-1"}
    req = pb.ProcessingRequest(request_headers=_headers(pairs))
    req.protocol_config.request_body_mode = BUFFERED
    return req


def request_body(doc: dict[str, Any]) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=json.dumps(doc).encode(), end_of_stream=True)
    return pb.ProcessingRequest(request_body=body)


def response_headers(served: str) -> pb.ProcessingRequest:
    pairs = {":status": "200", "content-type": "application/json", SERVED_KEY: served}
    return pb.ProcessingRequest(response_headers=_headers(pairs))


def response_body(doc: dict[str, Any]) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=json.dumps(doc).encode(), end_of_stream=True)
    return pb.ProcessingRequest(response_body=body)


def counted(svc: Any) -> dict[str, float]:
    """kvroute_requests_total by worker."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(svc.metrics.render().decode()):
        for s in family.samples:
            if s.name == "kvroute_requests_total":
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out


@contextlib.asynccontextmanager
async def stream(port: int) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield pb_grpc.ExternalProcessorStub(ch).Process()


async def test_an_endpoint_that_joined_after_the_decision_is_counted_where_it_served() -> None:
    with FleetProcess(3, extra=FAST) as fleet:
        urls = list(fleet.urls)
        late = address(urls[2])
        async with real_service([address(u) for u in urls[:2]]) as svc:
            server = ExtProcServer(svc, "127.0.0.1", 0)
            await server.start()
            try:
                async with stream(server.port) as call:
                    await call.write(request_headers())
                    await call.read()
                    await call.write(request_body(BODY))
                    decided = await call.read()
                    assert decided.HasField("request_body")
                    # a scale-up while the request waits: the new pod serves it
                    async with httpx.AsyncClient(base_url=svc.proxy_url) as admin:
                        resp = await admin.post("/admin/workers", json={"workers": urls})
                        assert resp.status_code == 200, resp.text
                    await until(lambda: svc.worker_at(late) is not None)
                    await call.write(response_headers(late))
                    answered = await call.read()
                    assert answered.HasField("response_headers"), answered
                    await call.write(response_body(USAGE))
                    assert (await call.read()).HasField("response_body")
                    await call.done_writing()
            finally:
                await server.stop(0)
            worker = svc.worker_at(late)
            assert counted(svc).get(worker) == 1.0, counted(svc)
            assert all(svc.fleet.load.known(w).requests == 0 for w in svc.fleet.workers)
