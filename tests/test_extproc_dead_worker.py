"""A worker that dies between two health checks, behind a real Envoy 1.40: the gateway's
fallback serves its requests elsewhere, and the picker must hear of it. Left in rotation, a
dead worker holds no load and takes no cache, so it would rank first for every new prefix."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gateway_harness import gateway, slow_health_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
SERVED = "x-gateway-destination-endpoint-served"


async def test_a_worker_the_gateway_could_not_reach_is_ejected_at_once() -> None:
    async with gateway(workers=1, engine_args=((), ()), make_service=slow_health_service) as gw:
        a, b = gw.addresses
        gw.fleets[1].stop()  # b refuses connections from now on; no health check is due
        await asyncio.sleep(0.3)
        picked_b = 0
        for i in range(12):  # new prefixes: the scorers would rank an idle worker first
            resp = await gw.complete(f"new prefix {i} " * 40)
            assert resp.status_code == 200, resp.text[:300]
            assert resp.headers.get(SERVED) == a
            picked_b += resp.headers.get("x-kvroute-worker") == b
            await asyncio.sleep(0.05)  # the probe of a passed-over worker: a refused connect
        assert picked_b == 1  # the first request found it dead; none was sent there after
        assert gw.svc.fleet.workers[b].available is False
        handle = gw.svc.pool.handles[b]
        assert "the gateway went past" in handle.last_error


def leave_out_second_worker(doc: dict[str, Any]) -> None:
    """The gateway has not met the second worker yet (its resolve lags kvroute's)."""
    for cluster in doc["static_resources"]["clusters"]:
        if cluster["name"] == "kvroute_workers":
            del cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][1]


async def test_a_healthy_worker_the_gateway_has_not_met_stays_in_rotation() -> None:
    """override_host passes over an address outside the gateway's cluster without a try:
    that worker is not dead, and must not be ejected for it."""
    async with gateway(
        workers=2, make_service=slow_health_service, tweak=leave_out_second_worker
    ) as gw:
        a, b = gw.addresses
        passed_over = 0
        for i in range(8):
            resp = await gw.complete(f"new prefix {i} " * 40)
            assert resp.status_code == 200, resp.text[:300]
            assert resp.headers.get(SERVED) == a
            passed_over += resp.headers.get("x-kvroute-worker") == b
            await asyncio.sleep(0.05)
        assert passed_over >= 1  # the picker did list it first, and the gateway went past
        assert gw.svc.fleet.workers[b].available is True
        assert gw.svc.pool.handles[b].ejections == 0
