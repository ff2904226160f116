"""Requests that run several sequences on one worker: `n` > 1, and a batch of prompts
(routed by the first, the others going along). vLLM serves both; the load counted at the
pick is every sequence's, and the engine's cached_tokens there count what a sibling had
just computed, so they are not held against the prediction (vLLM 0.32, cold cache, a
187-token prompt: n=1 reports 0 cached tokens, n=2 reports 160)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from test_proxy_wire import _json, fleet

from router.openai_req import parse

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("fields", "n"),
    [
        ({"prompt": "one"}, 1),
        ({"prompt": "one", "n": 3}, 3),
        ({"prompt": ["one", "two"]}, 2),
        ({"prompt": ["one", "two", "three"], "n": 2}, 6),
        ({"prompt": [[1, 2, 3], [4, 5]]}, 2),
    ],
    ids=["single", "n", "batch", "batch-n", "batch-ids"],
)
def test_the_sequences_a_request_runs_are_counted(fields: dict[str, Any], n: int) -> None:
    rin = parse("completion", json.dumps({"model": "m", **fields}).encode())
    assert rin.n == n


async def test_cached_tokens_of_several_sequences_are_not_judged_against_the_prediction() -> None:
    async def cold(scope: Any, receive: Any, send: Any, body: bytes) -> None:
        # a cold cache: what the siblings found of the first sequence's prefill
        usage = {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}
        await _json(send, {"choices": [], "usage": usage})

    prompt = " ".join(f"w{i}" for i in range(200))
    async with fleet(block_size=32) as (_app, url, worker), httpx.AsyncClient(base_url=url) as c:
        worker.handlers["/v1/completions"] = cold
        for body in ({"n": 2}, {"prompt": [prompt, prompt + " again"]}, {}):
            doc = {"model": "m", "prompt": prompt, "max_tokens": 1, **body}
            r = await c.post("/v1/completions", json=doc)
            assert r.status_code == 200, r.text
        page = (await c.get("/metrics")).text
    judged = [
        float(ln.rsplit(" ", 1)[1])
        for ln in page.splitlines()
        if ln.startswith("kvroute_prediction_fidelity_total{")
    ]
    assert sum(judged) == 1, [ln for ln in page.splitlines() if "fidelity" in ln]  # n=1 only
    reported = [ln for ln in page.splitlines() if ln.startswith("kvroute_reported_cached_tokens_t")]
    assert reported and all(ln.endswith(" 256.0") for ln in reported), reported
