"""A gateway whose ext_proc filter is left at Envoy's default request_body_mode (NONE)
sends the picker no body: behind a real Envoy 1.40, every request with a body is refused
naming the setting, never routed blind (no decision, no load counted)."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_harness import gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def no_body_mode(doc: dict[str, Any]) -> None:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [
        f for f in hcm["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    ]
    ext_proc["typed_config"]["processing_mode"]["request_body_mode"] = "NONE"


async def test_a_gateway_sending_no_body_is_refused_naming_the_setting() -> None:
    async with gateway(tweak=no_body_mode) as gw:
        for i in range(3):
            resp = await gw.complete(f"prompt {i} " * 20)
            assert resp.status_code == 500, resp.text[:300]
            error = resp.json()["error"]
            assert error["param"] == "request_body_mode"
            assert "request_body_mode NONE" in error["message"] and "BUFFERED" in error["message"]
        assert not gw.svc.tickets and not gw.svc.decisions
        models = await gw.client.get("/v1/models")  # no body: decided at the headers
        assert models.status_code == 200
