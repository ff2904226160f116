"""What a client gets behind a real Envoy 1.40 when the gateway, not a worker or the picker,
has to answer: OpenAI-shaped JSON an SDK can read, and never a worker the picker ruled out."""

from __future__ import annotations

import asyncio

import pytest
from gateway_harness import gateway, slow_health_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
SERVED = "x-gateway-destination-endpoint-served"


def json_error(resp: object, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text[:300]  # type: ignore[attr-defined]
    assert resp.headers["content-type"] == "application/json"  # type: ignore[attr-defined]
    err = resp.json()["error"]  # type: ignore[attr-defined]
    assert err["type"] == kind and err["code"] == status
    return str(err["message"])


async def test_retries_never_reach_a_worker_of_another_model() -> None:
    """model-a's only worker dies between two health checks: the gateway's retries run out
    on the endpoints the picker listed (a 503), and never go round robin to model-b's
    worker (which answered a 404 'model does not exist' and was charged with it)."""
    models = (("--model", "model-a"), ("--model", "model-b"))
    async with gateway(workers=1, engine_args=models, make_service=slow_health_service) as gw:
        _, b = gw.addresses
        body = {"model": "model-a", "prompt": "hi", "max_tokens": 2}
        assert (await gw.client.post("/v1/completions", json=body)).status_code == 200
        gw.fleets[0].stop()
        await asyncio.sleep(0.3)
        for i in range(3):
            body = {"model": "model-a", "prompt": f"hi {i}", "max_tokens": 2}
            resp = await gw.client.post("/v1/completions", json=body)
            assert "no worker could take the request" in json_error(
                resp, 503, "service_unavailable"
            )
            assert resp.headers.get(SERVED) != b
        counted = {
            s.labels["worker"]
            for m in gw.svc.metrics.requests.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        assert b not in counted


async def test_the_gateways_own_errors_are_openai_json() -> None:
    async with gateway(failure_mode="close", workers=1, make_service=slow_health_service) as gw:
        assert (await gw.complete("hi")).status_code == 200
        gw.fleets[0].stop()  # the only worker dies; the picker has not noticed yet
        await asyncio.sleep(0.3)
        json_error(await gw.complete("hi again"), 503, "service_unavailable")
        await gw.kill_picker()
        msg = json_error(await gw.complete("hi"), 503, "service_unavailable")
        assert "endpoint picker could not be reached" in msg


async def test_a_decision_past_the_message_timeout_is_a_json_504() -> None:
    async with gateway(failure_mode="close", message_timeout_s=1.0) as gw:
        svc = gw.svc
        decide = svc.decide

        async def slow(*args: object, **kwargs: object) -> object:
            d = await decide(*args, **kwargs)
            await asyncio.sleep(1.5)  # remote /tokenize on a busy worker, say
            return d

        svc.decide = slow
        msg = json_error(await gw.complete("slow decision"), 504, "timeout_error")
        assert "message_timeout" in msg
