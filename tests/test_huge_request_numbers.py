"""Clients choose `max_tokens` and `n`, of any size. vLLM refuses a max_tokens past its
max_model_len and an n past VLLM_MAX_N_SEQUENCES (its worker's environment) with a 400, and
caps a max_tokens past the room a prompt leaves: the router passes them on as any request
(never a 500 of its own), its load estimate capped as the engine caps the output. Real
router, simulated vLLM worker (which validates as vLLM 0.32 does), on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from engines.sim.latency import LatencyModel
from indexer.hashing import Namespace
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.core.decision import RouteRequest
from router.procs import serve_in_process
from router.routing import MAX_N_ESTIMATE, output_blocks
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)

FAST = SimConfig(latency=LatencyModel(ttft_base_ms=1.0, decode_ms_per_step=1.0))
HUGE = 10**400


@asynccontextmanager
async def router() -> AsyncIterator[httpx.AsyncClient]:
    async with run_fleet(1, FAST) as fleet:
        cfg = Config(workers=(WorkerConfig(fleet.urls[0]),), tokenizer=str(PACKAGED_TOKENIZER))
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            while not app.routing.ready:
                await client.get("/ready")
            yield client


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"max_tokens": str(HUGE)}, "max_tokens"),
        ({"max_tokens": 2**64, "n": 2}, "max_tokens"),
        ({"n": HUGE}, None),  # vLLM's own error for n names no param
    ],
    ids=["max_tokens", "max_tokens-digits", "max_tokens-past-uint64-n2", "n"],
)
async def test_a_huge_number_gets_the_engines_own_400(field: dict[str, Any], param: Any) -> None:
    async with router() as client:
        body = {"model": FAST.model, "prompt": "tell me everything", **field}
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError", err
    assert (param or "n") in err["message"], err


async def test_a_max_tokens_past_the_room_left_is_served_up_to_the_context() -> None:
    async with router() as client:
        body = {"model": FAST.model, "prompt": "tell me everything", "max_tokens": 4096}
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("max_tokens", "n", "context", "blocks"),
    [
        (16, 1, 4096, 1),  # as asked
        (HUGE, 1, 4096, (4096 - 100) // 16 + 1),  # the room the prompt leaves
        (HUGE, HUGE, 4096, -(-(4096 - 100) * MAX_N_ESTIMATE // 16)),
        (HUGE, 1, None, -(-((1 << 20) - 100) // 16)),  # context unknown
        (50, 1, 90, 0),  # a prompt past the context: the engine refuses it
    ],
    ids=["as-asked", "capped-by-context", "n-capped", "context-unknown", "no-room"],
)
def test_the_output_estimate_is_capped_as_the_engine_caps_it(
    max_tokens: int, n: int, context: int | None, blocks: int
) -> None:
    req = RouteRequest("m", Namespace("m"), 100, max_tokens=max_tokens, n=n)
    assert output_blocks(req, 16, context) == blocks
