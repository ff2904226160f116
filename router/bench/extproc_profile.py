"""Where a picker's time goes, per request, in microseconds (medians): protobuf decoding and
encoding of the ext_proc messages, parsing the OpenAI body, and one gRPC message round trip
on loopback (grpc.aio, client and server in this process). The decision itself is the
decision service's (its own benchmark); a request costs about 4 gRPC round trips in BUFFERED
mode with response bodies read, 3 with `--response-body skip`."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from conformance.extproc import wire
from router.bench.extproc_lua import MODEL, shared_prefix
from router.bench.extproc_ref import RandomPicker
from router.extproc import gie
from router.openai_req import parse


def _us(fn: Callable[[], Any], n: int = 2000) -> float:
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n * 1e6)
    return round(statistics.median(samples), 2)


def cpu_costs() -> dict[str, float]:
    body = wire.completion_body(MODEL, shared_prefix() + " tail 1")
    headers = wire.request_headers("POST", "/v1/completions").SerializeToString()
    body_msg = wire.request_body(body).SerializeToString()
    answer = gie.decision(["10.0.0.5:8000", "10.0.0.6:8000"], phase="request_body")
    return {
        "body_bytes": float(len(body)),
        "decode_request_headers_us": _us(lambda: pb.ProcessingRequest.FromString(headers)),
        "decode_request_body_us": _us(lambda: pb.ProcessingRequest.FromString(body_msg)),
        "build_decision_us": _us(
            lambda: gie.decision(["10.0.0.5:8000", "10.0.0.6:8000"], phase="request_body")
        ),
        "encode_decision_us": _us(answer.SerializeToString),
        "parse_openai_body_us": _us(lambda: parse("completion", body), n=500),
    }


async def _round_trip_us(n: int = 2000) -> float:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(RandomPicker(["127.0.0.1:1"]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = wire.Stream(channel, 10)
            msg = wire.response_headers(200, None)
            for _ in range(50):
                await stream.ask(msg)
            t = time.perf_counter()
            for _ in range(n):
                await stream.ask(msg)
            elapsed = time.perf_counter() - t
            await stream.close()
    finally:
        await server.stop(0)
    return round(elapsed / n * 1e6, 1)


def profile() -> dict[str, float]:
    costs = cpu_costs()
    costs["grpc_message_round_trip_us"] = asyncio.run(_round_trip_us())
    return costs
