"""A request body over the limit behind a real Envoy is an OpenAI-shaped JSON 413 in both body
modes: in buffered mode Envoy itself refuses it (its buffer limit), in full duplex the picker
does, and the client cannot tell which. The picker's own 413 keeps its own body."""

from __future__ import annotations

from typing import Any

import extproc_standin
import pytest
from gateway_harness import MODEL, gateway, standin_service

from router.core.errors import PayloadTooLarge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
LIMIT = 256 * 1024
SERVED = "x-gateway-destination-endpoint-served"


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_oversized_body_is_an_openai_json_413(mode: str) -> None:
    async with gateway(body_mode=mode, max_body_bytes=LIMIT) as gw:
        resp = await gw.complete("x " * 200_000)
        assert resp.status_code == 413
        assert resp.headers["content-type"] == "application/json"
        assert resp.json() == PayloadTooLarge(f"request body over {LIMIT} bytes").body()
        assert not gw.svc.tickets and SERVED not in resp.headers  # no worker saw it


class RefusesEverything(extproc_standin.DecisionService):
    async def decide(self, rin: Any, *, profile: str = "default", constraints: Any = None) -> Any:
        raise PayloadTooLarge("the picker's own limit")


def refuses_everything(addresses: list[str]) -> Any:
    return RefusesEverything(addresses, models=standin_service([]).models)


async def test_the_pickers_own_413_keeps_its_body() -> None:
    """An ext_proc immediate response is an Envoy local reply too: the mapper must not
    replace the picker's message with Envoy's buffer-limit one."""
    async with gateway(max_body_bytes=LIMIT, make_service=refuses_everything) as gw:
        resp = await gw.complete("short")
        assert resp.status_code == 413
        assert resp.json() == PayloadTooLarge("the picker's own limit").body()


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_a_body_over_grpcs_default_message_size_is_still_decided(mode: str) -> None:
    """gRPC caps a message at 4 MiB unless told otherwise; a buffered body is one message.
    A 5 MB request (a chat with an image inlined) is under the 32 MiB limit: decided and
    served, not a 500 (failing closed) or a pick Envoy made alone (failing open)."""
    async with gateway(body_mode=mode) as gw:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "user": "u" * 5_000_000}
        resp = await gw.client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text[:300]
        assert SERVED in resp.headers  # the picker's pick


def test_the_pickers_message_cap_fits_grpcs_int() -> None:
    """gRPC takes the cap as a C int: a body limit near 2 GiB must still start the picker."""
    from router.extproc.server import GRPC_MAX_MESSAGE, server_options

    for limit in (32 << 20, (1 << 31) - 1, 3_000_000_000):
        caps = dict(server_options(limit))
        cap = caps["grpc.max_receive_message_length"]
        assert cap == caps["grpc.max_send_message_length"]
        assert limit < cap <= GRPC_MAX_MESSAGE or cap == GRPC_MAX_MESSAGE
