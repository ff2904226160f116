"""Load generator for the gateway tests, run as its own process so that the picker under test
(in the test's event loop) does not share a CPU-bound loop with 600 HTTP clients.

    python tests/gateway_load.py URL N MODEL  ->  JSON lines {status, picked, served, fp}
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx


async def main(url: str, n: int, model: str) -> None:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=200, limits=limits) as client:

        async def one(i: int) -> dict[str, object]:
            body = {"model": model, "prompt": f"c{i} " * 8, "max_tokens": 2}
            r = await client.post("/v1/completions", json=body)
            fp = r.json().get("system_fingerprint") if r.status_code == 200 else None
            return {
                "status": r.status_code,
                "picked": r.headers.get("x-kvroute-worker"),
                "served": r.headers.get("x-gateway-destination-endpoint-served"),
                "fp": fp,
            }

        for row in await asyncio.gather(*(one(i) for i in range(n))):
            print(json.dumps(row))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
