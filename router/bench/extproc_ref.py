"""The benchmark's do-nothing reference picker: a plain grpc.aio ExternalProcessor that parses
the request body (json.loads) and picks an endpoint at random, speaking the same GIE protocol
(router.extproc.gie) as kvroute's picker. Whatever kvroute's picker costs above it is the
price of its real decision.

    python -m router.bench.extproc_ref --port P --endpoints IP:PORT,IP:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from router.extproc import gie

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class RandomPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints

    async def Process(
        self, requests: AsyncIterator[gie.ProcessingRequest], context: Any
    ) -> AsyncIterator[gie.ProcessingResponse]:
        duplex, duplex_out, body = False, False, b""
        async for req in requests:
            which = req.WhichOneof("request")
            if which == "request_headers":
                duplex = req.protocol_config.request_body_mode == DUPLEX
                duplex_out = req.protocol_config.response_body_mode == DUPLEX
                if req.request_headers.end_of_stream:
                    yield self._pick("request_headers")
                elif not duplex:
                    yield gie.passthrough("request_headers")
            elif which == "request_body":
                body += req.request_body.body
                if req.request_body.end_of_stream:
                    json.loads(body)  # the "decision" reads the body, nothing more
                    yield self._pick("request_headers" if duplex else "request_body")
                    if duplex:
                        for chunk in gie.streamed_chunks(body):
                            yield chunk
            elif which == "response_body" and duplex_out:
                b = req.response_body
                yield gie.streamed_body(b.body, end=b.end_of_stream, phase="response_body")
            elif which:
                yield gie.passthrough(which)

    def _pick(self, phase: str) -> gie.ProcessingResponse:
        return gie.decision([random.choice(self.endpoints)], phase=phase)


async def serve(port: int, endpoints: list[str]) -> None:
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(RandomPicker(endpoints), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--endpoints", required=True)
    args = p.parse_args()
    asyncio.run(serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
